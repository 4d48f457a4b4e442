"""What the scheduler tests share: a round played as the engine plays it, without a model, and
the check that nothing leaked.

``play_round`` is ``LLMEngine.step`` with made-up tokens: the scheduler's own pieces advance the
computed tokens, finish sequences that stop and drop finished groups; like the engine, it forks a
prompt's first sample into ``n`` samples, each with a token of its own.
"""

from __future__ import annotations

import itertools

from tinyserve.scheduler import Scheduler, SchedulerOutputs
from tinyserve.sequence import SequenceGroupMetadata

_seq_ids = itertools.count(1_000_000)  # for forks: clear of the ids the tests give their sequences
_tokens = itertools.count(500_000)


def play_round(sched: Scheduler) -> tuple[list[SequenceGroupMetadata], SchedulerOutputs]:
    metadata, out = sched.schedule()
    for group, seq in sched.update_num_computed_tokens(out):
        n = group.sampling_params.n if group.is_waiting_for_prefill() else 1
        children = [seq.fork(next(_seq_ids)) for _ in range(n - 1)]  # before seq takes its token
        for child in children:
            group.add(child)
            sched.fork_seq(seq, child)
        for s in [seq, *children]:
            s.append_token_id(next(_tokens))
            sched.check_stop(group, s)
    sched.free_finished_seq_groups()
    return metadata, out


def assert_all_free(sched: Scheduler) -> None:
    """No block leaked: every block table gone, every block free, every ref count 0."""
    bm = sched.block_manager
    assert bm.block_tables == {}
    assert bm.get_num_free_gpu_blocks() == bm.num_total_gpu_blocks
    assert bm.get_num_free_cpu_blocks() == bm.num_total_cpu_blocks
    assert all(b.ref_count == 0 for b in bm.gpu_allocator.blocks + bm.cpu_allocator.blocks)
