"""Scheduler scenarios, each small enough to work out by hand: what a round schedules, which
group is preempted and how, what the swap and copy maps say, and what happens to bad requests."""

from __future__ import annotations

import itertools

import pytest
from scheduler_play import assert_all_free, play_round

from tinyserve.block import Device
from tinyserve.config import CacheConfig, SchedulerConfig
from tinyserve.scheduler import Scheduler, SchedulingBudget
from tinyserve.sequence import SamplingParams, Sequence, SequenceGroup, SequenceStatus

_ids = itertools.count()
_tokens = itertools.count(1000)


def make_scheduler(policy: str = "vllm", mode: str | None = None, block_size: int = 4, gpu: int = 16,
                   cpu: int = 16, max_num_seqs: int = 8, max_tokens: int = 64, max_model_len: int = 64,
                   watermark: float = 0.0, chunked: bool = False) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=max_tokens, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                        policy=policy, preemption_mode=mode, enable_chunked_prefill=chunked),
        CacheConfig(block_size=block_size, num_gpu_blocks=gpu, num_cpu_blocks=cpu, watermark=watermark),
    )


def add(sched: Scheduler, rid: str, prompt_len: int, n: int = 1, max_tokens: int = 16) -> SequenceGroup:
    seq = Sequence(next(_ids), None, [next(_tokens) for _ in range(prompt_len)], sched.cache_config.block_size)
    group = SequenceGroup(rid, [seq], SamplingParams(n=n, max_tokens=max_tokens), arrival_time=0.0)
    sched.add_seq_group(group)
    return group


def step(sched: Scheduler):
    """One round as the engine would run it, minus the model (a prompt's first sample forks)."""
    return play_round(sched)


def finish(sched: Scheduler, group: SequenceGroup) -> None:
    for seq in group.get_unfinished_seqs():
        seq.status = SequenceStatus.FINISHED_LENGTH_CAPPED
        sched.free_seq(seq)
    sched.free_finished_seq_groups()


def ids(queue) -> list[str]:
    return [g.request_id for g in queue]


def table(sched: Scheduler, group: SequenceGroup, i: int = 0) -> list[int]:
    return sched.block_manager.get_block_table(group.get_seqs()[i])


def test_scheduler_needs_block_counts():
    with pytest.raises(ValueError, match="num_gpu_blocks"):
        Scheduler(SchedulerConfig(), CacheConfig())


def test_simple_prefill_then_decode():
    sched = make_scheduler(block_size=4, gpu=16)
    a, b, c = add(sched, "A", 5), add(sched, "B", 3), add(sched, "C", 4)
    assert sched.has_unfinished_seqs() and sched.get_num_unfinished_seq_groups() == 3

    metadata, out = step(sched)
    assert out.phase == "prefill"
    assert out.request_ids == ["A", "B", "C"]
    assert [m.is_prompt for m in metadata] == [True] * 3
    assert [m.token_chunk_size for m in metadata] == [5, 3, 4]
    assert all(m.do_sample for m in metadata)
    assert out.num_batched_tokens == 12
    assert ids(sched.running) == ["A", "B", "C"] and not sched.waiting
    assert [len(table(sched, g)) for g in (a, b, c)] == [2, 1, 1]
    assert len({n for g in (a, b, c) for n in table(sched, g)}) == 4
    assert sched.block_manager.get_num_free_gpu_blocks() == 12
    assert metadata[0].block_tables == {a.get_seqs()[0].seq_id: table(sched, a)}

    metadata, out = step(sched)
    assert out.phase == "decode"
    assert out.request_ids == ["A", "B", "C"]
    assert [m.is_prompt for m in metadata] == [False] * 3
    assert [m.token_chunk_size for m in metadata] == [1, 1, 1]
    assert out.num_batched_tokens == 3
    # C's sampled token was its 5th: it needed a second block; A (6) and B (4) fit.
    assert [len(table(sched, g)) for g in (a, b, c)] == [2, 1, 2]
    assert not (out.blocks_to_copy or out.blocks_to_swap_in or out.blocks_to_swap_out or out.preempted)

    for g in (a, b, c):
        finish(sched, g)
    assert not sched.has_unfinished_seqs()
    assert_all_free(sched)
    _, out = sched.schedule()
    assert out.phase == "idle" and out.is_empty()


