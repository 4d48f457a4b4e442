"""``python -m tinyserve`` (``make demo``): the source story's three prompts, round by round.

It runs s0, s1 and s2 through the real engine and the default model under the budgets of
``presets.seed_rounds`` and prints the rounds as the story tells them: who was prefilled or
decoded, the tokens each request produced, the free blocks. A run of rounds in which nothing
happens but the same batch decoding is one line ("rounds 4–7: decode s0 s1 (×4)"); a preemption,
a swap and a finish stand out on a line of their own (in colour on a terminal). Then it prints
the three completions and a one-line summary.

``describe_round`` tells one round in full; chapters 00 and 09 print the engine's rounds with it.
torch loads only once the flags are parsed (``LLMEngine`` below), so ``--help`` answers at once.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import textwrap
import time
from typing import TYPE_CHECKING, TextIO

from tinyserve import presets
from tinyserve.config import DTYPE_NAMES, POLICIES, CacheConfig, ModelConfig, SchedulerConfig
from tinyserve.sequence import SamplingParams
from tinyserve.sim import RoundRecord

if TYPE_CHECKING:
    from tinyserve.engine import LLMEngine, RequestOutput


def __getattr__(name: str):
    # The engine (and torch with it) is imported on first use, after the flags are parsed; a test
    # may replace it with monkeypatch before ``run`` looks it up.
    if name == "LLMEngine":
        value = importlib.import_module("tinyserve.engine").LLMEngine
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def describe_round(r: RoundRecord) -> str:
    """One round in words, from its record (the same record the book's stepper shows)."""
    what = {"prefill": "prefill", "decode": "decode", "mixed": "prefill + decode", "idle": "idle"}[r.phase]
    lines = [f"Round {r.round}: {what} of [{', '.join(r.batch)}]"]
    for rid in r.swapped_in:
        lines.append(f"    {rid}: swapped back in from CPU")
    for rid in r.batch:
        toks = _tokens_of(r, rid)
        n = r.chunk_sizes.get(rid, 1)
        step = f"{n} prompt tokens" if n > 1 else "1 token"
        lines.append(f"    {rid}: ran {step}" + (f", produced {', '.join(map(repr, toks))}" if toks else ""))
    for rid in r.preempted:
        where = "swapped out to CPU" if rid in r.swapped_out else "sent back to waiting (recompute)"
        lines.append(f"    {rid}: preempted for lack of free blocks, {where}")
    for rid in r.finished:
        lines.append(f"    {rid}: finished")
    for rid in r.ignored:
        lines.append(f"    {rid}: ignored")
    lines.append(f"    queues: {_queues(r)}")
    tables = "  ".join(f"{k}:{v}" for k, v in r.block_tables.items()) or "-"
    cpu = "  ".join(f"{k}:{v}" for k, v in r.cpu_block_tables.items())
    lines.append(f"    GPU blocks free {r.free_gpu_blocks}/{r.num_gpu_blocks}  tables {tables}"
                 + (f"  | CPU tables {cpu}" if cpu else ""))
    return "\n".join(lines)


def _tokens_of(r: RoundRecord, rid: str) -> list[str]:
    # A request with several samples records each one's token under "rid.i".
    return [t for k, t in r.tokens.items() if k == rid or k.startswith(rid + ".")]


def _queues(r: RoundRecord) -> str:
    q = lambda ids: "[" + ", ".join(ids) + "]"  # noqa: E731
    return f"waiting {q(r.waiting)}  running {q(r.running)}  swapped {q(r.swapped)}"


# -- the demo's compact telling --------------------------------------------------------------------

def use_colour(stream: TextIO) -> bool:
    """ANSI colour only on a terminal, and never when $NO_COLOR is set (https://no-color.org)."""
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty()) and not os.environ.get("NO_COLOR") and os.environ.get("TERM") != "dumb"


COLOURS = {"preempted": "33", "swapped": "35", "finished": "32", "ignored": "31", "dim": "2", "bold": "1"}


