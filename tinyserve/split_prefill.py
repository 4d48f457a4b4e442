"""Prefills split over rounds: how many new tokens a sequence brings to a round.

Usually a prompt is prefilled in one round. Two paths cut it into pieces that fit what the
round's token budget has left. Under chunked prefill (chapter 12) every prompt may be cut. And a
sequence preempted by recompute comes back as a prompt of all its tokens, which may have
outgrown one round's budget; it was accepted once, so tinyserve prefills it again in pieces
rather than drop it (chapter 05; vLLM v0.4 drops it).

``SplitPrefillMixin`` is the part of the ``Scheduler`` that counts the pieces.
"""

from __future__ import annotations

from tinyserve.scheduler_outputs import SchedulerOutputs, SchedulingBudget
from tinyserve.sequence import Sequence, SequenceStatus


class SplitPrefillMixin:
    """The Scheduler's rule for the size of a prefill (it uses the scheduler's config and queues)."""

    def _may_split(self, seq: Sequence) -> bool:
        """Whether this prefill may be cut to what the token budget has left.

        Under chunked prefill (chapter 12) every prompt may. Otherwise only a sequence preempted
        by recompute: it comes back as a prompt of all its tokens, which may have outgrown one
        round's budget, and it was accepted once, so it must not be dropped. This is the
        recompute-after-chunk path: the sequence is prefilled again in pieces, each advancing
        ``num_computed_tokens``; a piece short of the last token samples nothing
        (``do_sample`` is False) and appends no token, so the sequence stays a prefill in
        ``running`` and gets its next piece first thing next round (``_continue_prefills``, or
        ``_decode_running`` in a mixed round). Preempted between two pieces it starts over
        (recompute) or resumes where it stopped (swap). vLLM v0.4 drops such a sequence instead.
        """
        resumed = seq.get_output_len() > 0
        return self.scheduler_config.enable_chunked_prefill or (resumed and self.scheduler_config.compat != "vllm-0.4")

    def _num_new_tokens(self, seq: Sequence, budget: SchedulingBudget) -> int:
        """Tokens ``seq`` brings this round: all it lacks K/V for, cut to the budget's remainder
        when its prefill may be split (``_may_split``)."""
        num = seq.get_len() - seq.num_computed_tokens
        return min(num, budget.remaining_token_budget()) if self._may_split(seq) else num

    def _continue_prefills(self, out: SchedulerOutputs, budget: SchedulingBudget) -> None:
        """Schedule the next piece of running groups whose prefill was split over rounds."""
        for group in self.running:
            seq = group.get_seqs(SequenceStatus.RUNNING)[0]
            if seq.is_prefill() and budget.remaining_token_budget() > 0:
                self._schedule(out, budget, group, self._num_new_tokens(seq, budget), is_prompt=True)
