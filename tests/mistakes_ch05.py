"""Deliberately wrong answers for chapter 05's main exercise, the vLLM round (``check_scheduler_round``).

Each is the chapter's solution (``VllmRound``) with one plausible slip in one of its methods;
tests/exercise_mistakes.py merges ``MISTAKES`` with the other chapters'.
"""

from __future__ import annotations

import runpy
from collections import deque
from pathlib import Path

from tinyserve import refusals
from tinyserve.block_manager import AllocStatus
from tinyserve.scheduler import SchedulerOutputs
from tinyserve.sequence import SequenceStatus

VllmRound = runpy.run_path(str(Path(__file__).resolve().parents[1] / "chapters" / "solutions" / "ch05.py"))["VllmRound"]


class _StopsAtNeverFitting(VllmRound):
    """Treats a prompt that can never run like one that must wait: it blocks the queue behind it
    (and the round finds nothing to do)."""

    def _admit_waiting(self, out, budget):
        cfg = self.scheduler_config
        while self.waiting:
            group = self.waiting[0]
            seq = group.get_seqs(SequenceStatus.WAITING)[0]
            limit = cfg.max_model_len if self._may_split(seq) else cfg.prompt_limit
            if refusals.admission_refusal(group, limit, self.block_manager, cfg) is not None:
                break
            if self.block_manager.can_allocate(group) != AllocStatus.OK:
                break
            num_new_tokens = self._num_new_tokens(seq, budget)
            num_new_seqs = group.get_max_num_running_seqs()
            if num_new_tokens <= 0 or not budget.can_schedule(num_new_tokens, num_new_seqs):
                break
            self.waiting.popleft()
            self.block_manager.allocate(group)
            for s in group.get_seqs(SequenceStatus.WAITING):
                s.status = SequenceStatus.RUNNING
            self.running.append(group)
            budget.add(num_new_seqs=num_new_seqs)
            self._schedule(out, budget, group, num_new_tokens, is_prompt=True)


class _AdmitsWhileSwapped(VllmRound):
    """Admits new prompts while groups wait in ``swapped``: newcomers overtake the groups that
    were admitted before them."""

    def _schedule_vllm(self):
        out, budget = SchedulerOutputs(), self._new_budget()
        self._continue_prefills(out, budget)
        self._admit_waiting(out, budget)
        if out.scheduled_seq_groups or out.ignored_seq_groups:
            return out
        self._decode_running(out, budget)
        if not out.preempted:
            self._swap_in_swapped(out, budget)
        return out


class _MixesPhases(VllmRound):
    """Goes on to decode after admitting prompts: an Orca round, not vLLM's."""

    def _schedule_vllm(self):
        out, budget = SchedulerOutputs(), self._new_budget()
        self._continue_prefills(out, budget)
        if not self.swapped:
            self._admit_waiting(out, budget)
        if out.ignored_seq_groups and not out.scheduled_seq_groups:
            return out
        self._decode_running(out, budget)
        if not out.preempted:
            self._swap_in_swapped(out, budget)
        return out


class _SwapsInAfterPreemption(VllmRound):
    """Swaps groups back in a round that has just preempted: what comes in is thrown out again."""

    def _schedule_vllm(self):
        out, budget = SchedulerOutputs(), self._new_budget()
        self._continue_prefills(out, budget)
        if not self.swapped:
            self._admit_waiting(out, budget)
        if out.scheduled_seq_groups or out.ignored_seq_groups:
            return out
        self._decode_running(out, budget)
        self._swap_in_swapped(out, budget)
        return out


