"""Chunked prefill: long prompts cut into chunks under the token budget, decodes never stall.

A round carries at most ``max_num_batched_tokens`` tokens. The running decodes go first (one
token each), and what is left of the budget goes to the next chunk of a prompt. The tiny random
Llama checks that chunking never changes greedy tokens; the round records check the budget and
that the decodes around a long prefill produce a token in every round; hypothesis checks both
over random simulated workloads.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tinyserve import sim
from tinyserve.config import CacheConfig, ModelConfig, SchedulerConfig
from tinyserve.engine import LLMEngine
from tinyserve.sequence import SamplingParams
from tinyserve.worker import Worker

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
BUDGET = 16


def make_engine(loaded, *, chunked: bool, budget: int | None = None, prefix: bool = False, block_size: int = 8,
                num_gpu_blocks: int = 256, max_model_len: int = 320, max_num_seqs: int = 8,
                preemption_mode: str | None = None) -> LLMEngine:
    mc = ModelConfig(model=str(loaded.path), device="cpu", dtype="float32")
    return LLMEngine(
        mc,
        CacheConfig(block_size=block_size, num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=64, watermark=0.0,
                    enable_prefix_caching=prefix),
        SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                        preemption_mode=preemption_mode, enable_chunked_prefill=chunked),
        executor=Worker(mc, attention_backend="torch", loaded=loaded), record_history=True,
    )


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 256) for _ in range(n)]  # any byte-level vocabulary has these


# Prompts of 9 to 12 budgets, plus short ones; the first two share 100 tokens.
LONG = {"long0": tokens(1, 150), "long1": tokens(1, 100) + tokens(2, 90), "long2": tokens(3, 171)}
SHORT = {"short0": tokens(4, 5), "short1": tokens(5, 11)}


def run(engine: LLMEngine, prompts: dict[str, list[int]], params=GREEDY, arrivals: dict[str, int] | None = None,
        ) -> dict[str, list[int]]:
    """Run to completion; ``arrivals[rid]`` is the step before which a request is added (default 0)."""
    arrivals = arrivals or {}
    results: dict[str, list[int]] = {}
    for step in range(1000):
        for rid, ids in prompts.items():
            if arrivals.get(rid, 0) == step:
                engine.add_request(rid, None, params, prompt_token_ids=ids)
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
        if len(results) == len(prompts):
            return results
    raise AssertionError("the engine made no progress")


def assert_within_budget(engine: LLMEngine, budget: int) -> None:
    for rec in engine.history:
        assert sum(rec.chunk_sizes.values()) == rec.num_batched_tokens <= budget, f"round {rec.round}"


def assert_no_leaks(engine: LLMEngine) -> None:
    bm = engine.scheduler.block_manager
    assert not bm.block_tables
    assert bm.get_num_free_gpu_blocks() == bm.num_total_gpu_blocks
    assert all(b.ref_count == 0 for b in bm.gpu_allocator.blocks + bm.cpu_allocator.blocks)


@pytest.fixture(scope="module")
def unchunked(tiny_loaded):
    return run(make_engine(tiny_loaded, chunked=False), {**LONG, **SHORT})


def test_chunked_prefill_gives_the_same_greedy_tokens_under_a_small_budget(tiny_loaded, unchunked):
    engine = make_engine(tiny_loaded, chunked=True, budget=BUDGET)
    assert run(engine, {**LONG, **SHORT}) == unchunked
    assert_within_budget(engine, BUDGET)
    # Every prompt really was cut: its tokens arrived over at least len/BUDGET rounds.
    rounds_of = {rid: sum(rid in rec.batch for rec in engine.history) for rid in LONG}
    assert all(rounds_of[rid] >= len(ids) // BUDGET + GREEDY.max_tokens - 1 for rid, ids in LONG.items())
    assert_no_leaks(engine)


def test_each_prompt_token_is_computed_once_and_only_the_last_chunk_samples(tiny_loaded):
    engine = make_engine(tiny_loaded, chunked=True, budget=BUDGET)
    run(engine, LONG)
    for rid, ids in LONG.items():
        chunks = [(rec.chunk_sizes[rid], rid in rec.tokens) for rec in engine.history if rid in rec.batch]
        prefill = []
        for n, sampled in chunks:
            prefill.append(n)
            if sampled:
                break
        assert sum(prefill) == len(ids)  # chunks cover the prompt exactly, then it samples
        assert not any(sampled for _, sampled in chunks[: len(prefill) - 1])
        assert [n for n, _ in chunks[len(prefill):]] == [1] * (GREEDY.max_tokens - 1)


LONG_AND_SHORT = {**SHORT, "long2": LONG["long2"]}
ARRIVALS = {"long2": 2}  # the short requests are decoding when long2 (171 tokens, 11 budgets) arrives
LONGER = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def long_and_short_unchunked(tiny_loaded):
    engine = make_engine(tiny_loaded, chunked=False)
    return engine, run(engine, LONG_AND_SHORT, LONGER, ARRIVALS)


def test_decodes_produce_a_token_every_round_while_a_long_prompt_is_prefilled(tiny_loaded, unchunked,
                                                                              long_and_short_unchunked):
    engine = make_engine(tiny_loaded, chunked=True, budget=BUDGET)
    got = run(engine, LONG_AND_SHORT, LONGER, ARRIVALS)
    prefill_rounds = [rec for rec in engine.history if "long2" in rec.batch and "long2" not in rec.tokens]
    assert len(prefill_rounds) >= 10
    for rec in prefill_rounds:
        assert rec.phase == "mixed"
        for rid in SHORT:
            assert rec.chunk_sizes[rid] == 1 and rid in rec.tokens, f"round {rec.round}: {rid} stalled"
        assert rec.chunk_sizes["long2"] == BUDGET - len(SHORT)  # the rest of the budget
    assert_within_budget(engine, BUDGET)
    # Without chunking the same arrival costs the decoders a round spent on one big prefill.
    whole, expected = long_and_short_unchunked
    assert got == expected
    big = next(rec for rec in whole.history if "long2" in rec.batch)
    assert big.batch == ["long2"] and big.num_batched_tokens == len(LONG["long2"])
    assert got["long2"][: GREEDY.max_tokens] == unchunked["long2"]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_tight_pool_preempts_a_half_prefilled_prompt_without_changing_tokens(tiny_loaded, mode,
                                                                              long_and_short_unchunked):
    # 27 blocks of 8: long2 takes 22 at admission, and the decoders' growth soon needs one of them.
    engine = make_engine(tiny_loaded, chunked=True, budget=BUDGET, num_gpu_blocks=27, preemption_mode=mode,
                         max_model_len=200)
    assert run(engine, LONG_AND_SHORT, LONGER, ARRIVALS) == long_and_short_unchunked[1]
    first = next(rec for rec in engine.history if rec.preempted)
    assert first.preempted == ["long2"]
    done = sum(rec.chunk_sizes.get("long2", 0) for rec in engine.history[: first.round - 1])
    assert 0 < done < len(LONG["long2"])  # it was caught halfway through its prefill
    if mode == "swap":
        assert any(rec.swapped_in == ["long2"] for rec in engine.history)
    assert_within_budget(engine, BUDGET)
    assert_no_leaks(engine)


def test_chunked_prefill_with_prefix_caching_skips_the_shared_head(tiny_loaded, unchunked):
    engine = make_engine(tiny_loaded, chunked=True, budget=BUDGET, prefix=True)
    got = run(engine, {"long0": LONG["long0"], "long1": LONG["long1"]}, arrivals={"long1": 20})
    assert got == {"long0": unchunked["long0"], "long1": unchunked["long1"]}
    computed = {}
    for rec in engine.history:
        for rid, n in rec.chunk_sizes.items():
            computed[rid] = computed.get(rid, 0) + n
    # long1 shares 100 tokens, 12 full blocks of 8, with long0: 96 of them are not computed.
    assert computed["long1"] == len(LONG["long1"]) - 96 + GREEDY.max_tokens - 1
    assert_within_budget(engine, BUDGET)
    assert_no_leaks(engine)


def test_a_prompt_longer_than_the_budget_is_admitted_but_one_longer_than_the_model_is_ignored(tiny_loaded):
    engine = make_engine(tiny_loaded, chunked=True, budget=BUDGET, max_model_len=160)
    engine.add_request("fits", None, GREEDY, prompt_token_ids=LONG["long0"])  # 150 tokens, 10 budgets
    engine.add_request("too_long", None, GREEDY, prompt_token_ids=LONG["long2"])  # 171 > 160
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
    assert outs["fits"].outputs[0].finish_reason == "length"
    assert outs["too_long"].outputs[0].finish_reason == "ignored" and "160" in outs["too_long"].error
    assert_no_leaks(engine)


# -- hypothesis over the simulator --------------------------------------------------------------

@st.composite
def chunked_workloads(draw):
    requests = [sim.Request(f"r{i}", draw(st.integers(1, 120)), draw(st.integers(1, 12)), draw(st.integers(1, 8)))
                for i in range(draw(st.integers(1, 7)))]
    max_num_seqs = draw(st.integers(1, 6))
    budget = draw(st.integers(max_num_seqs, 40))
    sc = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs, max_model_len=140,
                         enable_chunked_prefill=True)
    cc = CacheConfig(block_size=draw(st.sampled_from([1, 4, 16])), num_gpu_blocks=1000, num_cpu_blocks=0,
                     watermark=0.0, enable_prefix_caching=draw(st.booleans()))
    return requests, sc, cc


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chunked_workloads())
def test_random_workloads_keep_the_budget_and_never_stall_a_decode(workload):
    requests, sc, cc = workload
    records = sim.simulate(requests, sc, cc)
    prompt_len = {r.request_id: r.prompt_len for r in requests}
    output_len = {r.request_id: r.output_len for r in requests}
    computed = dict.fromkeys(prompt_len, 0)
    produced = dict.fromkeys(prompt_len, 0)
    decoding: set[str] = set()  # requests that sampled their first token and have not finished
    for rec in records:
        assert sum(rec.chunk_sizes.values()) == rec.num_batched_tokens <= sc.max_num_batched_tokens
        assert len(rec.batch) <= sc.max_num_seqs
        assert not rec.preempted  # memory is ample: nothing may be preempted
        for rid in decoding:  # the point of chunking: a decoding request runs in every round
            assert rec.chunk_sizes.get(rid) == 1, f"round {rec.round}: {rid} did not decode"
        for rid, n in rec.chunk_sizes.items():
            if rid in decoding:
                produced[rid] += 1
                continue
            computed[rid] += n
            assert computed[rid] <= prompt_len[rid]
            if computed[rid] == prompt_len[rid]:
                produced[rid] += 1
                decoding.add(rid)
        for rid in rec.finished:
            assert produced[rid] == output_len[rid]
            decoding.discard(rid)
    assert not decoding
    assert {rid for rec in records for rid in rec.finished} == set(prompt_len)


# -- the chapter's drawing and checker ----------------------------------------------------------

def test_the_timeline_reads_who_produced_a_token_from_simulator_and_engine_records(tiny_loaded):
    import matplotlib

    matplotlib.use("Agg")
    from tinyserve.viz import beyond

    requests = beyond.long_prompt_requests()
    outs = {r.request_id: r.output_len for r in requests}
    chunked = beyond.chunked_run(True)
    made = beyond.producers(chunked, outs)
    # Every decoder produces a token in every round until it finishes, long prompt or not.
    for rid in ("d0", "d1", "d2"):
        rounds = [rec.round for rec, who in zip(chunked, made) if rid in who]
        assert rounds == list(range(1, outs[rid] + 1))
    whole = beyond.chunked_run(False)
    stall = next(rec for rec in whole if "long" in rec.batch)
    assert beyond.producers(whole, outs)[stall.round - 1] == {"long"}  # the decoders stalled
    assert max(r.num_batched_tokens for r in chunked) == 32 < max(r.num_batched_tokens for r in whole)
    # On engine records the tokens themselves say who produced.
    engine = make_engine(tiny_loaded, chunked=True, budget=BUDGET)
    run(engine, {"s": SHORT["short0"], "long": LONG["long0"]}, arrivals={"long": 1})
    assert beyond.producers(engine.history, {"s": 8, "long": 8}) == [set(r.tokens) for r in engine.history]
    assert beyond.prefill_tokens(engine.history, {"s": 8, "long": 8}) == {"s": 5, "long": 150}
    fig = beyond.fig_chunked_prefill()
    assert len(fig.axes) == 2 and "total (≤32)" in [t.get_text() for t in fig.axes[1].get_yticklabels()]