def _two_full_prompts(mode: str) -> tuple[Scheduler, SequenceGroup, SequenceGroup]:
    """A and B fill all 4 blocks (2 each); after prefill each needs a third block."""
    sched = make_scheduler(mode=mode, block_size=2, gpu=4, cpu=4, max_tokens=8, max_num_seqs=2)
    a, b = add(sched, "A", 4), add(sched, "B", 4)
    _, out = step(sched)
    assert out.request_ids == ["A", "B"]
    assert sched.block_manager.get_num_free_gpu_blocks() == 0
    return sched, a, b


def test_preemption_by_recompute_frees_the_newest_and_sends_it_to_the_front_of_waiting():
    sched, a, b = _two_full_prompts("recompute")
    late = add(sched, "C", 2)
    b_tokens = b.get_seqs()[0].get_token_ids()

    _, out = step(sched)
    assert out.phase == "decode" and out.request_ids == ["A"]
    assert out.preempted == ["B"] and out.swapped_out == [] and out.blocks_to_swap_out == {}
    assert ids(sched.waiting) == ["B", "C"] and ids(sched.running) == ["A"] and not sched.swapped
    seq_b = b.get_seqs()[0]
    assert seq_b.status == SequenceStatus.WAITING and seq_b.num_computed_tokens == 0
    assert seq_b.seq_id not in sched.block_manager.block_tables
    assert seq_b.get_token_ids() == b_tokens  # the tokens stay; only their K/V is dropped
    assert len(table(sched, a)) == 3 and sched.block_manager.get_num_free_gpu_blocks() == 1

    finish(sched, a)
    metadata, out = step(sched)
    # B comes back first, prefilling its prompt and its one output token again.
    assert out.phase == "prefill" and out.request_ids[0] == "B"
    assert metadata[0].token_chunk_size == 5 and metadata[0].is_prompt
    assert seq_b.get_output_len() == 2
    finish(sched, b)
    finish(sched, late)
    assert_all_free(sched)


def test_preemption_by_swap_and_swap_in_round_trip_the_block_mapping():
    sched, a, b = _two_full_prompts("swap")
    old_b = table(sched, b)

    _, out = step(sched)
    assert out.request_ids == ["A"]
    assert out.preempted == ["B"] and out.swapped_out == ["B"]
    assert set(out.blocks_to_swap_out) == set(old_b)
    cpu_blocks = [out.blocks_to_swap_out[n] for n in old_b]
    assert len(set(cpu_blocks)) == 2
    assert ids(sched.swapped) == ["B"] and ids(sched.running) == ["A"] and not sched.waiting
    assert b.get_seqs()[0].status == SequenceStatus.SWAPPED
    assert sched.block_manager.get_block_device(b.get_seqs()[0]) == Device.CPU
    assert table(sched, b) == cpu_blocks
    assert sched.block_manager.get_num_free_cpu_blocks() == 2

    # A holds 3 blocks: B (2 blocks + 1 to grow) cannot come back yet.
    _, out = step(sched)
    assert out.request_ids == ["A"] and out.blocks_to_swap_in == {}
    assert ids(sched.swapped) == ["B"]

    finish(sched, a)
    _, out = step(sched)
    assert out.phase == "decode" and out.request_ids == ["B"] and out.swapped_in == ["B"]
    assert set(out.blocks_to_swap_in) == set(cpu_blocks)
    new_b = table(sched, b)
    # Round trip: each logical block lands where gpu -> cpu -> gpu sends it, in order.
    assert new_b[:2] == [out.blocks_to_swap_in[c] for c in cpu_blocks]
    assert len(new_b) == 3  # and its pending token got its slot
    assert b.get_seqs()[0].status == SequenceStatus.RUNNING
    assert sched.block_manager.get_num_free_cpu_blocks() == 4
    finish(sched, b)
    assert_all_free(sched)


def test_max_num_seqs_is_respected():
    sched = make_scheduler(max_num_seqs=2)
    a = add(sched, "A", 3)
    add(sched, "B", 3), add(sched, "C", 3)
    _, out = step(sched)
    assert out.request_ids == ["A", "B"] and ids(sched.waiting) == ["C"]
    _, out = step(sched)
    assert out.phase == "decode" and out.request_ids == ["A", "B"]
    finish(sched, a)
    _, out = step(sched)
    assert out.phase == "prefill" and out.request_ids == ["C"]
    assert ids(sched.running) == ["B", "C"]


