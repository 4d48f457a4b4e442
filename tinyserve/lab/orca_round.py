"""Chapter 04's look inside one round: a scheduler stopped between two rounds, and what its
block manager and budget answer there.

``scheduler_after`` drives the real Scheduler as ``sim.simulate`` does (the same arrivals, the
same made-up tokens) and stops after a given number of rounds, so a chapter can ask the questions
the next round will ask (who can get a slot, who can come back, who fits) before the scheduler
answers them itself. ``running_slots`` and ``waiting_fits`` print those answers.
"""

from __future__ import annotations

import itertools

from tinyserve.block_manager import AllocStatus
from tinyserve.presets import Preset
from tinyserve.scheduler import Scheduler
from tinyserve.sequence import SamplingParams, Sequence, SequenceGroup, SequenceStatus
from tinyserve.sim import RoundRecord, make_record


def scheduler_after(preset: Preset, num_rounds: int, cls: type = Scheduler) -> tuple[Scheduler, list[RoundRecord]]:
    """``cls`` on the preset's configs after ``num_rounds`` rounds of its requests, driven as
    ``sim.simulate`` drives it, and the records of those rounds. The requests that arrive in
    round ``num_rounds + 1`` are already waiting, as they are when that round is scheduled."""
    sc, cc = preset.scheduler_config, preset.cache_config
    scheduler = cls(sc, cc)
    pending = sorted(preset.requests, key=lambda r: r.arrival_round)
    seq_ids, fake_token = itertools.count(), itertools.count(1000)
    records: list[RoundRecord] = []
    for round_no in range(1, num_rounds + 2):
        while pending and pending[0].arrival_round <= round_no:
            r = pending.pop(0)
            seq = Sequence(next(seq_ids), None, [next(fake_token) for _ in range(r.prompt_len)], cc.block_size)
            scheduler.add_seq_group(SequenceGroup(r.request_id, [seq], SamplingParams(max_tokens=r.output_len),
                                                  arrival_time=float(round_no)))
        if round_no > num_rounds:
            break
        _, out = scheduler.schedule()
        finished = scheduler.postprocess(out, lambda group, seq: next(fake_token))
        records.append(make_record(round_no, scheduler, out, finished))
    return scheduler, records


def running_slots(scheduler: Scheduler) -> None:
    """For each running group, oldest first: its tokens, its blocks, whether this round's slot
    (the K/V of its newest token) opens a new block, and the block manager's ``can_append_slot``."""
    bm = scheduler.block_manager
    print(f"free GPU blocks: {bm.get_num_free_gpu_blocks()}")
    for group in scheduler.running:
        seq = group.get_seqs(SequenceStatus.RUNNING)[0]
        print(f"  running {group.request_id}: {seq.get_len():>2} tokens, blocks {bm.get_block_table(seq)}, "
              f"its slot needs a new block: {bm._needs_new_block(seq)}, can_append_slot: {bm.can_append_slot(group)}")


def waiting_fits(scheduler: Scheduler) -> None:
    """The swapped and waiting groups, front first, with what the block manager says of each."""
    bm = scheduler.block_manager
    for group in scheduler.swapped:
        print(f"  swapped {group.request_id}: can_swap_in {bm.can_swap_in(group)}")
    for group in scheduler.waiting:
        seq = group.get_seqs(SequenceStatus.WAITING)[0]
        status: AllocStatus = bm.can_allocate(group)
        print(f"  waiting {group.request_id}: {seq.get_len()} tokens to prefill "
              f"({seq.get_output_len()} of them generated before), can_allocate {status.name}")