def _paint(text: str, kind: str, colour: bool) -> str:
    return f"\033[{COLOURS[kind]}m{text}\033[0m" if colour else text


def _is_quiet(r: RoundRecord) -> bool:
    """Nothing happened but the batch running: no preemption, swap, finish or refusal."""
    return not (r.preempted or r.swapped_out or r.swapped_in or r.finished or r.ignored)


def _same_kind(a: RoundRecord, b: RoundRecord) -> bool:
    """Two quiet rounds that differ only in the tokens produced and the blocks taken: the same
    phase, batch, chunks and queues."""
    return (_is_quiet(a) and _is_quiet(b) and a.phase == b.phase and a.batch == b.batch
            and a.chunk_sizes == b.chunk_sizes
            and (a.waiting, a.running, a.swapped) == (b.waiting, b.running, b.swapped))


def group_rounds(history: list[RoundRecord]) -> list[list[RoundRecord]]:
    """Consecutive rounds, with each run of identical quiet rounds (``_same_kind``) as one group."""
    groups: list[list[RoundRecord]] = []
    for r in history:
        if groups and _same_kind(groups[-1][-1], r):
            groups[-1].append(r)
        else:
            groups.append([r])
    return groups


def describe_group(group: list[RoundRecord], previous: RoundRecord | None = None, colour: bool = False) -> list[str]:
    """The demo's lines for one group of rounds (``group_rounds``): one line for the rounds, what
    each request produced in them, and a line for each preemption, swap, finish or refusal, then
    the queues if they changed since ``previous``."""
    first, last = group[0], group[-1]
    label = f"round {first.round}" if len(group) == 1 else f"rounds {first.round}–{last.round}"
    what = {"prefill": "prefill", "decode": "decode", "mixed": "prefill+decode", "idle": "idle"}[first.phase]
    prefilled = first.prefills if first.prefills is not None else [k for k, n in first.chunk_sizes.items() if n > 1]
    prompt_tokens = sum(first.chunk_sizes.get(rid, 0) for rid in prefilled)
    batch = " ".join(first.batch) + (f" ({prompt_tokens} tokens)" if prompt_tokens else "")
    times = f" (×{len(group)})" if len(group) > 1 else ""
    produced = "  ".join(f"{rid} {''.join(toks)!r}" for rid in first.batch
                         if (toks := [t for r in group for t in _tokens_of(r, rid)]))
    head = f"{label + ':':<14}{what} {batch}{times}"
    blocks = _paint(f"[{last.free_gpu_blocks}/{last.num_gpu_blocks} blocks free]", "dim", colour)
    lines = [f"{head:<36} " + "  ".join(part for part in (produced, blocks) if part)]
    pad = " " * 14
    # Only a single round can carry these: a run of several is quiet by construction.
    for rid in first.swapped_in:
        lines.append(pad + _paint(f"SWAPPED IN  {rid}: back from CPU", "swapped", colour))
    for rid in first.preempted:
        where = "swapped out to CPU" if rid in first.swapped_out else "back to waiting, to recompute"
        lines.append(pad + _paint(f"PREEMPTED   {rid}: no free block, {where}",
                                  "swapped" if rid in first.swapped_out else "preempted", colour))
    for rid in first.finished:
        lines.append(pad + _paint(f"FINISHED    {rid}", "finished", colour))
    for rid in first.ignored:
        lines.append(pad + _paint(f"IGNORED     {rid}: it can never fit", "ignored", colour))
    if previous is None or (previous.waiting, previous.running, previous.swapped) != \
            (last.waiting, last.running, last.swapped):
        lines.append(pad + _paint(_queues(last), "dim", colour))
    return lines


def describe_history(history: list[RoundRecord], colour: bool = False) -> list[str]:
    """All of a run's rounds as the demo prints them."""
    lines: list[str] = []
    previous = None
    for group in group_rounds(history):
        lines += describe_group(group, previous, colour)
        previous = group[-1]
    return lines