def test_max_num_seqs_counts_the_samples_of_a_prompt():
    sched = make_scheduler(max_num_seqs=3)
    add(sched, "A", 3, n=2)
    add(sched, "B", 3, n=2)
    _, out = step(sched)
    assert out.request_ids == ["A"] and ids(sched.waiting) == ["B"]


@pytest.mark.parametrize("policy", ["vllm", "orca"])
def test_max_num_batched_tokens_is_respected(policy):
    sched = make_scheduler(policy=policy, max_tokens=10, max_num_seqs=4)
    add(sched, "A", 4), add(sched, "B", 4), add(sched, "C", 4)
    _, out = step(sched)
    assert out.request_ids == ["A", "B"] and out.num_batched_tokens == 8
    _, out = step(sched)
    if policy == "vllm":  # a prefill round of C alone; A and B wait for the next decode round
        assert out.request_ids == ["C"] and out.num_batched_tokens == 4
    else:  # two decodes and C's prefill: 2 + 4 tokens
        assert out.request_ids == ["A", "B", "C"] and out.num_batched_tokens == 6
        assert out.phase == "mixed"


def test_orca_does_not_admit_a_prompt_that_overflows_the_round_with_the_decodes():
    sched = make_scheduler(policy="orca", max_tokens=10, max_num_seqs=4)
    add(sched, "A", 4), add(sched, "B", 4)
    step(sched)
    add(sched, "C", 9)  # 2 decodes + 9 = 11 > 10
    _, out = step(sched)
    assert out.request_ids == ["A", "B"] and ids(sched.waiting) == ["C"]


def test_a_prompt_exactly_at_the_budget_runs_alone():
    sched = make_scheduler(max_tokens=10, max_num_seqs=4)
    add(sched, "A", 10), add(sched, "B", 1)
    _, out = step(sched)
    assert out.request_ids == ["A"] and out.num_batched_tokens == 10


def test_abort_from_each_queue_frees_blocks():
    sched, a, b = _two_full_prompts("swap")
    step(sched)  # A running, B swapped out
    c = add(sched, "C", 3)  # waiting
    assert (ids(sched.running), ids(sched.swapped), ids(sched.waiting)) == (["A"], ["B"], ["C"])
    bm = sched.block_manager

    sched.abort_seq_group("C")
    assert not sched.waiting and c.get_seqs()[0].status == SequenceStatus.FINISHED_ABORTED
    sched.abort_seq_group("B")
    assert not sched.swapped and b.get_seqs()[0].status == SequenceStatus.FINISHED_ABORTED
    assert bm.get_num_free_cpu_blocks() == 4
    sched.abort_seq_group("nobody")  # unknown ids are ignored
    sched.abort_seq_group(["A"])
    assert not sched.running and a.is_finished()
    assert a.get_seqs()[0].status.finish_reason == "abort"
    assert not sched.has_unfinished_seqs()
    assert_all_free(sched)


def test_abort_a_forked_group_frees_its_shared_blocks():
    sched = make_scheduler(block_size=4, gpu=8)
    g = add(sched, "A", 3, n=2, max_tokens=4)
    step(sched)  # the prefill's sample forks A into two sequences sharing its block
    assert len(g.get_seqs()) == 2 and table(sched, g, 0) == table(sched, g, 1)
    sched.abort_seq_group("A")
    assert all(s.status == SequenceStatus.FINISHED_ABORTED for s in g.get_seqs())
    assert_all_free(sched)


@pytest.mark.parametrize(("max_model_len", "max_tokens", "prompt_len", "limit", "names"), [
    (16, 32, 20, 16, "max_model_len"),
    (64, 10, 12, 10, "max_num_batched_tokens"),
])
def test_an_over_long_prompt_is_ignored_with_a_reason(max_model_len, max_tokens, prompt_len, limit, names):
    sched = make_scheduler(max_model_len=max_model_len, max_tokens=max_tokens, max_num_seqs=4)
    long = add(sched, "long", prompt_len)
    ok = add(sched, "ok", 3)
    _, out = step(sched)
    assert out.ignored_seq_groups == [long]
    assert f"limit of {limit} tokens" in long.error and names in long.error
    seq = long.get_seqs()[0]
    assert seq.status == SequenceStatus.FINISHED_IGNORED and seq.finish_message == long.error
    assert seq.status.finish_reason == "ignored"
    # The other request is not held back.
    assert out.request_ids == ["ok"]
    assert long not in sched.waiting and ok in sched.running
    assert sched.block_manager.get_num_free_gpu_blocks() == 15