def _decode(self, out, budget, pick_victim, pieces=True):
    """The solution's decode loop with the victim chosen by ``pick_victim(group, todo)``, and
    without the branch for a prompt prefilled in pieces unless ``pieces``."""
    todo, kept = deque(self.running), deque()
    while todo:
        group = todo.popleft()
        seq = group.get_seqs(SequenceStatus.RUNNING)[0]
        if pieces and seq.is_prefill():
            kept.append(group)
            n = self._num_new_tokens(seq, budget)
            if n > 0:
                self._schedule(out, budget, group, n, is_prompt=True)
            continue
        while not self.block_manager.can_append_slot(group):
            victim = pick_victim(self, group, todo)
            if victim is group:
                self._preempt(group, out, budget)
                break
            todo.remove(victim)
            self._preempt(victim, out, budget)
        else:
            self._append_slots(group, out)
            kept.append(group)
            self._schedule(out, budget, group, 1, is_prompt=False)
    self.running = kept


class _PreemptsTheOldest(VllmRound):
    """Takes the victim from the wrong end: the oldest group still waiting for its slot."""

    def _decode_running(self, out, budget):
        _decode(self, out, budget, lambda s, group, todo: todo[0] if todo else group)


class _NewestByHand(VllmRound):
    """Always takes the newest by hand instead of asking ``self.choose_victim``: right by default,
    but a victim policy plugged in (exercise 4's) is never asked."""

    def _decode_running(self, out, budget):
        _decode(self, out, budget, lambda s, group, todo: todo[-1] if todo else group)


class _NoPieces(VllmRound):
    """Decodes a group whose refill is still being prefilled in pieces, as the mixed round of
    chapter 04 (which calls these phases too) may leave one."""

    def _decode_running(self, out, budget):
        _decode(self, out, budget, lambda s, group, todo: s.choose_victim([group, *todo]), pieces=False)


class _NoSlotOnSwapIn(VllmRound):
    """Brings a swapped group back without the slot for the token it adds in the same round."""

    def _swap_in_swapped(self, out, budget):
        while self.swapped:
            group = self.swapped[0]
            n = group.get_max_num_running_seqs()
            if not self.block_manager.can_swap_in(group) or not budget.can_schedule(n, n):
                break
            self.swapped.popleft()
            out.blocks_to_swap_in.update(self.block_manager.swap_in(group))
            for seq in group.get_seqs(SequenceStatus.SWAPPED):
                seq.status = SequenceStatus.RUNNING
            self.running.append(group)
            budget.add(num_new_seqs=n)
            out.swapped_in.append(group.request_id)
            self._schedule(out, budget, group, 1, is_prompt=False)


class _IgnoresCanAdmit(VllmRound):
    """Never asks ``self.can_admit``: an admission rule plugged in (chapter 04's) has no say."""

    def _admit_waiting(self, out, budget):
        rule, self.can_admit = self.can_admit, None
        try:
            super()._admit_waiting(out, budget)
        finally:
            self.can_admit = rule


class _WaitsInPlace(VllmRound):
    """Goes on with the loop when the head of the queue must wait (``continue`` for ``break``): the
    same group is looked at again and again, and the round never ends (the checker stops it)."""

    def _admit_waiting(self, out, budget):
        while self.waiting:
            group = self.waiting[0]
            if self.block_manager.can_allocate(group) != AllocStatus.OK:
                continue
            seq = group.get_seqs(SequenceStatus.WAITING)[0]
            num_new_tokens = self._num_new_tokens(seq, budget)
            if not budget.can_schedule(num_new_tokens, group.get_max_num_running_seqs()):
                continue
            self.waiting.popleft()
            self.block_manager.allocate(group)
            for s in group.get_seqs(SequenceStatus.WAITING):
                s.status = SequenceStatus.RUNNING
            self.running.append(group)
            budget.add(num_new_seqs=group.get_max_num_running_seqs())
            self._schedule(out, budget, group, num_new_tokens, is_prompt=True)


MISTAKES = {
    "check_scheduler_round": [_StopsAtNeverFitting, _AdmitsWhileSwapped, _MixesPhases, _SwapsInAfterPreemption,
                              _PreemptsTheOldest, _NewestByHand, _NoPieces, _NoSlotOnSwapIn, _IgnoresCanAdmit,
                              _WaitsInPlace],
}
