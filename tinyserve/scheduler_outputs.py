"""What a scheduling round works with and what it decides: the budget it fills, the groups it
schedules, and the orders it gives the worker.

``SchedulingBudget`` is the one place that knows how much a round may still take (tokens to
compute, sequences to run); the scheduler asks it rather than redoing the arithmetic.
``ScheduledSequenceGroup`` is one entry of the round's batch: a group, how many new tokens each
of its sequences brings, and whether it is prefilling. ``SchedulerOutputs`` gathers them with the
cache operations (swap in, swap out, copy) the worker must run before the model.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from tinyserve.sequence import SequenceGroup, SequenceStatus


class PreemptionMode(enum.Enum):
    """Recompute drops the K/V and prefills again later; swap parks it in CPU memory."""

    SWAP = "swap"
    RECOMPUTE = "recompute"


@dataclass
class SchedulingBudget:
    """What one round may still take: ``token_budget`` tokens to compute, ``max_num_seqs``
    sequences to run.

    ``num_curr_seqs`` counts the sequences of every group in ``running`` (scheduled this round or
    not: a running group holds its place), ``num_batched_tokens`` the tokens scheduled so far.
    """

    token_budget: int
    max_num_seqs: int
    num_batched_tokens: int = 0
    num_curr_seqs: int = 0

    def remaining_token_budget(self) -> int:
        return self.token_budget - self.num_batched_tokens

    def can_schedule(self, num_new_tokens: int, num_new_seqs: int) -> bool:
        return (self.num_batched_tokens + num_new_tokens <= self.token_budget
                and self.num_curr_seqs + num_new_seqs <= self.max_num_seqs)

    def add(self, num_new_tokens: int = 0, num_new_seqs: int = 0) -> None:
        self.num_batched_tokens += num_new_tokens
        self.num_curr_seqs += num_new_seqs

    def subtract_seqs(self, num_seqs: int) -> None:
        """A group left ``running`` (preempted, or given up on)."""
        self.num_curr_seqs -= num_seqs


@dataclass
class ScheduledSequenceGroup:
    """One group in the round's batch. Each of its running sequences brings
    ``token_chunk_size`` new tokens: 1 in a decode, the prompt (or one chunk of it) in a prefill."""

    seq_group: SequenceGroup
    token_chunk_size: int
    is_prompt: bool

    @property
    def num_batched_tokens(self) -> int:
        return self.token_chunk_size * self.seq_group.num_seqs(SequenceStatus.RUNNING)


@dataclass
class SchedulerOutputs:
    """What one round decided, and the cache operations the worker must run before the model."""

    scheduled_seq_groups: list[ScheduledSequenceGroup] = field(default_factory=list)
    num_batched_tokens: int = 0
    blocks_to_swap_in: dict[int, int] = field(default_factory=dict)
    blocks_to_swap_out: dict[int, int] = field(default_factory=dict)
    blocks_to_copy: dict[int, list[int]] = field(default_factory=dict)
    # Groups the scheduler finished itself this round, each with ``group.error`` saying why:
    # refused at admission, or given up on later (see ``Scheduler._give_up``).
    ignored_seq_groups: list[SequenceGroup] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    swapped_out: list[str] = field(default_factory=list)
    swapped_in: list[str] = field(default_factory=list)

    @property
    def request_ids(self) -> list[str]:
        """The batch's request ids, in scheduled order."""
        return [s.seq_group.request_id for s in self.scheduled_seq_groups]

    @property
    def phase(self) -> str:
        """"prefill", "decode", "mixed", or "idle" when nothing was scheduled."""
        if not self.scheduled_seq_groups:
            return "idle"
        prompts = [s.is_prompt for s in self.scheduled_seq_groups]
        if all(prompts):
            return "prefill"
        if not any(prompts):
            return "decode"
        return "mixed"

    def is_empty(self) -> bool:
        return not (self.scheduled_seq_groups or self.blocks_to_swap_in or self.blocks_to_swap_out
                    or self.blocks_to_copy)