def test_a_prompt_that_can_never_fit_is_ignored_not_waited_for():
    sched = make_scheduler(block_size=2, gpu=2)
    big = add(sched, "big", 5)  # 3 blocks of 2 > 2 blocks in the cache
    add(sched, "small", 2)
    _, out = step(sched)
    assert out.ignored_seq_groups == [big]
    assert "blocks" in big.error and "2 blocks" in big.error
    assert out.request_ids == ["small"]


def test_the_watermark_decides_never_too():
    sched = make_scheduler(block_size=2, gpu=10, watermark=0.2)  # keeps 2 blocks free
    big = add(sched, "big", 17)  # 9 blocks: 10 - 9 < 2
    _, out = step(sched)
    assert out.ignored_seq_groups == [big]


def test_forked_samples_copy_their_shared_last_block_on_write():
    sched = make_scheduler(block_size=4, gpu=8)
    g = add(sched, "A", 2, n=2, max_tokens=4)
    step(sched)
    shared = table(sched, g, 0)
    assert table(sched, g, 1) == shared and len(shared) == 1
    metadata, out = step(sched)
    assert metadata[0].token_chunk_size == 1 and set(metadata[0].seq_data) == {s.seq_id for s in g.get_seqs()}
    assert out.num_batched_tokens == 2  # one token per sample
    t0, t1 = table(sched, g, 0), table(sched, g, 1)
    assert list(out.blocks_to_copy) == shared
    assert out.blocks_to_copy[shared[0]] == [t0[0]] and t1 == shared  # the first writer copied
    assert t0 != t1


def test_no_preemption_mode_recomputes_a_single_sequence_group():
    # A (n=2, older) and B (n=1, newest): A's two samples each need a block; B cannot get one.
    sched = make_scheduler(mode=None, block_size=2, gpu=4, cpu=4)
    add(sched, "A", 2, n=2, max_tokens=2)  # small enough to fit: see test_never_fits.py
    b = add(sched, "B", 2)
    step(sched)
    _, out = step(sched)
    assert out.preempted == ["B"] and out.swapped_out == [] and out.blocks_to_swap_out == {}
    assert ids(sched.waiting) == ["B"] and b.get_seqs()[0].status == SequenceStatus.WAITING
    assert out.request_ids == ["A"]


def test_no_preemption_mode_swaps_a_group_with_several_sequences():
    # A (n=1, older) and B (n=2, newest): B's two samples need two blocks, one is left.
    sched = make_scheduler(mode=None, block_size=2, gpu=4, cpu=4)
    a = add(sched, "A", 2)
    b = add(sched, "B", 2, n=2, max_tokens=2)
    step(sched)
    shared = table(sched, b)
    _, out = step(sched)
    assert out.preempted == ["B"] and out.swapped_out == ["B"]
    assert list(out.blocks_to_swap_out) == shared  # the shared block moves once
    cpu = out.blocks_to_swap_out[shared[0]]
    assert ids(sched.swapped) == ["B"] and out.request_ids == ["A"]
    assert all(s.status == SequenceStatus.SWAPPED for s in b.get_seqs())
    assert table(sched, b, 0) == table(sched, b, 1) == [cpu]
    assert sched.block_manager.cpu_allocator.blocks[cpu].ref_count == 2
    finish(sched, a)
    _, out = sched.schedule()  # (no postprocess: the round's token would finish both samples)
    assert out.swapped_in == ["B"] and list(out.blocks_to_swap_in) == [cpu]
    back = out.blocks_to_swap_in[cpu]
    assert table(sched, b, 0)[0] == table(sched, b, 1)[0] == back  # still shared after the round trip
    finish(sched, b)
    assert_all_free(sched)


def test_forced_recompute_still_swaps_a_group_with_several_sequences():
    # Recompute would bring B's two different samples back through one shared block table.
    sched = make_scheduler(mode="recompute", block_size=2, gpu=4, cpu=4)
    add(sched, "A", 2)
    b = add(sched, "B", 2, n=2, max_tokens=2)
    step(sched)
    _, out = step(sched)
    assert out.preempted == ["B"] and out.swapped_out == ["B"] and ids(sched.swapped) == ["B"]
    assert len(out.blocks_to_swap_out) == 1 and not sched.waiting
    assert all(s.status == SequenceStatus.SWAPPED for s in b.get_seqs())


