"""Deliberately wrong answers for chapter 04's main exercise, the Orca round (``check_orca_round``).

Each is the chapter's solution (``OrcaRound``) with one plausible slip in one of its parts;
tests/exercise_mistakes.py merges ``MISTAKES`` with the other chapters'.
"""

from __future__ import annotations

import runpy
from collections import deque
from pathlib import Path

from tinyserve.scheduler import Scheduler, SchedulerOutputs
from tinyserve.sequence import SequenceStatus

OrcaRound = runpy.run_path(str(Path(__file__).resolve().parents[1] / "chapters" / "solutions" / "ch04.py"))["OrcaRound"]


class _AdmitsFirst(OrcaRound):
    """Admits waiting prompts before the decodes: the newcomers take the token budget the running
    groups needed, and are decoded in the very round of their prefill."""

    def _schedule_mixed(self):
        out, budget = SchedulerOutputs(), self._new_budget()
        if not self.swapped:
            self._orca_admit(out, budget)
        self._orca_decode(out, budget)
        if not out.preempted:
            self._orca_swap_in(out, budget)
        return out


class _SwapsInAfterPreempting(OrcaRound):
    """Brings swapped groups back even in a round that had to preempt: the group just swapped out
    comes straight back in."""

    def _schedule_mixed(self):
        out, budget = SchedulerOutputs(), self._new_budget()
        self._orca_decode(out, budget)
        self._orca_swap_in(out, budget)
        if not self.swapped:
            self._orca_admit(out, budget)
        return out


class _AdmitsWhileSwapped(OrcaRound):
    """Admits new prompts while groups wait in ``swapped``: newcomers overtake the groups that were
    admitted before them, and take the blocks those need to come back."""

    def _schedule_mixed(self):
        out, budget = SchedulerOutputs(), self._new_budget()
        self._orca_decode(out, budget)
        if not out.preempted:
            self._orca_swap_in(out, budget)
        self._orca_admit(out, budget)
        return out


class _PreemptsItself(OrcaRound):
    """When a group's next slot does not fit, preempts that group rather than asking
    ``choose_victim`` (vLLM's default takes the newest running group)."""

    def _orca_decode(self, out, budget):
        todo, kept = deque(self.running), deque()
        while todo:
            group = todo.popleft()
            seq = group.get_seqs(SequenceStatus.RUNNING)[0]
            if seq.is_prefill():
                kept.append(group)
                num_new_tokens = self._num_new_tokens(seq, budget)
                if num_new_tokens > 0:
                    self._schedule(out, budget, group, num_new_tokens, is_prompt=True)
                continue
            if not self.block_manager.can_append_slot(group):
                self._preempt(group, out, budget)
                continue
            self._append_slots(group, out)
            kept.append(group)
            self._schedule(out, budget, group, 1, is_prompt=False)
        self.running = kept


class _DecodesARefill(OrcaRound):
    """Treats every running group as decoding: a refill cut short last round gets one token
    instead of its next piece."""

    def _orca_decode(self, out, budget):
        todo, kept = deque(self.running), deque()
        while todo:
            group = todo.popleft()
            while not self.block_manager.can_append_slot(group):
                victim = self.choose_victim([group, *todo])
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


def _admit_with(skip_never: bool = True, count_seqs: bool = True, ask_hook: bool = True):
    """An ``_orca_admit`` with one of three slips switched on."""
    from tinyserve import refusals
    from tinyserve.block_manager import AllocStatus

    def _orca_admit(self, out, budget):
        cfg = self.scheduler_config
        while self.waiting:
            group = self.waiting[0]
            seq = group.get_seqs(SequenceStatus.WAITING)[0]
            limit = cfg.max_model_len if self._may_split(seq) else cfg.prompt_limit
            reason = refusals.admission_refusal(group, limit, self.block_manager, cfg)
            status = self.block_manager.can_allocate(group) if reason is None else None
            if status == AllocStatus.NEVER:
                reason = refusals.no_room(group, self.block_manager)
            if reason is not None:
                if not skip_never:
                    break
                self._ignore(group, out, reason)
                continue
            num_new_tokens = self._num_new_tokens(seq, budget)
            num_new_seqs = group.get_max_num_running_seqs() if count_seqs else 0
            if (status == AllocStatus.LATER or num_new_tokens <= 0
                    or not budget.can_schedule(num_new_tokens, num_new_seqs)):
                break
            if ask_hook and self.can_admit is not None and not self.can_admit(group, budget, self.block_manager):
                break
            self.waiting.popleft()
            self.block_manager.allocate(group)
            for s in group.get_seqs(SequenceStatus.WAITING):
                s.status = SequenceStatus.RUNNING
            self.running.append(group)
            budget.add(num_new_seqs=num_new_seqs)
            self._schedule(out, budget, group, num_new_tokens, is_prompt=True)
    return _orca_admit


class _StopsAtNeverFitting(OrcaRound):
    """Stops admitting at a prompt that can never run instead of refusing it: everyone behind it
    waits for ever (and the safety net has to refuse it a round late)."""

    _orca_admit = _admit_with(skip_never=False)


class _CountsOnlyTokens(OrcaRound):
    """Checks the token budget but not ``max_num_seqs``: more groups run than a round may hold."""

    _orca_admit = _admit_with(count_seqs=False)


class _ForgetsTheHook(OrcaRound):
    """Never asks ``can_admit``: a reader's admission rule (exercise 3) has no effect on the round."""

    _orca_admit = _admit_with(ask_hook=False)


class _OverridesTheVllmRound(OrcaRound):
    """Names its decode phase as the package does, ``_decode_running``: that is chapter 05's, and
    it would change the vLLM round as well."""

    def _decode_running(self, out, budget):
        return Scheduler._decode_running(self, out, budget)


MISTAKES = {
    "check_orca_round": [
        _AdmitsFirst,             # prefills take the budget before the decodes
        _SwapsInAfterPreempting,  # swaps in within the round that preempted
        _AdmitsWhileSwapped,      # newcomers overtake swapped-out groups
        _PreemptsItself,          # ignores choose_victim: preempts the group that needs the slot
        _DecodesARefill,          # a refill cut into pieces gets a decode token instead of its next piece
        _StopsAtNeverFitting,     # a never-fitting prompt blocks the queue instead of being refused
        _CountsOnlyTokens,        # forgets max_num_seqs
        _ForgetsTheHook,          # never calls can_admit
        _OverridesTheVllmRound,   # overrides chapter 05's phase, so it cannot join scheduler_round
        Scheduler,                # the package's own class: its _schedule_mixed is not the reader's
    ],
}
