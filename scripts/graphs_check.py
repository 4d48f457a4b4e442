"""Decode steps with and without graphs on a random-weight SmolLM2-shaped model, on any device.

On CUDA the graphs are CUDA graphs (``tinyserve/graphs/cuda.py``: static buffers, one capture per
size); on the CPU they are ``torch.compile``'d graphs (``graphs/compiled.py``). Two engines on
the same weights, ``enforce_eager=True`` and ``False``, run the same greedy requests: the script
reports how many output tokens agree (exactly, in float32; in half precision a fused reduction
may flip a near-tie, so the first difference is reported with its position), and the median
decode step at each batch size, eager and with graphs, the two taking turns. Writes a JSON
summary to --out. ``scripts/gpu_check.sh`` runs it on a GPU.

    python scripts/graphs_check.py --device cuda --out /tmp/graphs.json
    python scripts/graphs_check.py --device cpu --dtype float32 --batches 1 4 --steps 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from e2e_random import WordTokenizer  # noqa: E402

from tinyserve import SamplingParams  # noqa: E402
from tinyserve.config import CacheConfig, ModelConfig, SchedulerConfig  # noqa: E402
from tinyserve.engine import LLMEngine  # noqa: E402
from tinyserve.models.loader import LoadedModel, random_model, smollm2_135m_config  # noqa: E402
from tinyserve.worker import Worker  # noqa: E402


def build(device: str, dtype: str, enforce_eager: bool, max_num_seqs: int) -> LLMEngine:
    hf_config = smollm2_135m_config()
    model = random_model(hf_config, device=device, dtype=dtype, seed=0)
    loaded = LoadedModel(model=model, tokenizer=WordTokenizer(hf_config.vocab_size), hf_config=hf_config, path=None)
    mc = ModelConfig(model="random", device=device, dtype=dtype, enforce_eager=enforce_eager, max_model_len=2048)
    worker = Worker(mc, loaded=loaded, max_num_seqs=max_num_seqs)
    sc = SchedulerConfig(max_num_seqs=max_num_seqs, max_model_len=2048)
    engine = LLMEngine(mc, CacheConfig(block_size=16, num_gpu_blocks=1024, num_cpu_blocks=0), sc, executor=worker)
    worker.warm_up_graphs()
    return engine


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def fill(engine: LLMEngine, batch: int, max_tokens: int) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"r{i}", None, params, prompt_token_ids=[10 + (7 * i + j) % 900 for j in range(24 + i)])
    while any(not g.get_seqs()[0].get_output_len() for g in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()


def generate(engine: LLMEngine, batch: int, max_tokens: int) -> dict[str, list[int]]:
    fill(engine, batch, max_tokens)
    out: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                out[o.request_id] = o.outputs[0].token_ids
    return out


def step_times(engines: dict[str, LLMEngine], batch: int, steps: int, device: str) -> dict[str, float]:
    for engine in engines.values():
        fill(engine, batch, steps + 4)
    times: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(steps):
        for name, engine in engines.items():
            sync(device)
            t = time.perf_counter()
            engine.step()
            sync(device)
            times[name].append(time.perf_counter() - t)
    for engine in engines.values():
        engine.abort_request([f"r{i}" for i in range(batch)])
    return {name: round(1000 * statistics.median(v), 3) for name, v in times.items()}


def first_difference(a: dict[str, list[int]], b: dict[str, list[int]]) -> dict | None:
    for rid in sorted(a):
        for pos, (x, y) in enumerate(zip(a[rid], b[rid])):
            if x != y:
                return {"request": rid, "position": pos}
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 16, 32])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    top = max(args.batches)
    engines = {"eager": build(args.device, dtype, True, top)}
    t = time.perf_counter()
    engines["graphs"] = build(args.device, dtype, False, top)
    build_s = time.perf_counter() - t
    kind = type(engines["graphs"].executor.decode_graphs).__name__
    print(f"{args.device} {dtype}: {kind} for sizes {engines['graphs'].executor.decode_graphs.sizes}, "
          f"built in {build_s:.1f} s")
    tokens = {name: generate(engine, min(top, 8), 24) for name, engine in engines.items()}
    total = sum(len(v) for v in tokens["eager"].values())
    same = sum(x == y for rid in tokens["eager"] for x, y in zip(tokens["eager"][rid], tokens["graphs"][rid]))
    diff = first_difference(tokens["eager"], tokens["graphs"])
    print(f"greedy tokens equal: {same}/{total}; first difference: {diff}")
    rows = []
    for batch in args.batches:
        med = step_times(engines, batch, args.steps, args.device)
        rows.append(dict(batch=batch, eager_ms=med["eager"], graphs_ms=med["graphs"],
                         speedup=round(med["eager"] / med["graphs"], 3)))
        print(rows[-1], flush=True)
    summary = dict(device=args.device, dtype=dtype, graphs=kind, build_s=round(build_s, 2), tokens_equal=same,
                   tokens_total=total, first_difference=diff, steps=rows)
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=2))
    exact_expected = dtype == "float32"
    return 0 if same == total or not exact_expected else 1


if __name__ == "__main__":
    sys.exit(main())