def test_forced_recompute_still_recomputes_a_single_sequence():
    sched, a, b = _two_full_prompts("recompute")
    _, out = step(sched)
    assert out.preempted == ["B"] and out.swapped_out == [] and ids(sched.waiting) == ["B"]


def test_without_cpu_swap_space_a_single_sequence_falls_back_to_recompute():
    sched = make_scheduler(mode="swap", block_size=2, gpu=4, cpu=0, max_tokens=8, max_num_seqs=2)
    a, b = add(sched, "A", 4), add(sched, "B", 4)
    step(sched)
    _, out = step(sched)  # A needs a third block; B cannot be swapped out, so it is recomputed
    assert out.preempted == ["B"] and out.swapped_out == [] and out.blocks_to_swap_out == {}
    assert ids(sched.waiting) == ["B"] and out.request_ids == ["A"]
    assert b.get_seqs()[0].status == SequenceStatus.WAITING and not out.ignored_seq_groups
    finish(sched, a)
    _, out = step(sched)
    assert out.request_ids == ["B"] and out.phase == "prefill"
    finish(sched, b)
    assert_all_free(sched)


@pytest.mark.parametrize("cpu", [0, 1])
def test_a_group_that_can_neither_swap_nor_recompute_is_finished_alone(cpu):
    # A and B (n=2 each) hold a shared block each; their first decode needs 4 new blocks, 2 are
    # free. B, the newest, can go neither to the CPU (its block needs 1 CPU block; with cpu=1 the
    # only one is taken) nor back to waiting (two samples): B alone is finished.
    sched = make_scheduler(mode=None, block_size=2, gpu=4, cpu=cpu)
    a = add(sched, "A", 2, n=2, max_tokens=2)
    b = add(sched, "B", 2, n=2, max_tokens=2)
    step(sched)
    if cpu:  # fill the one CPU block
        sched.block_manager.cpu_allocator.allocate()
    b_tokens = [s.get_token_ids() for s in b.get_seqs()]
    _, out = sched.schedule()
    assert out.ignored_seq_groups == [b] and out.preempted == [] and not out.blocks_to_swap_out
    assert out.request_ids == ["A"] and ids(sched.running) == ["A"]
    assert not (sched.waiting or sched.swapped)
    assert "CPU swap space is full" in b.error and "num_cpu_blocks" in b.error
    assert all(s.status.finish_reason == "ignored" and s.finish_message == b.error for s in b.get_seqs())
    assert [s.get_token_ids() for s in b.get_seqs()] == b_tokens  # what it generated is kept
    assert all(s.seq_id not in sched.block_manager.block_tables for s in b.get_seqs())
    finish(sched, a)
    if cpu:
        sched.block_manager.cpu_allocator.free(sched.block_manager.cpu_allocator.blocks[0])
    assert_all_free(sched)


def test_orca_mixes_prefill_and_decode_in_one_round():
    sched = make_scheduler(policy="orca")
    add(sched, "A", 3)
    step(sched)
    add(sched, "B", 5)
    metadata, out = step(sched)
    assert out.phase == "mixed"
    assert [(m.request_id, m.is_prompt, m.token_chunk_size) for m in metadata] == [("A", False, 1), ("B", True, 5)]
    assert out.num_batched_tokens == 6


def test_vllm_never_mixes_a_new_prompt_into_a_decode_round():
    sched = make_scheduler(policy="vllm")
    add(sched, "A", 3)
    step(sched)
    add(sched, "B", 5)
    _, out = step(sched)
    assert out.phase == "prefill" and out.request_ids == ["B"]
    _, out = step(sched)
    assert out.phase == "decode" and out.request_ids == ["A", "B"]


def test_vllm_admits_nothing_while_a_group_is_swapped_out():
    sched, a, b = _two_full_prompts("swap")
    step(sched)  # B swapped out
    add(sched, "C", 1)  # would fit in the one free block
    _, out = step(sched)
    assert out.phase == "decode" and out.request_ids == ["A"] and ids(sched.waiting) == ["C"]


