"""Iteration-level scheduling: at every step, decide which requests run.

The scheduler owns three queues of SequenceGroups:

- ``waiting``: arrived, not started (or preempted by recompute and sent back to the front);
- ``running``: their K/V is on the GPU, they take part in rounds;
- ``swapped``: preempted by swapping; their K/V sits in CPU swap space.

Two policies fill a round under the same budgets (``max_num_seqs`` sequences,
``max_num_batched_tokens`` tokens):

- ``"vllm"`` (vLLM v0.4): a round is either all prefill or all decode. Waiting prompts are
  admitted, first come first served, only while nothing is swapped out; if any was admitted
  the round is a prefill round. Otherwise every running group decodes one token; when the
  cache cannot give a group its next slot, the newest running group is preempted. Swapped
  groups come back when nothing was preempted in the round.
- ``"orca"``: one batch mixes decodes of running groups with prefills of newly arrived ones.
  With ``enable_chunked_prefill`` the same mixed round may prefill a long prompt a chunk at a
  time, after the decodes, as vLLM's chunked-prefill scheduler and Sarathi-Serve do.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field

from tinyserve.block import OutOfBlocksError
from tinyserve.block_manager import AllocStatus, BlockSpaceManager
from tinyserve.config import CacheConfig, SchedulerConfig
from tinyserve.sequence import Sequence, SequenceGroup, SequenceGroupMetadata, SequenceStatus


class PreemptionMode(enum.Enum):
    """Recompute drops the K/V and prefills again later; swap parks it in CPU memory."""

    SWAP = "swap"
    RECOMPUTE = "recompute"


@dataclass
class SchedulerOutputs:
    """What one round decided, and the cache operations the worker must run before the model."""

    scheduled_seq_groups: list[SequenceGroup] = field(default_factory=list)
    token_chunk_sizes: list[int] = field(default_factory=list)  # new tokens per sequence, per group
    prompt_flags: list[bool] = field(default_factory=list)  # is each scheduled group prefilling?
    num_batched_tokens: int = 0
    blocks_to_swap_in: dict[int, int] = field(default_factory=dict)
    blocks_to_swap_out: dict[int, int] = field(default_factory=dict)
    blocks_to_copy: dict[int, list[int]] = field(default_factory=dict)
    ignored_seq_groups: list[SequenceGroup] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    swapped_out: list[str] = field(default_factory=list)
    swapped_in: list[str] = field(default_factory=list)

    @property
    def phase(self) -> str:
        """"prefill", "decode", "mixed", or "idle" when nothing was scheduled."""
        if not self.scheduled_seq_groups:
            return "idle"
        if all(self.prompt_flags):
            return "prefill"
        if not any(self.prompt_flags):
            return "decode"
        return "mixed"

    def is_empty(self) -> bool:
        return not (self.scheduled_seq_groups or self.blocks_to_swap_in or self.blocks_to_swap_out
                    or self.blocks_to_copy)


class Scheduler:
    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig) -> None:
        if cache_config.num_gpu_blocks is None or cache_config.num_cpu_blocks is None:
            raise ValueError("the scheduler needs num_gpu_blocks and num_cpu_blocks set in the CacheConfig")
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.block_manager = make_block_manager(cache_config)
        self.waiting: deque[SequenceGroup] = deque()
        self.running: deque[SequenceGroup] = deque()
        self.swapped: deque[SequenceGroup] = deque()

    @property
    def mixes_phases(self) -> bool:
        return self.scheduler_config.policy == "orca" or self.scheduler_config.enable_chunked_prefill

    # -- queue management ------------------------------------------------------------------

    def add_seq_group(self, seq_group: SequenceGroup) -> None:
        self.waiting.append(seq_group)

    def abort_seq_group(self, request_id: str | list[str]) -> None:
        """Finish the request(s) as aborted, from whichever queue holds them, freeing their blocks."""
        ids = {request_id} if isinstance(request_id, str) else set(request_id)
        for queue in (self.waiting, self.running, self.swapped):
            for group in [g for g in queue if g.request_id in ids]:
                queue.remove(group)
                for seq in group.get_unfinished_seqs():
                    seq.status = SequenceStatus.FINISHED_ABORTED
                    self.free_seq(seq)

    def has_unfinished_seqs(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def get_num_unfinished_seq_groups(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.swapped)

    def free_seq(self, seq: Sequence) -> None:
        self.block_manager.free(seq)

    def fork_seq(self, parent: Sequence, child: Sequence) -> None:
        self.block_manager.fork(parent, child)

    def mark_computed(self, seq: Sequence) -> None:
        """Tell the block manager the round's K/V has been written (prefix caching reuses it)."""
        self.block_manager.mark_computed(seq)

    def free_finished_seq_groups(self) -> None:
        self.running = deque(g for g in self.running if not g.is_finished())

    # -- the round -------------------------------------------------------------------------

    def schedule(self) -> tuple[list[SequenceGroupMetadata], SchedulerOutputs]:
        out = self._schedule_mixed() if self.mixes_phases else self._schedule_vllm()
        metadata = []
        for group, chunk, is_prompt in zip(out.scheduled_seq_groups, out.token_chunk_sizes, out.prompt_flags):
            seqs = group.get_seqs(SequenceStatus.RUNNING)
            seq = seqs[0]
            metadata.append(SequenceGroupMetadata(
                request_id=group.request_id,
                is_prompt=is_prompt,
                seq_data={s.seq_id: s for s in seqs},
                sampling_params=group.sampling_params,
                block_tables={s.seq_id: self.block_manager.get_block_table(s) for s in seqs},
                token_chunk_size=chunk,
                # A prefill chunk that stops short of the last token has nothing to sample yet.
                do_sample=seq.num_computed_tokens + chunk >= seq.get_len(),
            ))
        return metadata, out

    def _schedule_vllm(self) -> SchedulerOutputs:
        out = SchedulerOutputs()
        self._continue_prefills(out)
        if not self.swapped:
            self._admit_waiting(out, token_budget=self.scheduler_config.max_num_batched_tokens - out.num_batched_tokens,
                                num_seqs=self._num_running_seqs())
        if out.scheduled_seq_groups or out.ignored_seq_groups:
            return out
        self._decode_running(out)
        if not out.preempted:
            self._swap_in_swapped(out)
        return out

    def _schedule_mixed(self) -> SchedulerOutputs:
        out = SchedulerOutputs()
        self._decode_running(out)
        if not out.preempted:
            self._swap_in_swapped(out)
        if not self.swapped:
            self._admit_waiting(out, token_budget=self.scheduler_config.max_num_batched_tokens - out.num_batched_tokens,
                                num_seqs=self._num_running_seqs())
        return out

    def _continue_prefills(self, out: SchedulerOutputs) -> None:
        """Schedule the next chunk of running groups whose prefill was split over rounds."""
        for group in self.running:
            seq = group.get_seqs(SequenceStatus.RUNNING)[0]
            budget = self.scheduler_config.max_num_batched_tokens - out.num_batched_tokens
            if seq.is_prefill() and budget > 0:
                self._schedule(out, group, min(seq.get_len() - seq.num_computed_tokens, budget), is_prompt=True)

    def _num_running_seqs(self) -> int:
        return sum(g.get_max_num_running_seqs() for g in self.running)

    def _admit_waiting(self, out: SchedulerOutputs, token_budget: int, num_seqs: int) -> None:
        """Move prompts from the front of ``waiting`` into the round, first come first served."""
        cfg = self.scheduler_config
        while self.waiting:
            group = self.waiting[0]
            seq = group.get_seqs(SequenceStatus.WAITING)[0]
            num_tokens = seq.get_len()
            # A group preempted by recompute was accepted once: it must never be dropped, so it
            # may be prefilled again in chunks even when it has outgrown one round's budget.
            resumed = seq.get_output_len() > 0
            limit = cfg.max_model_len if resumed else cfg.prompt_limit
            if num_tokens > limit:
                self._ignore(group, out, f"prompt of {num_tokens} tokens is longer than the limit of "
                                         f"{limit} tokens (max_model_len={cfg.max_model_len}, "
                                         f"max_num_batched_tokens={cfg.max_num_batched_tokens})")
                continue
            status = self.block_manager.can_allocate(group)
            if status == AllocStatus.LATER:
                break
            if status == AllocStatus.NEVER:
                self._ignore(group, out, f"prompt of {num_tokens} tokens needs more KV blocks than the cache "
                                         f"has ({self.block_manager.num_total_gpu_blocks} blocks of "
                                         f"{self.block_manager.block_size} tokens, less the watermark)")
                continue
            # With prefix caching, the cached head of the prompt needs no compute this round.
            computed = max(seq.num_computed_tokens, self.block_manager.num_cached_tokens(seq))
            chunk = num_tokens - computed
            if cfg.enable_chunked_prefill or resumed:
                chunk = min(chunk, token_budget)
            if chunk <= 0 or chunk > token_budget:
                break
            if num_seqs + group.get_max_num_running_seqs() > cfg.max_num_seqs:
                break
            self.waiting.popleft()
            self.block_manager.allocate(group)
            for s in group.get_seqs(SequenceStatus.WAITING):
                s.status = SequenceStatus.RUNNING
                s.num_computed_tokens = computed
            self.running.append(group)
            self._schedule(out, group, chunk, is_prompt=True)
            token_budget -= chunk
            num_seqs += group.get_max_num_running_seqs()

    def _ignore(self, group: SequenceGroup, out: SchedulerOutputs, reason: str) -> None:
        self.waiting.popleft()
        group.error = reason
        for seq in group.get_seqs():
            seq.status = SequenceStatus.FINISHED_IGNORED
            seq.finish_message = reason
        out.ignored_seq_groups.append(group)

    def _decode_running(self, out: SchedulerOutputs) -> None:
        """Give every running group its next slot, preempting the newest groups when blocks run out.

        In a mixed round a group still prefilling (chunked) gets its next chunk instead."""
        cfg = self.scheduler_config
        remaining = deque(self.running)
        kept: deque[SequenceGroup] = deque()
        while remaining:
            group = remaining.popleft()
            seq = group.get_seqs(SequenceStatus.RUNNING)[0]
            if seq.is_prefill():
                # Only in chunked mode does a running group still have prompt left to compute.
                budget = cfg.max_num_batched_tokens - out.num_batched_tokens
                chunk = min(seq.get_len() - seq.num_computed_tokens, budget)
                kept.append(group)
                if chunk > 0:
                    self._schedule(out, group, chunk, is_prompt=True)
                continue
            while not self.block_manager.can_append_slot(group):
                if remaining:
                    victim = remaining.pop()
                    self._preempt(victim, out)
                else:
                    self._preempt(group, out)
                    break
            else:
                self._append_slots(group, out)
                kept.append(group)
                self._schedule(out, group, 1, is_prompt=False)
        self.running = kept

    def _swap_in_swapped(self, out: SchedulerOutputs) -> None:
        num_seqs = self._num_running_seqs()
        while self.swapped:
            group = self.swapped[0]
            if not self.block_manager.can_swap_in(group):
                break
            n = group.get_max_num_running_seqs()
            if num_seqs + n > self.scheduler_config.max_num_seqs:
                break
            if out.num_batched_tokens + n > self.scheduler_config.max_num_batched_tokens:
                break
            self.swapped.popleft()
            out.blocks_to_swap_in.update(self.block_manager.swap_in(group))
            for seq in group.get_seqs(SequenceStatus.SWAPPED):
                seq.status = SequenceStatus.RUNNING
            self._append_slots(group, out)
            self.running.append(group)
            out.swapped_in.append(group.request_id)
            seq = group.get_seqs(SequenceStatus.RUNNING)[0]
            if seq.is_prefill():  # swapped out halfway through a chunked prefill: resume it
                budget = self.scheduler_config.max_num_batched_tokens - out.num_batched_tokens
                self._schedule(out, group, min(seq.get_len() - seq.num_computed_tokens, budget), is_prompt=True)
            else:
                self._schedule(out, group, 1, is_prompt=False)
            num_seqs += n

    def _schedule(self, out: SchedulerOutputs, group: SequenceGroup, chunk: int, is_prompt: bool) -> None:
        out.scheduled_seq_groups.append(group)
        out.token_chunk_sizes.append(chunk)
        out.prompt_flags.append(is_prompt)
        out.num_batched_tokens += chunk * group.num_seqs(SequenceStatus.RUNNING)

    def _append_slots(self, group: SequenceGroup, out: SchedulerOutputs) -> None:
        for seq in group.get_seqs(SequenceStatus.RUNNING):
            cow = self.block_manager.append_slot(seq)
            if cow is not None:
                src, dst = cow
                out.blocks_to_copy.setdefault(src, []).append(dst)

    # -- preemption ------------------------------------------------------------------------

    def _preemption_mode(self, group: SequenceGroup) -> PreemptionMode:
        mode = self.scheduler_config.preemption_mode
        if mode is not None:
            return PreemptionMode(mode)
        # vLLM's rule: a single sequence is cheap to recompute; several sequences sharing blocks
        # would each have to be recomputed, so they are swapped.
        return PreemptionMode.RECOMPUTE if group.get_max_num_running_seqs() == 1 else PreemptionMode.SWAP

    def _preempt(self, group: SequenceGroup, out: SchedulerOutputs) -> None:
        out.preempted.append(group.request_id)
        if self._preemption_mode(group) == PreemptionMode.RECOMPUTE:
            for seq in group.get_seqs(SequenceStatus.RUNNING):
                seq.reset_for_recompute()
                self.block_manager.free(seq)
            self.waiting.appendleft(group)
            return
        if not self.block_manager.can_swap_out(group):
            raise OutOfBlocksError(
                f"cannot preempt request {group.request_id!r} by swapping: CPU swap space is full "
                f"({self.block_manager.get_num_free_cpu_blocks()} free CPU blocks). "
                "Raise num_cpu_blocks or use preemption_mode='recompute'."
            )
        out.blocks_to_swap_out.update(self.block_manager.swap_out(group))
        for seq in group.get_seqs(SequenceStatus.RUNNING):
            seq.status = SequenceStatus.SWAPPED
        # To the front: victims are taken newest first, so this keeps `swapped` oldest first
        # (FCFS when they come back) and `running` in arrival order after they do.
        self.swapped.appendleft(group)
        out.swapped_out.append(group.request_id)


def make_block_manager(cache_config: CacheConfig) -> BlockSpaceManager:
    return BlockSpaceManager(cache_config.block_size, cache_config.num_gpu_blocks, cache_config.num_cpu_blocks,
                             watermark=cache_config.watermark, enable_prefix_caching=cache_config.enable_prefix_caching)
