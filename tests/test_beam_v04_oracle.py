"""Beam search against vLLM v0.4.0's own code (issue 37, oracle (b)), step by step.

``beam_v04_oracle`` loads v0.4.0's ``_beam_search_sample`` and ``LLMEngine``'s
``_process_sequence_group_outputs``, ``_check_stop`` and ``_check_beam_search_early_stopping``
from the wheel and drives them on v0.4 ``Sequence``/``SequenceGroup`` objects, beside a request
in tinyserve's real ``LLMEngine`` (the tiny model runs; its logits are replaced by the case's).
Both sides get the same logits at every step: a function of the beam's tokens, with the mass on
30 of the 400 tokens and EOS made likely at random beams and steps, so that beams finish at
different lengths, and some run until ``max_tokens``. 240 random cases: widths 2–8, n ≤ width,
max_tokens 3–15, length_penalty in {0, 0.5, 1, 2, -1}, early_stopping in {True, False, "never"}.
Half run under ``compat="vllm-0.4"``, v0.4 given the engine's log-probabilities, and everything
is compared exactly; half under the default mode with prefix caching and chunked prefill, v0.4
computing its own (``log_softmax``, which can differ from the engine's ``logits - logsumexp`` in
the last bit), the cumulative logprobs then compared within 1e-5.

After every step: the same running beams (tokens and cumulative logprob), the same finished
beams kept (and their finish reasons), the same forks (parent, child) holding blocks, the same
parents freed, and the same step at which the search ends; at the end, the same outputs, and
every block of the engine free. Two mutants of the beam step (early stopping ignored, a final
EOS counted in the length, "never" taken as False, W candidates rather than 2W) are caught by
the same comparison.

What differs, by design or by v0.4's own inconsistency:

- **Forks of children that are not kept.** v0.4 forks a child in the block manager only once it
  is selected (and not finished); tinyserve's ``beam_step`` forks every child as it is made (the
  parent's blocks are whole then) and frees those not kept. The blocks held after the step are
  the same: the test compares forks that still hold blocks, and checks that every other fork was
  freed in the same step.
- **The order of the final outputs.** v0.4's ``RequestOutput.from_seq_group`` ranks the beams by
  ``get_beam_search_score(length_penalty)`` without ``eos_token_id``, so there a final EOS
  counts in the length, whereas its own selection (``_process_sequence_group_outputs``, and
  transformers) does not count it. tinyserve's ``OutputBuilder`` ranks by the selection's score.
  The kept beams are the same; with a length penalty ≠ 0 and beams of different lengths ending
  in EOS, which n are returned, and in what order, can differ. The test checks tinyserve's
  outputs against v0.4's group ranked by v0.4's selection score in every case, against
  ``from_seq_group`` itself wherever the two rankings agree, and counts the cases where they do not.
- **The finish reason of a beam whose ``max_tokens``-th token is EOS.** v0.4's ``_check_stop``
  checks the caps first ("length"); tinyserve's default checks EOS first ("stop"), its
  ``compat="vllm-0.4"`` follows v0.4. Compared exactly under the compat mode; under the default
  the test allows that one difference and counts it.
- **``CompletionOutput.index``**: v0.4's is the beam's position in the group, tinyserve's its
  rank. Not compared.
- **A parent with no candidate** leaves the group and frees its blocks on both sides; v0.4 also
  marks it ``FINISHED_ABORTED``, tinyserve leaves its status. Nothing sees it afterwards.
- **Not in these cases**: the length cap (v0.4 caps a sequence longer than ``max_model_len``,
  tinyserve's default one that reaches it; prompt + max_tokens stays far below), and penalties,
  ``min_tokens`` and the like with beam search, which v0.4 allows (ranking by the changed
  log-probabilities) and tinyserve refuses.
- **Ties.** v0.4 ranks the candidates with ``torch.topk`` over float32 sums (the beam's
  cumulative logprob cast to float32 plus the token's), tinyserve by sorting Python floats: two
  candidates closer than float32's rounding could be ranked differently. The case's logits are
  continuous random draws, so exact ties do not occur; were a near-tie to be ranked differently,
  the test would fail at that step, naming it.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest
from beam_v04_oracle import BeamState, engine_stub_class, load, random_case, run_case

from tinyserve import LLM, beam_search
from tinyserve.beam_search import select

CASES_PER_MODE = 120

# v0.4.0's _get_logprobs indexes with a list, which torch 2.8 warns about.
pytestmark = pytest.mark.filterwarnings("ignore:Using a non-tuple sequence:UserWarning")


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    # 512 blocks hold any case (at most 8 beams of 35 tokens); the default pool takes seconds to
    # build. The default mode's engine also caches prefixes and chunks prefills (16-token chunks,
    # so prompts over 16 tokens take two rounds), so that the beam step is checked there too.
    common = dict(model=str(tiny_model_dir), dtype="float32", num_gpu_blocks=512, num_cpu_blocks=64)
    return {"vllm-0.4": LLM(compat="vllm-0.4", **common).engine,
            "tinyserve": LLM(enable_prefix_caching=True, enable_chunked_prefill=True, max_num_batched_tokens=16,
                             max_num_seqs=16, **common).engine}


def test_the_oracle_is_v04s_own_code():
    v = load()
    stub = engine_stub_class()
    assert stub._process_sequence_group_outputs is v.LLMEngine._process_sequence_group_outputs
    assert stub._check_stop is v.LLMEngine._check_stop
    assert stub._check_beam_search_early_stopping is v.LLMEngine._check_beam_search_early_stopping
    wheel = Path(sys.modules["vllm"].__path__[0])  # the installed folder (v04_oracle.load)
    assert (wheel / "engine/llm_engine.py").is_file()
    assert Path(v.sampler.beam_search_sample.__code__.co_filename) == wheel / "model_executor/layers/sampler.py"
    assert Path(v.LLMEngine._check_stop.__code__.co_filename) == wheel / "engine/llm_engine.py"


def same(a: list, b: list, exact: bool) -> bool:
    """Lists of (tokens, cumulative logprob[, finish reason]): equal, or with ``exact=False``
    the cumulative logprobs within 1e-5 (v0.4's own log_softmax differs in the last bit)."""
    if exact:
        return a == b
    return len(a) == len(b) and all(x[0] == y[0] and x[2:] == y[2:] and abs(x[1] - y[1]) < 1e-5 for x, y in zip(a, b))


def compare(case, compat: str, eos: int, counts: Counter, exact: bool = True):
    def on_step(step: int, ts: BeamState, vs: BeamState) -> None:
        where = f"case {case.seed} ({compat}) step {step}: {case}"
        if compat == "tinyserve":  # EOS as the max_tokens-th token: "stop" here, "length" in v0.4
            vs.finished = [(t, c, "stop" if r == "length" and t[-1] == eos else r) for t, c, r in vs.finished]
        assert same(ts.running, vs.running, exact), (where, ts.running, vs.running)
        assert same(ts.finished, vs.finished, exact), (where, ts.finished, vs.finished)
        assert ts.forked == vs.forked, where
        assert ts.freed == vs.freed, where
        assert ts.stopped == vs.stopped, where
        counts["steps"] += 1
        counts["forks"] += len(vs.forked)
        counts["parents freed"] += len(vs.freed)
    return on_step


def final_ranking(v04_group, case, eos: int) -> list:
    """v0.4's kept beams ranked by v0.4's selection score (a final EOS not counted)."""
    seqs = sorted(v04_group.get_seqs(), key=lambda s: s.get_beam_search_score(case.length_penalty, eos_token_id=eos),
                  reverse=True)[:case.n]
    return [(tuple(s.get_output_token_ids()), s.get_cumulative_logprob()) for s in seqs]


@pytest.mark.parametrize("compat,v04_log_softmax", [("vllm-0.4", False), ("tinyserve", True)])
def test_every_step_is_v04s(engines, compat, v04_log_softmax):
    """Under compat="vllm-0.4", v0.4 gets the engine's log-probabilities and everything is equal
    exactly; under the default, v0.4 computes its own (log_softmax), the same beams are kept and
    the cumulative logprobs agree within 1e-5."""
    exact = not v04_log_softmax
    engine = engines[compat]
    eos = engine.eos_token_id
    manager = engine.scheduler.block_manager
    free_before = manager.get_num_free_gpu_blocks()
    counts: Counter = Counter()
    offset = 0 if compat == "vllm-0.4" else 10_000
    for seed in range(offset, offset + CASES_PER_MODE):
        case = random_case(seed, engine.vocab_size, eos)
        result = run_case(engine, case, f"beam-{seed}", compare(case, compat, eos, counts, exact), v04_log_softmax)
        assert result.tinyserve_outputs is not None, f"case {seed}: no final output"
        assert not manager.block_tables and manager.get_num_free_gpu_blocks() == free_before, f"case {seed}"
        v04_out = result.v04_outputs
        if compat == "tinyserve":
            v04_out = [(t, c, "stop" if r == "length" and t[-1] == eos else r) for t, c, r in v04_out]
            counts["finish reasons differing as named"] += sum(a != b for a, b in zip(v04_out, result.v04_outputs))
        ranked = final_ranking(result.v04_group, case, eos)
        assert same([(t, c) for t, c, _ in result.tinyserve_outputs], ranked, exact), f"case {seed}: {case}"
        if [t for t, _, _ in v04_out] == [t for t, _ in ranked]:
            assert same(result.tinyserve_outputs, v04_out, exact), f"case {seed}: {case}"
            counts["outputs identical"] += 1
        else:  # from_seq_group counts a final EOS in the length (the module docstring): that alone
            assert case.length_penalty != 0 and any(t[-1] == eos for t, _, _ in v04_out + result.tinyserve_outputs)
            by_v04_key = sorted(result.v04_group.get_seqs(), key=lambda s: s.get_beam_search_score(case.length_penalty),
                                reverse=True)[:case.n]
            assert [t for t, _, _ in v04_out] == [tuple(s.get_output_token_ids()) for s in by_v04_key]
            counts["outputs ordered differently as named"] += 1
        counts["cases"] += 1
        counts["ended before max_tokens"] += result.steps < case.max_tokens
        counts[f"early_stopping={case.early_stopping}"] += 1
        counts["EOS finishes"] += sum(t[-1] == eos for t, _, _ in result.tinyserve_outputs)
    print(compat, dict(counts))
    # The cases reach what they are meant to: forks, frees, beams ending by EOS, and searches
    # that end before max_tokens (every beam done, or early stopping).
    assert counts["cases"] == CASES_PER_MODE and counts["steps"] > 5 * CASES_PER_MODE
    assert counts["forks"] > 0 and counts["parents freed"] > 0 and counts["EOS finishes"] > CASES_PER_MODE // 4
    assert counts["ended before max_tokens"] > CASES_PER_MODE // 10
    assert counts["outputs identical"] > CASES_PER_MODE // 2


def ignores_early_stopping(children, finished, width, length_penalty, early_stopping, eos, max_len):
    return select(children, finished, width, length_penalty, False, eos, max_len)


def never_as_false(children, finished, width, length_penalty, early_stopping, eos, max_len):
    return select(children, finished, width, length_penalty, early_stopping is True, eos, max_len)


def counts_eos_in_length(children, finished, width, length_penalty, early_stopping, eos, max_len):
    return select(children, finished, width, length_penalty, early_stopping, None, max_len)


def width_candidates(cumulative, tokens, logprobs, width, candidates=beam_search.candidates):
    return candidates(cumulative, tokens, logprobs, width)[:width]


@pytest.mark.parametrize("mutant", [ignores_early_stopping, never_as_false, counts_eos_in_length, width_candidates])
def test_the_comparison_catches_a_wrong_beam_step(engines, monkeypatch, mutant):
    """The oracle can fail: a beam step that differs from v0.4's in one rule is caught (the
    selection through the engine's ``beam_select`` hook, the candidates by patching them)."""
    engine = engines["vllm-0.4"]
    if mutant is width_candidates:
        monkeypatch.setattr(beam_search, "candidates", mutant)
    else:
        monkeypatch.setattr(engine, "beam_select", mutant)
    try:
        with pytest.raises(AssertionError, match=r"case \d+ \(vllm-0.4\) step \d+"):
            for seed in range(20_000, 20_000 + 60):
                case = random_case(seed, engine.vocab_size, engine.eos_token_id)
                run_case(engine, case, f"mutant-{seed}", compare(case, "vllm-0.4", engine.eos_token_id, Counter()))
    finally:
        for rid in list(engine._groups):
            engine.abort_request(rid)
