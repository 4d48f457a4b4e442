"""Deliberately wrong answers for chapter 13's exercises: the v1 round (``check_v1_round``), the
chunk rule (``check_v1_chunk``) and first tokens under each policy (``check_first_token_rounds``).

Each round is the chapter's solution (``V1Round``) with one plausible slip in one of its methods;
tests/exercise_mistakes.py merges ``MISTAKES`` with the other chapters'.
"""

from __future__ import annotations

import functools
import runpy
from collections import deque
from pathlib import Path

from tinyserve import refusals
from tinyserve.scheduler import SchedulerOutputs
from tinyserve.sequence import SequenceStatus

SOLUTION = runpy.run_path(str(Path(__file__).resolve().parents[1] / "chapters" / "solutions" / "ch13.py"))
V1Round = SOLUTION["V1Round"]


def _chunk(self, seq, computed, budget, threshold=True):
    """The package's ``_v1_chunk``, or, without ``threshold``, the same rule written inline by a
    reader who forgot ``long_prefill_token_threshold``."""
    if threshold:
        return self._v1_chunk(seq, computed, budget)
    num = seq.get_len() - computed
    return min(num, budget.remaining_token_budget()) if self._may_split(seq) else num


def _run(self, out, budget, pick_victim=None, threshold=True, stop_after_self=True):
    """The solution's ``_run_running_v1`` with the victim chosen by ``pick_victim(self, group, todo)``,
    the chunk by ``_chunk``, and, unless ``stop_after_self``, going on after a group preempted itself."""
    todo, kept = deque(self.running), deque()
    while todo and budget.remaining_token_budget() > 0:
        group = todo.popleft()
        seq = group.get_seqs(SequenceStatus.RUNNING)[0]
        prefill = seq.is_prefill()
        num_new_tokens = _chunk(self, seq, seq.num_computed_tokens, budget, threshold) if prefill else 1
        if num_new_tokens * group.num_seqs(SequenceStatus.RUNNING) > budget.remaining_token_budget():
            kept.append(group)
            continue
        while not self._fits_v1(group, num_new_tokens):
            victim = pick_victim(self, group, todo) if pick_victim else self.choose_victim([group, *todo])
            if victim is group:
                self._preempt(group, out, budget)
                break
            todo.remove(victim)
            self._preempt(victim, out, budget)
        else:
            if prefill:
                self.block_manager.grow(seq, seq.num_computed_tokens + num_new_tokens)
            else:
                self._append_slots(group, out)
            kept.append(group)
            self._schedule(out, budget, group, num_new_tokens, is_prompt=prefill)
            continue
        if stop_after_self:
            break
    self.running = kept + todo


def _admit(self, out, budget, whole_prompt=False, whole_blocks=True, hits=True, threshold=True, skip=True,
           refuse=True, ask_hook=True):
    """The solution's ``_admit_waiting_v1``, each switch a slip: blocks for the whole prompt at
    admission, prefix hits not cut to whole blocks (or not taken at all), no threshold, stopping
    at a prompt that may not be cut instead of skipping it, no refusals, no ``can_admit``."""
    cfg, bm = self.scheduler_config, self.block_manager
    skipped = []
    while self.waiting and budget.remaining_token_budget() > 0:
        group = self.waiting[0]
        seq = group.get_seqs(SequenceStatus.WAITING)[0]
        if refuse:
            cut = self._may_split(seq) or 0 < cfg.long_prefill_token_threshold <= cfg.max_num_batched_tokens
            reason = refusals.admission_refusal(group, cfg.max_model_len if cut else cfg.prompt_limit, bm, cfg)
            if reason is None and seq.n_blocks > bm.num_total_gpu_blocks:
                reason = refusals.no_room(group, bm)
            if reason is not None:
                self._ignore(group, out, reason)
                continue
        num_new_seqs = group.get_max_num_running_seqs()
        if not budget.can_schedule(0, num_new_seqs):
            break
        cached = self._num_cached_tokens(group) if hits else 0
        if whole_blocks:
            cached -= cached % bm.block_size
        num_new_tokens = _chunk(self, seq, cached, budget, threshold)
        if num_new_tokens > budget.remaining_token_budget():
            if not skip:
                break
            skipped.append(self.waiting.popleft())
            continue
        upto = seq.get_len() if whole_prompt else cached + num_new_tokens
        if not bm.can_grow(seq, upto, cached):
            break
        if ask_hook and self.can_admit is not None and not self.can_admit(group, budget, bm):
            break
        self.waiting.popleft()
        bm.grow(seq, upto, cached)
        seq.num_computed_tokens, seq.status = cached, SequenceStatus.RUNNING
        self.running.append(group)
        budget.add(num_new_seqs=num_new_seqs)
        self._schedule(out, budget, group, num_new_tokens, is_prompt=True)
    self.waiting.extendleft(reversed(skipped))


class _AdmitsAfterPreempting(V1Round):
    """Admits waiting requests even in a step that has just preempted: the newcomer takes the
    blocks that were freed for the running ones, and the victim waits behind it."""

    def _schedule_v1(self):
        out, budget = SchedulerOutputs(), self._new_budget()
        self._run_running_v1(out, budget)
        self._swap_in_swapped(out, budget)
        if not self.swapped:
            self._admit_waiting_v1(out, budget)
        return out


class _WholePromptAtAdmission(V1Round):
    """Allocates the blocks of the whole prompt at admission, as v0.4's ``allocate`` does, instead
    of those of the first chunk: a long prompt holds blocks it will not fill for steps."""

    def _admit_waiting_v1(self, out, budget):
        _admit(self, out, budget, whole_prompt=True)


