"""The v1 round (``policy="v1"``), by hand-worked scenarios and by invariants over random workloads.

The scenarios follow vLLM V1's ``Scheduler.schedule`` rule by rule: running requests first under
one token budget, blocks for the computed tokens only, the newest running request preempted by
recompute to the front of ``waiting``, admission only in a step that preempted nobody, prefix
hits counted as computed but never the last token. The invariants hold whatever the workload.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scheduler_play import assert_all_free, play_round

from tinyserve.config import CacheConfig, SchedulerConfig
from tinyserve.scheduler import Scheduler
from tinyserve.sequence import SamplingParams, Sequence, SequenceGroup, SequenceStatus

_ids = itertools.count()
_tokens = itertools.count(1000)


def make_v1(block_size: int = 4, gpu: int = 16, budget: int = 16, max_num_seqs: int = 8, chunked: bool | None = None,
            threshold: int = 0, prefix: bool = False, max_model_len: int = 64) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                        policy="v1", enable_chunked_prefill=chunked, long_prefill_token_threshold=threshold),
        CacheConfig(block_size=block_size, num_gpu_blocks=gpu, num_cpu_blocks=0, watermark=0.0,
                    enable_prefix_caching=prefix),
    )


def add(sched: Scheduler, rid: str, prompt: int | list[int], max_tokens: int = 16) -> SequenceGroup:
    ids = prompt if isinstance(prompt, list) else [next(_tokens) for _ in range(prompt)]
    seq = Sequence(next(_ids), None, ids, sched.cache_config.block_size)
    group = SequenceGroup(rid, [seq], SamplingParams(max_tokens=max_tokens, ignore_eos=True), arrival_time=0.0)
    sched.add_seq_group(group)
    return group


def chunks(out) -> dict[str, int]:
    return {s.seq_group.request_id: s.token_chunk_size for s in out.scheduled_seq_groups}


def ids(queue) -> list[str]:
    return [g.request_id for g in queue]


def blocks(sched: Scheduler, group: SequenceGroup) -> int:
    return len(sched.block_manager.block_tables.get(group.get_seqs()[0].seq_id, []))


def test_running_first_then_waiting_with_the_budget_left():
    sched = make_v1(budget=10)
    add(sched, "A", 6), add(sched, "B", 7)
    _, out = play_round(sched)
    assert chunks(out) == {"A": 6, "B": 4}  # B's prompt is cut to what the budget leaves
    assert out.phase == "prefill"
    add(sched, "C", 9)
    _, out = play_round(sched)
    # A decodes, B finishes its prompt, C gets the rest: running ones first, in queue order.
    assert list(chunks(out).items()) == [("A", 1), ("B", 3), ("C", 6)]
    assert out.phase == "mixed" and out.num_batched_tokens == 10


def test_blocks_are_allocated_for_the_tokens_a_step_computes():
    sched = make_v1(block_size=4, budget=4, max_num_seqs=4)
    g = add(sched, "A", 10)
    grown = []
    for _ in range(3):
        play_round(sched)
        grown.append(blocks(sched, g))
    # chunks of 4, 4 and 2 tokens: 1, 2 and 3 blocks (v0.4 would hold all 3 from admission on).
    assert grown == [1, 2, 3] and g.get_seqs()[0].get_output_len() == 1


def test_the_newest_running_request_is_preempted_by_recompute_and_nobody_is_admitted():
    # 4 blocks of 2 tokens. A and B hold 2 blocks each; A's next decode needs a third block.
    sched = make_v1(block_size=2, gpu=4, budget=16)
    a, b = add(sched, "A", 3), add(sched, "B", 4)
    _, out = play_round(sched)
    assert chunks(out) == {"A": 3, "B": 4} and sched.block_manager.get_num_free_gpu_blocks() == 0
    add(sched, "C", 1)
    _, out = play_round(sched)
    assert out.preempted == ["B"] and not out.swapped_out  # recompute, never swap
    assert chunks(out) == {"A": 1}  # C is not admitted in a step that preempted B
    assert ids(sched.waiting) == ["B", "C"]  # B goes to the front
    assert b.get_seqs()[0].num_computed_tokens == 0 and b.get_seqs()[0].status == SequenceStatus.WAITING
    _, out = play_round(sched)
    assert out.preempted == [] and list(chunks(out))[0] == "A"
    assert a.get_seqs()[0].get_output_len() == 3


def test_a_request_that_cannot_grow_and_is_newest_preempts_itself_and_stops_the_step():
    sched = make_v1(block_size=2, gpu=3, budget=16)
    add(sched, "A", 2), add(sched, "B", 3)
    play_round(sched)  # A: 1 block, B: 2 blocks; both sample a token
    _, out = play_round(sched)
    # A needs a block for its third token: B (newest) is preempted; B itself then fits no more.
    assert out.preempted == ["B"] and chunks(out) == {"A": 1}


def test_a_prefix_hit_counts_as_computed_but_the_last_token_is_always_computed():
    sched = make_v1(block_size=4, gpu=32, budget=32, prefix=True)
    prompt = list(range(100, 108))  # two full blocks
    first = add(sched, "A", list(prompt), max_tokens=1)
    play_round(sched)
    assert first.is_finished()
    again = add(sched, "B", list(prompt), max_tokens=2)
    _, out = play_round(sched)
    # Both blocks are cached, but the last token's logits are needed, and V1 hits whole blocks of
    # all tokens but the last: the second block is computed again.
    assert chunks(out) == {"B": 4}
    assert again.get_seqs()[0].num_computed_tokens == 8
    longer = add(sched, "C", prompt + [7, 7, 7], max_tokens=1)
    _, out = play_round(sched)
    assert chunks(out)["C"] == 3 and longer.get_seqs()[0].num_computed_tokens == 11


def test_long_prefill_token_threshold_caps_every_chunk():
    sched = make_v1(budget=32, threshold=5)
    add(sched, "A", 12), add(sched, "B", 3)
    sizes = [chunks(play_round(sched)[1]) for _ in range(3)]
    assert sizes == [{"A": 5, "B": 3}, {"A": 5, "B": 1}, {"A": 2, "B": 1}]


def test_without_chunked_prefill_a_prompt_that_does_not_fit_is_skipped_not_waited_for():
    sched = make_v1(budget=10, chunked=False)
    add(sched, "A", 6), add(sched, "B", 7), add(sched, "C", 3)
    _, out = play_round(sched)
    assert chunks(out) == {"A": 6, "C": 3}  # as V1: B waits, C behind it goes ahead
    assert ids(sched.waiting) == ["B"]


def test_max_num_seqs_bounds_admission():
    sched = make_v1(max_num_seqs=2, budget=32)
    for rid in "ABC":
        add(sched, rid, 3)
    _, out = play_round(sched)
    assert list(chunks(out)) == ["A", "B"] and ids(sched.waiting) == ["C"]


def test_a_prompt_longer_than_the_cache_is_refused_with_a_reason():
    sched = make_v1(block_size=2, gpu=3, budget=16)
    g = add(sched, "A", 7)
    _, out = play_round(sched)
    assert out.ignored_seq_groups == [g] and "block" in g.error


# -- invariants over random workloads ------------------------------------------------------------

@st.composite
def workloads(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    budget = draw(st.integers(4, 40))
    prompts = draw(st.lists(st.integers(1, 30), min_size=1, max_size=8))
    outputs = draw(st.lists(st.integers(1, 12), min_size=len(prompts), max_size=len(prompts)))
    arrivals = draw(st.lists(st.integers(0, 6), min_size=len(prompts), max_size=len(prompts)))
    longest = max(p + o for p, o in zip(prompts, outputs))
    gpu = draw(st.integers(-(-longest // block_size), 3 * -(-longest // block_size)))
    sched = make_v1(block_size=block_size, gpu=gpu, budget=max(budget, 8), max_num_seqs=draw(st.integers(1, 8)),
                    chunked=draw(st.sampled_from([None, None, False])), threshold=draw(st.sampled_from([0, 0, 3])),
                    prefix=draw(st.booleans()), max_model_len=longest)
    shared = [next(_tokens) for _ in range(16)]  # a shared head makes prefix hits likely
    plans = []
    for i, (p, o, t) in enumerate(zip(prompts, outputs, arrivals)):
        head = shared[: min(p - 1, 16)] if draw(st.booleans()) else []
        plans.append((t, f"r{i}", head + [next(_tokens) for _ in range(p - len(head))], o))
    return sched, plans


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads_keep_the_v1_rules(workload):
    sched, plans = workload
    cfg, bm = sched.scheduler_config, sched.block_manager
    groups: list[SequenceGroup] = []
    for step in range(2000):
        groups += [add(sched, rid, list(ids_), max_tokens=o) for t, rid, ids_, o in plans if t == step]
        if step > max(t for t, *_ in plans) and not sched.has_unfinished_seqs():
            break
        running_before = ids(sched.running)
        _, out = play_round(sched)
        batch = [s.seq_group.request_id for s in out.scheduled_seq_groups]
        assert out.num_batched_tokens <= cfg.max_num_batched_tokens
        admitted = [rid for rid in batch if rid not in running_before]
        if out.preempted:
            assert not admitted, f"step {step}: admitted {admitted} in a step that preempted {out.preempted}"
        assert not out.swapped_out  # single samples: always recompute
        # Running requests come first in the batch, in their queue order.
        kept = [rid for rid in batch if rid in running_before]
        assert batch[: len(kept)] == kept and kept == [r for r in running_before if r in kept]
        # Blocks only for the tokens computed so far, none ahead.
        for group in sched.running:
            seq = group.get_seqs(SequenceStatus.RUNNING)[0]
            assert len(bm.block_tables[seq.seq_id]) == -(-seq.num_computed_tokens // bm.block_size)
    else:
        raise AssertionError("the workload did not finish within 2000 steps")
    # Every request ran to its length: each fits the cache alone. Only without chunked prefill (and
    # no threshold to cut it) is one refused, a prompt longer than a step's whole budget.
    for g in groups:
        seq = g.get_seqs()[0]
        if g.error is not None:
            cut = 0 < cfg.long_prefill_token_threshold <= cfg.max_num_batched_tokens
            assert not cfg.enable_chunked_prefill and not cut, g.error
            assert seq.get_prompt_len() > cfg.max_num_batched_tokens, g.error
        else:
            assert seq.get_output_len() == g.sampling_params.max_tokens
    assert_all_free(sched)


@pytest.mark.parametrize("prefix", [False, True])
def test_every_request_gets_its_tokens_in_a_cache_that_holds_one_at_a_time(prefix):
    sched = make_v1(block_size=2, gpu=8, budget=8, prefix=prefix, max_model_len=16)
    groups = [add(sched, f"r{i}", 6, max_tokens=10) for i in range(4)]
    preempted = 0
    for _ in range(500):
        if not sched.has_unfinished_seqs():
            break
        preempted += len(play_round(sched)[1].preempted)
    assert all(g.get_seqs()[0].get_output_len() == 10 for g in groups)
    assert preempted > 0
    assert_all_free(sched)