def summary_line(history: list[RoundRecord], outputs: list[RequestOutput], wall_s: float, dtype: str,
                 device: str) -> str:
    """Requests, tokens generated, rounds, preemptions and swaps, wall time and rate, in one line."""
    tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    preemptions = sum(len(r.preempted) for r in history)
    swaps_out = sum(len(r.swapped_out) for r in history)
    swaps_in = sum(len(r.swapped_in) for r in history)
    rate = tokens / wall_s if wall_s > 0 else float("inf")
    dtype = str(dtype).removeprefix("torch.")
    return (f"{len(outputs)} requests, {tokens} tokens generated in {len(history)} rounds, "
            f"{preemptions} preemptions ({swaps_out} swapped out, {swaps_in} swapped in); "
            f"{wall_s:.2f} s, {rate:.1f} tok/s, {dtype} on {device}")


def run(args: argparse.Namespace, out: TextIO | None = None) -> tuple[LLMEngine, list[RequestOutput]]:
    out = out or sys.stdout
    colour = use_colour(out)
    say = lambda *a: print(*a, file=out, flush=True)  # noqa: E731
    preset = presets.seed_rounds(args.preemption_mode, policy=args.policy, max_tokens=args.max_tokens)
    sc, cc = preset.scheduler_config, preset.cache_config
    scheduler_config = SchedulerConfig(max_num_batched_tokens=args.max_num_batched_tokens or sc.max_num_batched_tokens,
                                       max_num_seqs=sc.max_num_seqs, max_model_len=args.max_model_len,
                                       policy=args.policy, preemption_mode=sc.preemption_mode)
    num_cpu_blocks = cc.num_cpu_blocks if args.num_cpu_blocks is None else args.num_cpu_blocks
    cache_config = CacheConfig(block_size=args.block_size or cc.block_size,
                               num_gpu_blocks=args.num_gpu_blocks or cc.num_gpu_blocks,
                               num_cpu_blocks=num_cpu_blocks, watermark=cc.watermark,
                               enable_prefix_caching=cc.enable_prefix_caching)
    model_config = ModelConfig(model=args.model, device=args.device, dtype=args.dtype, seed=args.seed)
    say(f"Loading {args.model} (torch, then the weights; the first run converts them once)...")
    start = time.perf_counter()
    engine_class = sys.modules[__name__].LLMEngine  # through the module: imported here, or a test's stand-in
    engine = engine_class(model_config, cache_config, scheduler_config, attention_backend=args.attention_backend,
                          record_history=True)  # each round is printed from its record
    device, dtype = engine.executor.device, engine.executor.dtype
    say(f"Loaded in {time.perf_counter() - start:.1f} s on {device} ({str(dtype).removeprefix('torch.')}); "
        f"attention backend {engine.executor.backend_name}; {cache_config.num_gpu_blocks} GPU blocks of "
        f"{cache_config.block_size} tokens, {cache_config.num_cpu_blocks} CPU blocks; "
        f"token budget {scheduler_config.max_num_batched_tokens} per round")
    prompts = args.prompt or list(preset.prompts.values())
    names = list(preset.prompts) if not args.prompt else [f"s{i}" for i in range(len(prompts))]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    for name, prompt in zip(names, prompts):
        engine.add_request(name, prompt, params)
        say(f"  {name}: {prompt!r} -> {len(engine.scheduler.waiting[-1].prompt_token_ids)} tokens")
    say()
    results: dict[str, RequestOutput] = {}
    start = time.perf_counter()
    # A quiet round is held back until the next one shows whether it joins a run of identical rounds.
    pending: list[RoundRecord] = []
    previous: RoundRecord | None = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                results[o.request_id] = o
        r = engine.history[-1]
        if pending and not _same_kind(pending[-1], r):
            say("\n".join(describe_group(pending, previous, colour)))
            previous, pending = pending[-1], []
        pending.append(r)
    if pending:
        say("\n".join(describe_group(pending, previous, colour)))
    wall = time.perf_counter() - start
    say("\nCompletions:")
    for name, prompt in zip(names, prompts):
        o = results[name]
        c = o.outputs[0]
        note = f" ({o.error})" if o.error else ""
        say(f"  {name}: {prompt!r} + {c.text!r}  [{c.finish_reason}, {len(c.token_ids)} tokens]{note}")
    outputs = [results[n] for n in names]
    say(_paint(summary_line(engine.history, outputs, wall, str(dtype), str(device)), "bold", colour))
    return engine, outputs


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Description and examples as written (plain text, wrapped by hand); every option's default
    after its help, unless the help already says what the default is (a default of None means
    something only words can say). The server's command line uses it too."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or not action.option_strings or action.default is argparse.SUPPRESS:
            return text
        return f"{text} (default: %(default)s)"

    def _split_lines(self, text: str, width: int) -> list[str]:
        # Never break a flag's name at its hyphens ("--max-" / "num-seqs").
        return textwrap.wrap(self._whitespace_matcher.sub(" ", text).strip(), width, break_on_hyphens=False)


