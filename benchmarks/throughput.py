"""Throughput: tinyserve against transformers ``generate`` and ``generate_batch``, side by side.

Every system gets the same requests as token ids and generates exactly the tokens each asks for
(greedy, ``ignore_eos``), so tokens/s compare like with like and the outputs can be compared
token for token. The systems run interleaved (A B C A B C ... with ``--repeats``) so that a slow
spell of a shared machine hits all of them alike; the table reports medians and tinyserve's
ratios.

- headline: a mixed workload (64 requests, outputs drawn from 8..128 tokens, prompts from
  16..256) and a uniform one (32 requests x 64 tokens). tinyserve runs with
  ``max_num_seqs=32`` under its default "vllm" policy and under "orca" (prefills join decode
  rounds); ``generate`` runs left-padded static batches of 32; ``generate_batch`` (transformers'
  continuous batching) at most 32 requests at a time.
- sweeps, at a quarter of the scale (8 sequences a batch; outputs 8..64, prompts 16..64): the
  number of requests, and the spread of output lengths around the same mean.

    python benchmarks/throughput.py                  # ~11 minutes on 2 quiet CPU cores
    python benchmarks/throughput.py --no-sweeps      # the headline only, ~6 minutes
    python benchmarks/throughput.py --quick          # a tiny run (seconds), for the smoke test
    python benchmarks/throughput.py --device cuda --model random-1b   # GPU: random weights

The grid of workload shapes (prompt and output lengths, batch caps, chunked prefill) is
``sweep.py``; ``roofline.py`` puts a decode step against the machine's limits and
``profile_step.py`` splits one into its parts.

Every system runs in one dtype: ``--dtype``, by default what tinyserve's ``dtype="auto"`` picks
(bfloat16 on a CPU with native bf16, float32 elsewhere). It writes ``throughput.csv``, and
``step_times.csv`` / ``step_times_orca.csv`` (where each tinyserve step's time went on the mixed
workload), to ``--out`` (default ``benchmarks/results``); in bfloat16 the same names end in
``_bfloat16``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script from a checkout without installing
    sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))
# As the Makefile does: OpenMP threads that busy-wait make torch many times slower whenever
# another process shares the cores. Set before torch starts its threads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
from common import RESULTS_DIR, dtype_suffix, machine, table  # noqa: E402

from tinyserve.config import dtype_name  # noqa: E402
from tinyserve.lab import perf  # noqa: E402

BATCH = 32
SWEEP_BATCH = 8


def random_model_dir(shape: str, dtype: torch.dtype) -> Path:
    """A Hugging Face directory with random weights of SmolLM2-135M's or a 1B Llama's shape and
    SmolLM2's tokenizer, so both tinyserve and transformers load the same model (GPU runs)."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    from tinyserve.models.loader import random_state_dict, resolve_model_dir, smollm2_135m_config

    if shape == "random-smollm2":
        config = smollm2_135m_config()
    elif shape == "random-1b":  # Llama-3.2-1B's shape
        config = LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                             num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                             max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0,
                             tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    else:
        raise ValueError(f"unknown model shape {shape!r}")
    out = Path(tempfile.mkdtemp(prefix=f"tinyserve-{shape}-"))
    config.save_pretrained(out)
    save_file({k: v.to(dtype).contiguous() for k, v in random_state_dict(config).items()},
              str(out / "model.safetensors"))
    try:
        for f in resolve_model_dir("smollm2-135m").glob("tokenizer*"):
            shutil.copy(f, out)
    except RuntimeError:  # a machine without the default model's package: any tokenizer will do
        _byte_level_tokenizer().save_pretrained(out)
    return out