@pytest.mark.parametrize("policy", ["vllm", "orca"])
def test_chunked_prefill_splits_a_long_prompt_over_rounds(policy):
    sched = make_scheduler(policy=policy, max_tokens=4, max_num_seqs=2, max_model_len=64, chunked=True)
    g = add(sched, "A", 10)
    seen = []
    for _ in range(3):
        metadata, out = step(sched)
        assert out.num_batched_tokens <= 4
        seen.append((metadata[0].token_chunk_size, metadata[0].do_sample, metadata[0].is_prompt))
    assert seen == [(4, False, True), (4, False, True), (2, True, True)]
    seq = g.get_seqs()[0]
    assert seq.get_output_len() == 1 and seq.num_computed_tokens == 10
    assert len(table(sched, g)) == 3  # every block of the prompt was allocated up front
    metadata, out = step(sched)
    assert (metadata[0].token_chunk_size, metadata[0].is_prompt) == (1, False)


def test_swapped_groups_come_back_oldest_first():
    # 6 blocks of 2; A, B, C take 2 each. Round 2 swaps C out; round 4 swaps B out.
    sched = make_scheduler(mode="swap", block_size=2, gpu=6, cpu=8)
    a = add(sched, "A", 4)
    add(sched, "B", 4), add(sched, "C", 4)
    step(sched)
    _, out = step(sched)
    assert out.swapped_out == ["C"]
    step(sched)
    _, out = step(sched)
    assert out.swapped_out == ["B"] and ids(sched.running) == ["A"]
    assert ids(sched.swapped) == ["B", "C"]  # arrival order, though C left first
    finish(sched, a)
    _, out = step(sched)
    # B (3 blocks + 1 to grow) fits in the 6 free blocks; C (2 + 1) no longer does.
    assert out.swapped_in == ["B"] and ids(sched.swapped) == ["C"] and ids(sched.running) == ["B"]


def test_a_group_swapped_out_in_the_middle_of_a_chunked_prefill_resumes_its_prefill():
    sched = make_scheduler(policy="orca", mode="swap", block_size=2, gpu=4, cpu=4, max_tokens=2, max_num_seqs=2,
                           chunked=True)
    a = add(sched, "A", 1)
    step(sched)
    step(sched)
    b = add(sched, "B", 3)
    for _ in range(2):  # A decodes; B prefills a token a round (the budget is 2)
        metadata, _ = step(sched)
        assert [(m.request_id, m.is_prompt, m.token_chunk_size) for m in metadata] == [("A", False, 1),
                                                                                       ("B", True, 1)]
    _, out = step(sched)  # A needs a third block: B, the newest, is swapped out mid-prefill
    assert out.swapped_out == ["B"] and b.get_seqs()[0].num_computed_tokens == 2
    finish(sched, a)
    metadata, out = step(sched)
    assert out.swapped_in == ["B"]
    assert [(m.request_id, m.is_prompt, m.token_chunk_size, m.do_sample) for m in metadata] == [
        ("B", True, 1, True)]
    assert out.phase == "prefill" and b.get_seqs()[0].get_output_len() == 1


def test_nothing_is_swapped_in_during_a_round_that_preempted():
    # preemption_mode=None: S (n=2) is swapped out in round 2; V (n=1) is recomputed in round 4,
    # which frees enough blocks for S. S still waits for a round without preemption.
    sched = make_scheduler(mode=None, block_size=2, gpu=7, cpu=8)
    add(sched, "A", 4), add(sched, "V", 6)
    s = add(sched, "S", 2, n=2, max_tokens=6)
    step(sched)
    _, out = step(sched)
    assert out.swapped_out == ["S"]
    _, out = step(sched)
    assert out.preempted == [] and out.swapped_in == []  # no room for S (1 block + 2 to grow)
    _, out = step(sched)
    assert out.preempted == ["V"] and ids(sched.waiting) == ["V"]
    assert sched.block_manager.can_swap_in(s)  # it would fit now ...
    assert out.swapped_in == [] and ids(sched.swapped) == ["S"]  # ... but not in this round
    _, out = step(sched)
    assert out.swapped_in == ["S"] and out.request_ids == ["A", "S"]


# -- the budget and the scheduled-group record ---------------------------------------------------