DESCRIPTION = """\
Run the book's story of three prompts (s0, s1, s2) through the real engine and
the default model, SmolLM2-135M, under budgets small enough that s2 is preempted
and swapped: 4 GPU blocks of 5 tokens, 10 tokens per round. It prints each round
(who ran, what each request produced, preemptions, swaps, finishes), then the
completions and a one-line summary.
"""

EXAMPLES = """\
examples:
  python -m tinyserve                              # the story (make demo)
  python -m tinyserve --preemption-mode recompute  # the preempted start over
  python -m tinyserve --policy v1 --max-tokens 16
  python -m tinyserve --prompt "The capital of France is" --prompt "Once upon"
  NO_COLOR=1 python -m tinyserve                   # no colour, even on a terminal
"""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tinyserve", description=DESCRIPTION, epilog=EXAMPLES,
                                formatter_class=HelpFormatter)
    g = p.add_argument_group("the story")
    g.add_argument("--prompt", action="append", help="a prompt; repeat for several (default: the story's s0, s1, s2)")
    g.add_argument("--max-tokens", type=int, default=8, help="tokens each request generates")
    g = p.add_argument_group("scheduling")
    g.add_argument("--policy", choices=list(POLICIES), default="vllm",
                   help="the scheduler's policy: 'vllm' (v0.4's), 'orca' or 'v1'")
    g.add_argument("--preemption-mode", choices=["swap", "recompute"], default="auto",
                   help="default: swap, as the story has it; recompute under --policy v1, its only mode")
    g.add_argument("--block-size", type=int, default=None, help="tokens per KV-cache block (default: the story's 5)")
    g.add_argument("--num-gpu-blocks", type=int, default=None, help="KV-cache blocks (default: the story's 4)")
    g.add_argument("--num-cpu-blocks", type=int, default=None,
                   help="CPU blocks for swapped-out requests (default: the story's 4)")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens in one round at most (default: the story's 10)")
    g.add_argument("--max-model-len", type=int, default=20, help="longest prompt + output in tokens")
    g = p.add_argument_group("model")
    g.add_argument("--model", default="smollm2-135m", help="'smollm2-135m' or a local Hugging Face directory")
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: CUDA when torch sees one")
    g.add_argument("--dtype", default="auto", choices=list(DTYPE_NAMES),
                   help="auto: bfloat16 on CUDA (float16 without bf16), on the CPU bfloat16 where it is native, "
                        "else float32")
    g.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"],
                   help="auto: the Triton kernel on CUDA, batched torch attention on the CPU")
    g.add_argument("--seed", type=int, default=0, help="the engine's random seed (the demo decodes greedily)")
    return p


def main(argv: list[str] | None = None) -> None:
    run(parser().parse_args(argv))


if __name__ == "__main__":
    main()