def _byte_level_tokenizer():
    """A small BPE tokenizer trained on the prompts' own text (nothing to download)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=2000, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([perf.PASSAGE], trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")


def build_systems(model: str, device: str, batch: int, with_orca: bool = True, dtype: str = "auto") -> list:
    """tinyserve (default "vllm" policy, and "orca" when asked), static ``generate`` and
    ``generate_batch``, all allowed ``batch`` sequences at a time, on the same weights and in
    the dtype tinyserve resolves ``dtype`` to."""
    from tinyserve import LLM

    # On a GPU the engine would take 90% of memory for its cache by default; leave room for
    # transformers' model and caches. No swap space: nothing is preempted with this much cache.
    kw = dict(model=model, device=device, dtype=dtype, max_num_seqs=batch, swap_space=0.0,
              gpu_memory_utilization=0.35 if device.startswith("cuda") else 0.9)
    llm = LLM(**kw)
    systems = [perf.TinyserveSystem(llm)]
    if with_orca:
        systems.append(perf.TinyserveSystem(LLM(**kw, policy="orca"), name="tinyserve-orca"))
    executor = llm.engine.executor
    hf = perf.load_hf_model(model, device=executor.device, dtype=executor.dtype)
    pad = llm.tokenizer.pad_token_id if llm.tokenizer.pad_token_id is not None else 0
    systems.append(perf.StaticGenerateSystem(hf, batch, pad))
    try:
        from transformers import ContinuousBatchingConfig  # noqa: F401  (transformers 5)
    except ImportError:
        print("this transformers has no ContinuousBatchingConfig: generate_batch is left out")
        return systems
    # generate_batch may use as many KV blocks (of the same size) as tinyserve's cache has.
    systems.append(perf.GenerateBatchSystem(hf, batch, num_blocks=llm.engine.cache_config.num_gpu_blocks,
                                            pad_token_id=pad))
    return systems


def rows_for(experiment: str, w: perf.Workload, runs: dict[str, list[perf.RunResult]], **extra) -> list[dict]:
    ours = runs["tinyserve"][0]
    rows = []
    for system, results in runs.items():
        rate = perf.median_rate(results)
        rows.append(dict(experiment=experiment, workload=w.name, system=system, num_requests=w.num_requests,
                         min_out=min(w.output_lens), max_out=max(w.output_lens),
                         spread=max(w.output_lens) - min(w.output_lens), prompt_tokens=w.prompt_tokens,
                         output_tokens=w.output_tokens, repeats=len(results),
                         seconds=round(w.output_tokens / rate, 3), tokens_per_s=round(rate, 2),
                         same_outputs_as_tinyserve=round(perf.agreement(ours, results[0]), 3), **extra))
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=1, help="interleaved repeats of the headline workloads")
    ap.add_argument("--quick", action="store_true", help="tiny workloads, no sweeps (a smoke test)")
    ap.add_argument("--no-sweeps", action="store_true")
    ap.add_argument("--model", default="smollm2-135m",
                    help="smollm2-135m, a local HF directory, or random-smollm2 / random-1b (random weights)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                    help="every system's dtype (default: what tinyserve's dtype=\"auto\" picks)")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = ap.parse_args(argv)
    model = args.model
    if model.startswith("random-"):
        tmp = random_model_dir(model, torch.bfloat16 if args.device.startswith("cuda") else torch.float32)
        try:
            return run(args, str(tmp))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    run(args, model)


def run(args: argparse.Namespace, model: str) -> None:
    started = time.perf_counter()
    batch = 4 if args.quick else BATCH
    print(f"machine: {machine()}")
    print(f"model: {args.model}, device {args.device}")
    systems = build_systems(model, args.device, batch, dtype=args.dtype)
    tok = systems[0].llm.tokenizer
    dtype = dtype_name(systems[0].llm.engine.executor.dtype)
    suffix = dtype_suffix(dtype)
    print(f"every system runs in {dtype}")
    if args.quick:
        headline = [perf.mixed_workload(tok, 8, 2, 12, 4, 24), perf.uniform_workload(tok, 4, 8, 4, 24)]
    else:
        headline = [perf.mixed_workload(tok), perf.uniform_workload(tok)]
    # Warm-up (untimed): first calls pay for lazy initialisation in every library.
    perf.compare(systems, perf.uniform_workload(tok, 2, 2, 4, 8, seed=1))

    rows: list[dict] = []
    print(f"headline: at most {batch} sequences per batch in every system")
    for w in headline:
        print(f"{w.name}: {w.num_requests} requests, {w.prompt_tokens} prompt tokens, {w.output_tokens} to generate")
        runs = perf.compare(systems, w, 1 if args.quick else args.repeats, log=print)
        rows += rows_for("headline", w, runs, batch=batch)
        if w is headline[0]:
            for s in systems[:2]:
                name = "step_times" if s.name == "tinyserve" else f"step_times_{s.name.split('-')[1]}"
                steps = [{k: (round(v, 6) if isinstance(v, float) else v) for k, v in r.items()} for r in s.last_steps]
                perf.write_results(name + suffix, steps, args.out)
                shares = perf.step_shares(s.last_steps)
                print(f"{s.name} step time: " + ", ".join(f"{k} {100 * v:.1f}%" for k, v in shares.items()))
    del systems
    gc.collect()

    if not (args.quick or args.no_sweeps):
        # Trends at a quarter of the scale (8 sequences a batch, shorter requests), to fit the
        # time budget: outputs 8..64 tokens (mean 36), prompts 16..64.
        sweep = build_systems(model, args.device, SWEEP_BATCH, with_orca=False, dtype=args.dtype)
        print(f"sweeps: at most {SWEEP_BATCH} sequences per batch in every system")
        for n in (4, 8, 16, 32):
            w = perf.mixed_workload(tok, n, 8, 64, 16, 64, seed=n)
            rows += rows_for("requests", w, perf.compare(sweep, w, 1, log=print), batch=SWEEP_BATCH)
        base = next(r for r in rows if r["experiment"] == "requests" and r["num_requests"] == 32)["workload"]
        for spread in (0, 28):
            w = perf.mixed_workload(tok, 32, 36 - spread // 2, 36 + spread // 2, 16, 64, seed=32)  # same prompts
            rows += rows_for("spread", w, perf.compare(sweep, w, 1, log=print), batch=SWEEP_BATCH)
        rows += [dict(r, experiment="spread") for r in rows if r["experiment"] == "requests" and r["workload"] == base]

    cols = ["experiment", "workload", "batch", "system", "output_tokens", "seconds", "tokens_per_s",
            "same_outputs_as_tinyserve"]
    print()
    print(table(rows, cols))
    print()
    for w in headline:
        here = [r for r in rows if r["experiment"] == "headline" and r["workload"] == w.name]
        for ours in (r for r in here if r["system"].startswith("tinyserve")):
            ratios = {r["system"]: ours["tokens_per_s"] / r["tokens_per_s"] for r in here
                      if not r["system"].startswith("tinyserve")}
            print(f"{w.name}: {ours['system']} is " + ", ".join(f"{v:.2f}x {k}" for k, v in ratios.items()))
    path = perf.write_results("throughput" + suffix, [dict(r, dtype=dtype) for r in rows], args.out)
    meta = dict(machine=machine(), model=args.model, device=args.device, dtype=dtype, repeats=args.repeats,
                seconds=round(time.perf_counter() - started, 1))
    (args.out / f"throughput{suffix}_machine.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(f"wrote {path} ({meta['seconds']} s)")


if __name__ == "__main__":
    main()