def test_the_budget_counts_tokens_and_sequences_against_both_limits():
    budget = SchedulingBudget(token_budget=10, max_num_seqs=3, num_curr_seqs=1)
    assert budget.remaining_token_budget() == 10 and budget.can_schedule(10, 2)
    assert not budget.can_schedule(11, 0) and not budget.can_schedule(1, 3)
    budget.add(num_new_tokens=6, num_new_seqs=2)
    assert (budget.num_batched_tokens, budget.num_curr_seqs, budget.remaining_token_budget()) == (6, 3, 4)
    assert budget.can_schedule(4, 0) and not budget.can_schedule(5, 0) and not budget.can_schedule(1, 1)
    budget.subtract_seqs(2)
    assert budget.can_schedule(4, 2)


def test_each_scheduled_group_carries_its_chunk_and_phase_and_matches_its_metadata():
    sched = make_scheduler(policy="orca", max_tokens=8)
    add(sched, "A", 5)
    step(sched)
    add(sched, "B", 3)
    metadata, out = sched.schedule()
    assert [(s.seq_group.request_id, s.token_chunk_size, s.is_prompt) for s in out.scheduled_seq_groups] == [
        ("A", 1, False), ("B", 3, True)]
    assert [(m.request_id, m.token_chunk_size, m.is_prompt) for m in metadata] == [
        (s.seq_group.request_id, s.token_chunk_size, s.is_prompt) for s in out.scheduled_seq_groups]
    assert out.num_batched_tokens == sum(s.num_batched_tokens for s in out.scheduled_seq_groups) == 4
    assert out.phase == "mixed" and out.request_ids == ["A", "B"]


# -- after the model: postprocess ----------------------------------------------------------------


def test_postprocess_appends_no_token_after_a_prefill_piece_short_of_the_prompt_end():
    sched = make_scheduler(policy="orca", chunked=True, max_tokens=4, max_num_seqs=2)
    a = add(sched, "A", 10)
    seq = a.get_seqs()[0]
    for computed in (4, 8):
        metadata, out = sched.schedule()
        assert metadata[0].token_chunk_size == 4 and not metadata[0].do_sample
        assert sched.postprocess(out, lambda group, s: 7) == []
        assert (seq.num_computed_tokens, seq.get_output_len()) == (computed, 0)
    metadata, out = sched.schedule()
    assert metadata[0].token_chunk_size == 2 and metadata[0].do_sample
    sched.postprocess(out, lambda group, s: 7)
    assert (seq.num_computed_tokens, seq.output_token_ids) == (10, [7])
    assert not seq.is_prefill()


@pytest.mark.parametrize("stop, expected", [
    (dict(eos=7), "stop"), (dict(eos=7, ignore_eos=True), "length"), (dict(stop_token_ids=[7]), "stop"),
    (dict(), "length"), (dict(max_model_len=5), "length"), (dict(string=True), "stop")])
def test_check_stop_finishes_on_eos_stop_ids_stop_strings_and_lengths(stop, expected):
    # A 4-token prompt; the first sample is token 7. It ends the sequence on EOS or a stop id
    # (unless EOS is ignored), on a stop string the engine found, or on reaching max_tokens=1,
    # or max_model_len=5 tokens (with max_tokens=8 the length cap comes from the model).
    max_tokens = 1 if not stop or stop.get("ignore_eos") else 8
    sched = make_scheduler(max_model_len=stop.get("max_model_len", 64))
    seq = Sequence(next(_ids), None, [1, 2, 3, 4], 4)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=stop.get("ignore_eos", False),
                            stop_token_ids=stop.get("stop_token_ids"))
    group = SequenceGroup("A", [seq], params, 0.0)
    sched.add_seq_group(group)
    _, out = sched.schedule()
    (g, s), = sched.update_num_computed_tokens(out)
    s.append_token_id(7)
    assert sched.check_stop(g, s, stop.get("eos"), stop_string_found=stop.get("string", False))
    assert seq.status.finish_reason == expected
    sched.free_finished_seq_groups()
    assert_all_free(sched)


def test_check_stop_lets_a_sequence_go_on_otherwise():
    sched = make_scheduler()
    g = add(sched, "A", 4, max_tokens=3)
    _, out = sched.schedule()
    (group, seq), = sched.update_num_computed_tokens(out)
    seq.append_token_id(7)
    assert not sched.check_stop(group, seq, eos_token_id=8) and not seq.is_finished()
    assert sched.block_manager.get_block_table(seq) == table(sched, g)
