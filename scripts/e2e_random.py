"""End to end on a GPU machine without the default model's weights: s0/s1/s2 through the engine
on a random-weight model of SmolLM2-135M's shape.

It checks what random weights can check: the rounds equal the simulator's records for the same
preset, every attention backend (the torch reference, torch-batched, and Triton on CUDA) produces
the reference's greedy tokens, and no block leaks.
Prompts are split into words by a stand-in tokenizer (the real one ships with the weights), which
keeps s0, s1 and s2 at 5, 5 and 3 tokens. Writes a JSON summary to --out.

    python scripts/e2e_random.py --device cuda --out /tmp/e2e.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from tinyserve import presets, sim  # noqa: E402
from tinyserve.__main__ import describe_round  # noqa: E402
from tinyserve.config import ModelConfig  # noqa: E402
from tinyserve.engine import LLMEngine  # noqa: E402
from tinyserve.models.loader import LoadedModel, random_model, smollm2_135m_config  # noqa: E402
from tinyserve.sequence import SamplingParams  # noqa: E402
from tinyserve.worker import Worker  # noqa: E402


class WordTokenizer:
    """Words and punctuation marks become stable ids; enough to drive the engine."""

    eos_token_id = 2

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.words: dict[str, int] = {}

    def encode(self, text: str) -> list[int]:
        return [self.words.setdefault(w, 10 + len(self.words)) for w in re.findall(r"\w+|[^\w\s]", text)]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(f"<{i}>" for i in ids)


def run(backend: str, device: str, dtype: str, mode: str) -> tuple[LLMEngine, dict[str, list[int]], float]:
    hf_config = smollm2_135m_config()
    model = random_model(hf_config, device=device, dtype=dtype, seed=0, attention_backend=backend)
    loaded = LoadedModel(model=model, tokenizer=WordTokenizer(hf_config.vocab_size), hf_config=hf_config, path=None)
    preset = presets.seed_rounds(mode)
    mc = ModelConfig(model="random", device=device, dtype=dtype)
    engine = LLMEngine(mc, preset.cache_config, preset.scheduler_config,
                       executor=Worker(mc, attention_backend=backend, loaded=loaded), record_history=True)
    params = SamplingParams(temperature=0.0, max_tokens=preset.max_tokens, ignore_eos=True)
    for rid, prompt in preset.prompts.items():
        engine.add_request(rid, prompt, params)
    tokens: dict[str, list[int]] = {}
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.outputs[0].token_ids
    if device == "cuda":
        torch.cuda.synchronize()
    return engine, tokens, time.perf_counter() - start


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    backends = ["torch", "torch-batched"] + (["triton"] if args.device == "cuda" else [])
    summary: dict = {"device": args.device, "dtype": dtype, "runs": {}}
    ok = True
    for mode in ("swap", "recompute"):
        preset = presets.seed_rounds(mode)
        expected = sim.simulate(preset.requests, preset.scheduler_config, preset.cache_config)
        results = {}
        for backend in backends:
            engine, tokens, seconds = run(backend, args.device, dtype, mode)
            rounds_match = [(r.batch, r.preempted, r.waiting, r.running, r.swapped) for r in engine.history] == \
                           [(r.batch, r.preempted, r.waiting, r.running, r.swapped) for r in expected]
            bm = engine.scheduler.block_manager
            leaks = (bm.num_total_gpu_blocks - bm.get_num_free_gpu_blocks(),
                     bm.num_total_cpu_blocks - bm.get_num_free_cpu_blocks())
            results[backend] = tokens
            ok &= rounds_match and leaks == (0, 0)
            summary["runs"][f"{mode}/{backend}"] = {"rounds_match_simulator": rounds_match, "leaked_blocks": leaks,
                                                    "seconds": round(seconds, 3), "tokens": tokens}
            print(f"--- {mode} / {backend}: rounds match simulator: {rounds_match}; leaked blocks {leaks}; "
                  f"{seconds:.2f} s")
            if backend == backends[0]:
                for r in engine.history[:4]:
                    print(describe_round(r))
        for backend in backends[1:]:
            same = results[backend] == results["torch"]
            summary["runs"][f"{mode}/{backend}_equals_torch"] = same
            print(f"--- {mode}: {backend} greedy tokens equal the torch reference's: {same}")
            ok &= same
    summary["ok"] = bool(ok)
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