class _PreemptsTheOldest(V1Round):
    """Takes the victim from the wrong end: the oldest running request not yet served this step."""

    def _run_running_v1(self, out, budget):
        _run(self, out, budget, pick_victim=lambda s, group, todo: todo[0] if todo else group)


class _NewestByHand(V1Round):
    """Always takes the newest by hand instead of asking ``self.choose_victim``: right by default,
    but a victim policy plugged in is never asked."""

    def _run_running_v1(self, out, budget):
        _run(self, out, budget, pick_victim=lambda s, group, todo: todo[-1] if todo else group)


class _GoesOnAfterPreemptingItself(V1Round):
    """After a request preempted itself, goes on with the requests behind it (V1 stops the step)."""

    def _run_running_v1(self, out, budget):
        _run(self, out, budget, stop_after_self=False)


class _NoThreshold(V1Round):
    """Cuts a prompt to the budget left only, forgetting ``long_prefill_token_threshold``."""

    def _run_running_v1(self, out, budget):
        _run(self, out, budget, threshold=False)

    def _admit_waiting_v1(self, out, budget):
        _admit(self, out, budget, threshold=False)


class _HitsNotInWholeBlocks(V1Round):
    """Takes the prefix hit as the block manager counts it (all tokens but the last) without
    cutting it to whole blocks: a prompt cached whole computes its last token, not its last block."""

    def _admit_waiting_v1(self, out, budget):
        _admit(self, out, budget, whole_blocks=False)


class _NoPrefixHits(V1Round):
    """Never asks for prefix-cache hits: every prompt is computed from its first token."""

    def _admit_waiting_v1(self, out, budget):
        _admit(self, out, budget, hits=False)


class _FirstComeFirstServed(V1Round):
    """Stops admission at a prompt that may not be cut and does not fit the budget left (v0.4's
    habit), where V1 skips it and tries the next."""

    def _admit_waiting_v1(self, out, budget):
        _admit(self, out, budget, skip=False)


class _NoRefusals(V1Round):
    """Never refuses a prompt that can never run: it waits at the head of the queue for ever."""

    def _admit_waiting_v1(self, out, budget):
        _admit(self, out, budget, refuse=False)


class _IgnoresCanAdmit(V1Round):
    """Never asks ``self.can_admit``: an admission rule plugged in has no say."""

    def _admit_waiting_v1(self, out, budget):
        _admit(self, out, budget, ask_hook=False)


# -- the chunk rule and first tokens ------------------------------------------------------------------


def _chunk_rule(prompt_len, num_computed, budget_left, threshold, chunked, use_threshold=True, always_cut=False,
                zero_is_cap=False):
    num = prompt_len - num_computed
    if use_threshold and (zero_is_cap or threshold > 0) and threshold < num:
        num = threshold
    if chunked or always_cut:
        num = min(num, budget_left)
    return num


def _admit_first_pieces(waiting, running, first, left, round_no, whole_prompts):
    """v1's admission with ``left`` tokens; returns what is left."""
    while waiting and left > 0:
        if whole_prompts and waiting[0].prompt_len > left:
            break
        r = waiting.pop(0)
        n = min(r.prompt_len, left)
        left -= n
        running.append([r, n, 0, True])
        if n == r.prompt_len:
            running[-1][2], first[r.request_id] = 1, round_no
    return left


def _first_tokens(requests, token_budget, policy, admit_first=False, whole_prompts=False):
    """The solution's rule with v1 slips: newcomers before the running requests (``admit_first``),
    or prompts never chunked (``whole_prompts``)."""
    if policy == "vllm":
        return SOLUTION["first_token_rounds"](requests, token_budget, policy)
    pending = sorted(requests, key=lambda r: r.arrival_round)
    waiting, running, first, round_no = [], [], {}, 0
    while pending or waiting or running:
        round_no += 1
        while pending and pending[0].arrival_round <= round_no:
            waiting.append(pending.pop(0))
        left = token_budget
        if admit_first:
            left = _admit_first_pieces(waiting, running, first, left, round_no, whole_prompts)
        for entry in running:
            if entry[3]:  # admitted this round
                continue
            if left == 0:
                break
            r, done, _, _ = entry
            n = min(r.prompt_len - done, left) if done < r.prompt_len else 1
            left -= n
            if done < r.prompt_len:
                entry[1] += n
                if entry[1] == r.prompt_len:
                    entry[2], first[r.request_id] = 1, round_no
            else:
                entry[2] += 1
        if not admit_first:
            _admit_first_pieces(waiting, running, first, left, round_no, whole_prompts)
        for entry in running:
            entry[3] = False
        running = [e for e in running if e[2] < e[0].output_len]
    return first


MISTAKES = {
    "check_v1_round": [_AdmitsAfterPreempting, _WholePromptAtAdmission, _PreemptsTheOldest, _NewestByHand,
                       _GoesOnAfterPreemptingItself, _NoThreshold, _HitsNotInWholeBlocks, _NoPrefixHits,
                       _FirstComeFirstServed, _NoRefusals, _IgnoresCanAdmit],
    "check_v1_chunk": [
        functools.partial(_chunk_rule, use_threshold=False),  # forgets the threshold
        functools.partial(_chunk_rule, always_cut=True),      # cuts to the budget with chunking off too
        functools.partial(_chunk_rule, zero_is_cap=True),     # reads threshold 0 as a cap of 0 tokens
        lambda p, c, b, t, chunked: min(p, b) if chunked else p,  # forgets the tokens already computed
    ],
    "check_first_token_rounds": [
        functools.partial(_first_tokens, admit_first=True),   # newcomers before the running requests
        functools.partial(_first_tokens, whole_prompts=True),  # v1 without chunked prefill
        lambda reqs, b, p: SOLUTION["first_token_rounds"](reqs, b, "vllm"),  # the same rule for both policies
    ],
}
