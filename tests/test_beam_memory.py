"""The beam-memory benchmark's counts (benchmarks/beam_memory.py) on the tiny model, against counts
made here from the sequences alone.

- Beam search: the beams of a group are paths in one token tree, so two beams hold the same
  physical block exactly where they forked after it was full: a full block whose tokens *and all
  tokens before it* agree is one block, every other block (a partial last block, after the step's
  copy-on-write) is the beam's own. Counting distinct keys ``tokens[:end of block]`` gives the
  with-sharing count without reading a block table; ``ceil(len / block_size)`` per beam gives the
  without count. Both must equal the benchmark's at every step, for width 2 on a short prompt at
  block size 4 (hand-sized) and for wider beams on several prompts at once.
- Parallel sampling: the samples fork at the prompt, so they share its full blocks and nothing
  else: ``prompt_len // bs + sum(ceil(len / bs) - prompt_len // bs)``.
- Sharing never holds more than without, and never less than the longest sequence's own blocks;
  the prefill step shares nothing; the summary is the paper's ratio of sums.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest
from bench_loader import load_benchmark

from tinyserve import LLM
from tinyserve.sequence import SequenceStatus

bm = load_benchmark("beam_memory")

PROMPTS = ["the cat sat", "a long road goes over the hills and far away to the sea", "one two three four five"]


def _llm(model_dir: Path, block_size: int) -> LLM:
    return LLM(model=str(model_dir), device="cpu", dtype="float32", block_size=block_size, num_gpu_blocks=512,
               swap_space=0.0, enable_prefix_caching=False)


def _running(scheduler) -> dict[str, list]:
    return {g.request_id: g.get_seqs(SequenceStatus.RUNNING) for g in scheduler.running}


def _beam_reference(seqs, bs: int) -> tuple[int, int]:
    """(with, without) from the beams' tokens: full blocks keyed by every token up to their end."""
    keys = set()
    for s in seqs:
        tokens = s.get_token_ids()
        for j in range(math.ceil(len(tokens) / bs)):
            end = (j + 1) * bs
            # The block that holds the newest token is the beam's own (a fresh block, or its
            # copy-on-write copy); a full one before it is shared with every beam of that prefix.
            keys.add(tuple(tokens[:end]) if end < len(tokens) else ("own", s.seq_id))
    return len(keys), sum(math.ceil(s.get_len() / bs) for s in seqs)


def _run(model_dir: Path, bs: int, prompts: list[str], params, reference):
    """Run the benchmark's measurement and compare each request's counts with ``reference``."""
    seen = []

    def check(scheduler, count):
        for rid, seqs in _running(scheduler).items():
            assert count.requests[rid] == (*reference(seqs, bs), len(seqs)), (count.step, rid)
            seen.append((count.step, rid, count.requests[rid], [s.get_token_ids() for s in seqs]))

    run = bm.measure(_llm(model_dir, bs), prompts, params, on_step=check)
    assert len(seen) >= len(run.steps)  # every step was compared
    return run, seen


def test_width_2_short_prompt_block_size_4_matches_the_token_tree(tiny_model_dir):
    run, seen = _run(tiny_model_dir, 4, PROMPTS[:1], [bm.beam_params(2, max_tokens=12)], _beam_reference)
    prompt_len = len(seen[0][3][0])
    first = seen[0][2]
    assert first == (math.ceil(prompt_len / 4), math.ceil(prompt_len / 4), 1)  # the prefill: one sequence
    widths = [n for _, _, (_, _, n), _ in seen]
    assert widths[1:] and set(widths[1:]) == {2}  # two beams from the first decode on
    # The beams shared a block of *generated* tokens at some step (not only the prompt's): the
    # case exercises prefix sharing beyond the prompt.
    prompt_full = prompt_len // 4
    assert any(w < wo - prompt_full for _, _, (w, wo, _), _ in seen[1:])
    assert len(run.steps) == 12  # no early stop at max_tokens 12 with early_stopping=False


def test_wider_beams_on_several_prompts_match_the_token_tree(tiny_model_dir):
    params = [bm.beam_params(w, max_tokens=10) for w in (3, 4, 2)]
    run, seen = _run(tiny_model_dir, 4, PROMPTS, params, _beam_reference)
    assert {rid for _, rid, _, _ in seen} == {"bm-0", "bm-1", "bm-2"}
    s = bm.summarize(run.steps)
    assert 0 < s["avg_saved"] < 1 and s["peak_with"] <= s["peak_without"]


def test_parallel_samples_share_the_prompt_full_blocks_only(tiny_model_dir):
    def reference(seqs, bs):
        shared = seqs[0].get_prompt_len() // bs
        return (shared + sum(math.ceil(s.get_len() / bs) - shared for s in seqs),
                sum(math.ceil(s.get_len() / bs) for s in seqs))

    params = [bm.parallel_params(3, seed=i, max_tokens=10) for i in range(2)]
    _run(tiny_model_dir, 4, PROMPTS[1:], params, reference)


@pytest.mark.parametrize("mode", ["beam", "parallel"])
def test_sharing_never_holds_more_than_without(tiny_model_dir, mode):
    params = [bm.beam_params(4, 8) if mode == "beam" else bm.parallel_params(4, 0, 8)] * 2
    bs = 8
    lower = []

    def bounds(scheduler, count):
        for rid, seqs in _running(scheduler).items():
            lower.append((count.requests[rid], max(math.ceil(s.get_len() / bs) for s in seqs)))

    run = bm.measure(_llm(tiny_model_dir, bs), PROMPTS[:2], params, on_step=bounds)
    for (with_, without, _), longest in lower:
        assert longest <= with_ <= without
    assert all(w == wo for w, wo, _ in run.steps[0].requests.values())  # the prefill shares nothing
    assert any(w < wo for step in run.steps[1:] for w, wo, _ in step.requests.values())


def test_summary_is_the_papers_ratio_of_sums():
    steps = [bm.StepCount(i, {"r": (w, wo, 1)}) for i, (w, wo) in enumerate([(2, 2), (3, 6), (5, 10)])]
    s = bm.summarize(steps)
    assert s["avg_saved"] == pytest.approx(1 - 10 / 18)
    assert s["mean_step_saved"] == pytest.approx((0 + 0.5 + 0.5) / 3)
    assert s["peak_saved"] == pytest.approx(0.5) and (s["peak_with"], s["peak_without"]) == (5, 10)


def test_quick_run_writes_the_table(tiny_model_dir, tmp_path):
    rows = bm.main(["--quick", "--model", str(tiny_model_dir), "--max-tokens", "6", "--out", str(tmp_path)])
    assert {(r["mode"], r["width"], r["block_size"]) for r in rows} == {
        (m, w, b) for m in ("beam", "parallel") for w in (2, 4) for b in (16, 8)}
    with open(tmp_path / "beam_memory.csv") as f:
        written = list(csv.DictReader(f))
    assert [float(r["avg_saved"]) for r in written] == [round(r["avg_saved"], 4) for r in rows]
    md = (tmp_path / "beam_memory.md").read_text()
    assert all(f"{r['avg_saved']:.1%}" in md for r in rows) and "37.6%–55.2%" in md
