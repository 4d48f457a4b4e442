"""``python -m tinyserve`` (``make demo``): the source story's three prompts, round by round.

It runs s0, s1 and s2 through the real engine and the default model under the budgets of
``presets.seed_rounds`` and prints each round as the story tells it: who was prefilled or
decoded, who was preempted or swapped, the token each request produced, the free blocks. Then
it prints the three completions.
"""

from __future__ import annotations

import argparse
import time

from tinyserve import presets
from tinyserve.config import DTYPE_NAMES, POLICIES, CacheConfig, ModelConfig, SchedulerConfig
from tinyserve.engine import LLMEngine, RequestOutput
from tinyserve.sequence import SamplingParams
from tinyserve.sim import RoundRecord


def describe_round(r: RoundRecord) -> str:
    """One round in words, from its record (the same record the book's stepper shows)."""
    what = {"prefill": "prefill", "decode": "decode", "mixed": "prefill + decode", "idle": "idle"}[r.phase]
    lines = [f"Round {r.round}: {what} of [{', '.join(r.batch)}]"]
    for rid in r.swapped_in:
        lines.append(f"    {rid}: swapped back in from CPU")
    for rid in r.batch:
        # A request with several samples records each one's token under "rid.i".
        toks = [t for k, t in r.tokens.items() if k == rid or k.startswith(rid + ".")]
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
    q = lambda ids: "[" + ", ".join(ids) + "]"  # noqa: E731
    lines.append(f"    queues: waiting {q(r.waiting)}  running {q(r.running)}  swapped {q(r.swapped)}")
    tables = "  ".join(f"{k}:{v}" for k, v in r.block_tables.items()) or "-"
    cpu = "  ".join(f"{k}:{v}" for k, v in r.cpu_block_tables.items())
    lines.append(f"    GPU blocks free {r.free_gpu_blocks}/{r.num_gpu_blocks}  tables {tables}"
                 + (f"  | CPU tables {cpu}" if cpu else ""))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> tuple[LLMEngine, list[RequestOutput]]:
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
    start = time.perf_counter()
    engine = LLMEngine(model_config, cache_config, scheduler_config, attention_backend=args.attention_backend,
                       record_history=True)  # each round is printed from its record
    print(f"Loaded {args.model} on {engine.executor.device} ({engine.executor.dtype}) in "
          f"{time.perf_counter() - start:.1f} s; attention backend {engine.executor.backend_name}; "
          f"{cache_config.num_gpu_blocks} GPU blocks of {cache_config.block_size} tokens, "
          f"{cache_config.num_cpu_blocks} CPU blocks; token budget {scheduler_config.max_num_batched_tokens} per round")
    prompts = args.prompt or list(preset.prompts.values())
    names = list(preset.prompts) if not args.prompt else [f"s{i}" for i in range(len(prompts))]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    for name, prompt in zip(names, prompts):
        engine.add_request(name, prompt, params)
        print(f"  {name}: {prompt!r} -> {len(engine.scheduler.waiting[-1].prompt_token_ids)} tokens")
    print()
    results: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out
        print(describe_round(engine.history[-1]))
    print("\nCompletions:")
    for name, prompt in zip(names, prompts):
        out = results[name]
        c = out.outputs[0]
        note = f" ({out.error})" if out.error else ""
        print(f"  {name}: {prompt!r} + {c.text!r}  [{c.finish_reason}, {len(c.token_ids)} tokens]{note}")
    return engine, [results[n] for n in names]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tinyserve", description=__doc__.splitlines()[0])
    p.add_argument("--prompt", action="append", help="a prompt (repeat for several); default: s0, s1, s2")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--policy", choices=list(POLICIES), default="vllm")
    p.add_argument("--preemption-mode", choices=["swap", "recompute"], default="auto",
                   help="default: swap, as the story has it; recompute under --policy v1, its only mode")
    p.add_argument("--block-size", type=int, default=None, help="default: the preset's 5")
    p.add_argument("--num-gpu-blocks", type=int, default=None, help="default: the preset's 4")
    p.add_argument("--num-cpu-blocks", type=int, default=None, help="default: the preset's 4")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: the preset's 10")
    p.add_argument("--max-model-len", type=int, default=20)
    p.add_argument("--model", default="smollm2-135m", help="smollm2-135m or a local Hugging Face directory")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default="auto", choices=list(DTYPE_NAMES))
    p.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"])
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv: list[str] | None = None) -> None:
    run(parser().parse_args(argv))


if __name__ == "__main__":
    main()
