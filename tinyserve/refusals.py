"""Why the scheduler refuses a request, in words the client can act on.

Every request finishes or is refused; none may stall the others. The scheduler finishes a group
as ignored, with one of these reasons in ``group.error``, when it can never run: at admission
(``admission_refusal``, ``no_room``), when it can no longer be preempted (``cannot_preempt``),
or when a round finds work but can run none of it (``stuck``). ``RefusalMixin`` is the part of
the ``Scheduler`` that finishes such a group.
"""

from __future__ import annotations

from tinyserve.config import SchedulerConfig
from tinyserve.scheduler_outputs import SchedulerOutputs
from tinyserve.sequence import SequenceGroup, SequenceStatus


def admission_refusal(group: SequenceGroup, limit: int, block_manager, config: SchedulerConfig) -> str | None:
    """Why the waiting ``group`` can never be admitted, or None if it may be.

    ``limit`` is the longest prompt this group may bring (see ``Scheduler._admit_waiting``).
    """
    seq = group.get_seqs(SequenceStatus.WAITING)[0]
    num_tokens = seq.get_len()
    if num_tokens > limit:
        return (f"prompt of {num_tokens} tokens is longer than the limit of {limit} tokens "
                f"(max_model_len={config.max_model_len}, max_num_batched_tokens={config.max_num_batched_tokens})")
    if group.get_max_num_running_seqs() > config.max_num_seqs:
        return (f"{_samples(group.sampling_params)} samples are more than max_num_seqs={config.max_num_seqs} "
                "sequences a round may run")
    # A group preempted by recompute was admitted once, and its samples fitted then.
    return None if seq.get_output_len() > 0 else never_fits(group, block_manager, config)


def never_fits(group: SequenceGroup, block_manager, config: SchedulerConfig) -> str | None:
    """Why a new group with several samples can never run, or None if it can.

    A lone sequence only needs its prompt to fit (``can_allocate``): when memory runs out it
    can always be recomputed, and the engine checked that max_model_len fits the cache.
    Several samples cannot be recomputed, only swapped, and a swapped group comes back only
    when all of its blocks fit at once; if they cannot even on an empty GPU, the group
    would wait in ``swapped`` forever and hold back every request behind it.
    """
    n = group.sampling_params.num_samples
    if n == 1:
        return None
    bm = block_manager
    prompt_len = group.get_seqs()[0].get_prompt_len()
    max_len = min(prompt_len + group.sampling_params.max_tokens, config.max_model_len)
    needed = bm.worst_case_num_blocks(prompt_len, n, max_len)
    if needed + bm.watermark_blocks <= bm.num_total_gpu_blocks:
        return None
    return (f"{_samples(group.sampling_params)} samples of up to {max_len} tokens each (a prompt of {prompt_len} "
            "tokens plus "
            f"max_tokens={group.sampling_params.max_tokens}, at most max_model_len={config.max_model_len}) "
            f"may need {needed} KV blocks at once, plus a watermark of {bm.watermark_blocks}, but the "
            f"cache has {bm.num_total_gpu_blocks} blocks of {bm.block_size} tokens; "
            "lower n or max_tokens, or give the cache more blocks")


def _samples(params) -> str:
    """How a refusal names the request's sample count: ``n=4``, or ``best_of=4`` when it is set."""
    return f"n={params.n}" if params.best_of is None else f"best_of={params.best_of}"


def no_room(group: SequenceGroup, block_manager) -> str:
    """``can_allocate`` said NEVER: the prompt is larger than the whole cache less the watermark."""
    num_tokens = group.get_seqs(SequenceStatus.WAITING)[0].get_len()
    return (f"prompt of {num_tokens} tokens needs more KV blocks than the cache has "
            f"({block_manager.num_total_gpu_blocks} blocks of {block_manager.block_size} tokens, less the watermark)")


def cannot_preempt(group: SequenceGroup, block_manager) -> str:
    """The group must leave the GPU, but swap space is full and its sequences cannot be recomputed."""
    return (f"request {group.request_id!r} had to be preempted, but its {len(group.get_unfinished_seqs())} "
            "sequences cannot be recomputed and CPU swap space is full "
            f"({block_manager.get_num_free_cpu_blocks()} of {block_manager.num_total_cpu_blocks} CPU blocks free); "
            "raise num_cpu_blocks (swap space) or num_gpu_blocks")


def stuck(group: SequenceGroup, where: str, block_manager, config: SchedulerConfig) -> str:
    """Nothing else is running, yet the group at the head of ``where`` cannot move."""
    return (f"request {group.request_id!r} can never be scheduled: nothing else is running, yet it cannot "
            f"leave {where} ({block_manager.num_total_gpu_blocks} GPU blocks of {block_manager.block_size} "
            f"tokens, max_num_seqs={config.max_num_seqs})")


class RefusalMixin:
    """The Scheduler's refusals (it uses the scheduler's queues, block_manager and config)."""

    def _ignore(self, group: SequenceGroup, out: SchedulerOutputs, reason: str) -> None:
        """Refuse the group at the front of ``waiting``."""
        self.waiting.popleft()
        self._give_up(group, out, reason)

    def _give_up(self, group: SequenceGroup, out: SchedulerOutputs, reason: str, retryable: bool = False) -> None:
        """Finish a group the scheduler cannot run, as ignored, with the reason in ``group.error``.

        The caller has taken it off its queue. Whatever the group holds is freed; sequences that
        already finished keep their own status, and the others keep the tokens they generated.
        "ignored" (rather than "abort", which is what a client asks for) tells the client that
        the engine refused the request, and ``error`` says why; ``retryable`` that it was for
        lack of memory at the time, not because of the request.
        """
        group.error, group.retryable = reason, retryable
        for seq in group.get_unfinished_seqs():
            seq.status = SequenceStatus.FINISHED_IGNORED
            seq.finish_message = reason
            self.free_seq(seq)
        out.ignored_seq_groups.append(group)

    def _resolve_stuck_round(self, out: SchedulerOutputs) -> None:
        """An idle round with work left: nothing runs, so nothing will ever free memory, and the
        same round would repeat forever. Finish the group at the head of the blocked queue.

        Admission is meant to refuse every such group up front; this is the safety net that
        keeps one request the checks missed from stalling everyone (as a spinning loop would).
        """
        queue = self.swapped if self.swapped else self.waiting
        where = "swap space" if queue is self.swapped else "the waiting queue"
        group = queue.popleft()
        self._give_up(group, out, stuck(group, where, self.block_manager, self.scheduler_config))
