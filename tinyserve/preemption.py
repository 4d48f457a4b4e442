"""Preemption: when the cache has no block for a running group's next token, another running
group leaves the GPU, by swapping its blocks to CPU memory or by dropping them to be recomputed.

``PreemptionMixin`` is the part of the ``Scheduler`` that decides how (``_preemption_mode``)
and does it (``_preempt``); which group goes is ``Scheduler.choose_victim``'s choice, by
default ``preempt_newest``, vLLM's. A victim that cannot leave (its samples cannot be recomputed
and swap space is full) would have to be given up; while a group that can be recomputed is
running, that one leaves in its place (``_stand_in``), so memory pressure never fails a request
that another one's leaving could save.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from tinyserve import refusals
from tinyserve.scheduler_outputs import PreemptionMode, SchedulerOutputs, SchedulingBudget
from tinyserve.sequence import SequenceGroup, SequenceStatus

VictimPolicy = Callable[[list[SequenceGroup]], SequenceGroup]


def preempt_newest(running: list[SequenceGroup]) -> SequenceGroup:
    """vLLM's victim: the group that arrived last (it has the least work to lose)."""
    return running[-1]


class PreemptionMixin:
    """The Scheduler's preemption (it uses the scheduler's queues, block_manager and config)."""

    def _preemption_mode(self, group: SequenceGroup) -> PreemptionMode:
        mode = self.scheduler_config.preemption_mode
        if mode == "swap":
            return PreemptionMode.SWAP
        if mode == "recompute":
            # Forced recompute still swaps a group with several sequences: they would come back
            # through one prefill with one shared block table, though their tokens differ. vLLM
            # v0.4's _preempt_by_recompute likewise supports a single sequence only.
            return PreemptionMode.RECOMPUTE if self._recomputable(group) else PreemptionMode.SWAP
        # vLLM's rule: a single sequence is cheap to recompute; several sequences sharing blocks
        # would each have to be recomputed, so they are swapped.
        return PreemptionMode.RECOMPUTE if group.get_max_num_running_seqs() == 1 else PreemptionMode.SWAP

    @staticmethod
    def _take_victim(victim: SequenceGroup, candidates: deque[SequenceGroup]) -> None:
        """Take the group ``choose_victim`` picked off the groups it was offered."""
        if victim not in candidates:
            raise ValueError(f"choose_victim returned {victim!r}, which is not one of the running groups it was given")
        candidates.remove(victim)

    @staticmethod
    def _recomputable(group: SequenceGroup) -> bool:
        """One live sequence: its tokens alone rebuild its K/V in a prefill. (A group whose
        prompt is still being prefilled in pieces has one sequence too, whatever its n.)"""
        return len(group.get_unfinished_seqs()) == 1

    def _cannot_leave(self, group: SequenceGroup) -> bool:
        """Preempting the group would mean giving it up: it must be swapped, and cannot be."""
        return (self._preemption_mode(group) == PreemptionMode.SWAP and not self._recomputable(group)
                and not self.block_manager.can_swap_out(group))

    def _stand_in(self, victim: SequenceGroup, candidates: list[SequenceGroup],
                  scheduled: deque[SequenceGroup]) -> SequenceGroup | None:
        """The group to preempt instead of ``victim`` when ``victim`` cannot leave: the newest
        recomputable one among the candidates, else among the groups already given their slot
        this round (``scheduled``, newest last). None when there is none, or no need."""
        if not self._cannot_leave(victim):
            return None
        for pool in (candidates, scheduled):
            for group in reversed(pool):
                if group is not victim and self._recomputable(group):
                    return group
        return None

    def _preempt(self, group: SequenceGroup, out: SchedulerOutputs, budget: SchedulingBudget) -> None:
        budget.subtract_seqs(group.get_max_num_running_seqs())  # it leaves `running`, whatever happens
        mode = self._preemption_mode(group)
        if mode == PreemptionMode.SWAP and not self.block_manager.can_swap_out(group):
            # CPU swap space is full (or there is none). That must not fail every request in
            # flight: recompute the group if it can be, otherwise give up on this group alone.
            # >>> fold: safety net: no group can be recomputed, give this one up
            if not self._recomputable(group):
                # Only for lack of memory now (no group that could be recomputed was running):
                # the same request may well run later.
                self._give_up(group, out, refusals.cannot_preempt(group, self.block_manager), retryable=True)
                return
            # <<<
            mode = PreemptionMode.RECOMPUTE
        out.preempted.append(group.request_id)
        if mode == PreemptionMode.RECOMPUTE:
            for seq in group.get_seqs(SequenceStatus.RUNNING):
                seq.reset_for_recompute()
                self.block_manager.free(seq)
            self.waiting.appendleft(group)
            return
        out.blocks_to_swap_out.update(self.block_manager.swap_out(group))
        for seq in group.get_seqs(SequenceStatus.RUNNING):
            seq.status = SequenceStatus.SWAPPED
        out.swapped_out.append(group.request_id)
        # >>> fold: vLLM v0.4 compat
        if self.scheduler_config.compat == "vllm-0.4":
            # v0.4 appends, and sorts `swapped` by arrival before use: equal arrival times keep this order.
            self.swapped.append(group)
            return
        # <<<
        # To the front: victims are taken newest first, so this keeps `swapped` oldest first
        # (FCFS when they come back) and `running` in arrival order after they do.
        self.swapped.appendleft(group)

    def _unschedule(self, group: SequenceGroup, kept: deque[SequenceGroup], out: SchedulerOutputs,
                    budget: SchedulingBudget) -> None:
        """Take back a running group's place in this round (it is about to be preempted)."""
        kept.remove(group)
        scheduled = next(s for s in out.scheduled_seq_groups if s.seq_group is group)
        out.scheduled_seq_groups.remove(scheduled)
        budget.add(num_new_tokens=-scheduled.num_batched_tokens)
        out.num_batched_tokens = budget.num_batched_tokens
        # A copy-on-write its slot needed is moot once its blocks are freed.
        mine = {b for seq in group.get_seqs(SequenceStatus.RUNNING) for b in self.block_manager.get_block_table(seq)}
        for src in list(out.blocks_to_copy):
            out.blocks_to_copy[src] = [dst for dst in out.blocks_to_copy[src] if dst not in mine]
            if not out.blocks_to_copy[src]:
                del out.blocks_to_copy[src]
