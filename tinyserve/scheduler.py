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

Every request finishes or is refused; none may stall the others. A request that can never run
(a prompt over the limit, more samples than ``max_num_seqs``, samples that cannot all fit in the
cache at once) is finished as ignored at admission, with ``group.error`` saying why. A group that
can no longer be preempted (CPU swap space full and several sequences, which recompute cannot
rebuild) is finished the same way, keeping the tokens it has. And should a round ever find work
but be unable to run any of it, the stuck group is finished rather than waited for forever.

``SchedulerConfig(compat="vllm-0.4")`` follows vLLM v0.4.0's runtime rules instead of tinyserve's
(``vllm/core/scheduler.py`` and ``vllm/core/block_manager_v1.py``; the ``"vllm"`` policy only):

- ``can_append_slot`` wants one free block per running sequence of the group, needed or not;
- the watermark has no exemptions (an empty GPU, a sequence preempted by recompute);
- the free blocks are a stack: the block freed last is allocated first;
  (these three are ``V04BlockSpaceManager``)
- ``running`` and ``swapped`` are sorted by arrival every round (v0.4's FCFS ``sort_by_priority``);
- preemption as v0.4's ``_preempt`` decides: recompute a group of one sequence, swap a group of
  several. An explicit ``preemption_mode`` may still choose swap for one sequence (a path v0.4's
  code has), but never recompute for several, which ``_preempt_by_recompute`` asserts against;
- a group preempted by recompute is admitted again like a new prompt, whole, under the same
  limit; one that has outgrown the limit is dropped (ignored, keeping its tokens).

Under compat tinyserve still keeps every request from stalling the others, where v0.4 would not:
the refusals at admission and the stuck-round safety net above (v0.4 waits forever), and a full
CPU swap space (v0.4's ``_swap_out`` raises RuntimeError and the engine stops). Prefix caching is
refused under compat: tinyserve charges a round's budget only for prompt tokens it must compute,
v0.4.0 for all of them, and its cached allocator keeps another order.

v0.4.0's configuration checks that tinyserve relaxes, under either setting:

- ``max_num_batched_tokens < max_model_len`` without chunked prefill (v0.4's
  ``SchedulerConfig._verify_args`` raises ValueError, so one round can prefill the longest
  sequence). The seed preset needs it: a budget of 10 tokens with ``max_model_len=20`` takes two
  of the three prompts in round 1, as the story tells. The price: the prompt limit becomes
  ``min(max_model_len, max_num_batched_tokens)``, and a sequence preempted by recompute may
  outgrow the budget. v0.4's admission drops it as too long, and so does compat; tinyserve's own
  rules prefill it again in chunks instead.
- ``block_size`` other than 8, 16 or 32 (v0.4's ``--block-size`` choices, and all that its CUDA
  paged-attention kernel dispatches). tinyserve's kernels take any size; the seed preset uses 5, so
  that a 5-token prompt fills exactly one block.
- Block counts given by hand. v0.4.0 profiles the GPU (``num_gpu_blocks_override`` is for testing preemption)
  and derives the CPU blocks from ``swap_space`` in GiB; the book's caches of a few blocks make a
  preemption happen within three rounds.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field

from tinyserve.block_manager import AllocStatus, BlockSpaceManager, V04BlockSpaceManager
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
    # Groups the scheduler finished itself this round, each with ``group.error`` saying why:
    # refused at admission, or given up on later (see ``Scheduler._give_up``).
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
        if scheduler_config.compat == "vllm-0.4" and cache_config.enable_prefix_caching:
            raise ValueError("compat='vllm-0.4' does not cover enable_prefix_caching: tinyserve's prefix cache "
                             "charges only uncached prompt tokens to a round's budget, v0.4.0 charges all of them")
        self.block_manager = make_block_manager(cache_config, scheduler_config.compat)
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
        if out.is_empty() and not (out.ignored_seq_groups or out.preempted) and self.has_unfinished_seqs():
            self._resolve_stuck_round(out)
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
        if self.scheduler_config.compat == "vllm-0.4":
            self._sort_by_arrival()
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

    def _sort_by_arrival(self) -> None:
        """v0.4's FCFS policy re-sorts ``running`` before decoding and ``swapped`` before swapping
        in, every round. Sorting both first is the same: a round that swaps in has preempted
        nobody, so ``swapped`` has not changed. (tinyserve does not sort. Its queues keep arrival
        order as long as preemptions all swap or all recompute; when they mix, say a group of
        several samples swapped and a single one recomputed, the recomputed one comes back
        behind newer groups.) v0.4's ``time.time()`` stamps never tie, the simulator's round
        numbers do; the first sequence id breaks ties by the order the requests came in."""
        def key(group: SequenceGroup) -> tuple[float, int]:
            return group.arrival_time, group.get_seqs()[0].seq_id
        self.running = deque(sorted(self.running, key=key))
        self.swapped = deque(sorted(self.swapped, key=key))

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
            # (vLLM v0.4 admits it like a new prompt, and drops it if it has outgrown the limit.)
            resumed = seq.get_output_len() > 0
            rechunk = resumed and cfg.compat != "vllm-0.4"
            limit = cfg.max_model_len if rechunk else cfg.prompt_limit
            if num_tokens > limit:
                self._ignore(group, out, f"prompt of {num_tokens} tokens is longer than the limit of "
                                         f"{limit} tokens (max_model_len={cfg.max_model_len}, "
                                         f"max_num_batched_tokens={cfg.max_num_batched_tokens})")
                continue
            if group.get_max_num_running_seqs() > cfg.max_num_seqs:
                self._ignore(group, out, f"n={group.sampling_params.n} samples are more than max_num_seqs="
                                         f"{cfg.max_num_seqs} sequences a round may run")
                continue
            reason = None if resumed else self._never_fits(group)
            if reason is not None:
                self._ignore(group, out, reason)
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
            if cfg.enable_chunked_prefill or rechunk:
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

    def _never_fits(self, group: SequenceGroup) -> str | None:
        """Why a new group with several samples can never run, or None if it can.

        A lone sequence only needs its prompt to fit (``can_allocate``): when memory runs out it
        can always be recomputed, and the engine checked that max_model_len fits the cache.
        Several samples cannot be recomputed, only swapped, and a swapped group comes back only
        when all of its blocks fit at once; if they cannot even on an empty GPU, the group
        would wait in ``swapped`` forever and hold back every request behind it.
        """
        n = group.sampling_params.n
        if n == 1:
            return None
        bm, cfg = self.block_manager, self.scheduler_config
        prompt_len = group.get_seqs()[0].get_prompt_len()
        max_len = min(prompt_len + group.sampling_params.max_tokens, cfg.max_model_len)
        needed = bm.worst_case_num_blocks(prompt_len, n, max_len)
        if needed + bm.watermark_blocks <= bm.num_total_gpu_blocks:
            return None
        return (f"n={n} samples of up to {max_len} tokens each (a prompt of {prompt_len} tokens plus "
                f"max_tokens={group.sampling_params.max_tokens}, at most max_model_len={cfg.max_model_len}) "
                f"may need {needed} KV blocks at once, plus a watermark of {bm.watermark_blocks}, but the "
                f"cache has {bm.num_total_gpu_blocks} blocks of {bm.block_size} tokens; "
                "lower n or max_tokens, or give the cache more blocks")

    def _ignore(self, group: SequenceGroup, out: SchedulerOutputs, reason: str) -> None:
        """Refuse the group at the front of ``waiting``."""
        self.waiting.popleft()
        self._give_up(group, out, reason)

    def _give_up(self, group: SequenceGroup, out: SchedulerOutputs, reason: str) -> None:
        """Finish a group the scheduler cannot run, as ignored, with the reason in ``group.error``.

        The caller has taken it off its queue. Whatever the group holds is freed; sequences that
        already finished keep their own status, and the others keep the tokens they generated.
        "ignored" (rather than "abort", which is what a client asks for) tells the client that
        the engine refused the request, and ``error`` says why.
        """
        group.error = reason
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
        group = queue.popleft()
        where = "swap space" if queue is self.swapped else "the waiting queue"
        self._give_up(group, out, f"request {group.request_id!r} can never be scheduled: nothing else is "
                                  f"running, yet it cannot leave {where} ({self.block_manager.num_total_gpu_blocks} "
                                  f"GPU blocks of {self.block_manager.block_size} tokens, "
                                  f"max_num_seqs={self.scheduler_config.max_num_seqs})")

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
    def _recomputable(group: SequenceGroup) -> bool:
        """One live sequence: its tokens alone rebuild its K/V in a prefill. (A group whose
        prompt is still being prefilled in chunks has one sequence too, whatever its n.)"""
        return len(group.get_unfinished_seqs()) == 1

    def _preempt(self, group: SequenceGroup, out: SchedulerOutputs) -> None:
        mode = self._preemption_mode(group)
        if mode == PreemptionMode.SWAP and not self.block_manager.can_swap_out(group):
            # CPU swap space is full (or there is none). That must not fail every request in
            # flight: recompute the group if it can be, otherwise give up on this group alone.
            if not self._recomputable(group):
                self._give_up(group, out, f"request {group.request_id!r} had to be preempted, but its "
                                          f"{len(group.get_unfinished_seqs())} sequences cannot be recomputed "
                                          "and CPU swap space is full "
                                          f"({self.block_manager.get_num_free_cpu_blocks()} of "
                                          f"{self.block_manager.num_total_cpu_blocks} CPU blocks free); "
                                          "raise num_cpu_blocks (swap space) or num_gpu_blocks")
                return
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
        # To the front: victims are taken newest first, so this keeps `swapped` oldest first
        # (FCFS when they come back) and `running` in arrival order after they do.
        self.swapped.appendleft(group)
        out.swapped_out.append(group.request_id)


def make_block_manager(cache_config: CacheConfig, compat: str = "tinyserve") -> BlockSpaceManager:
    cls = V04BlockSpaceManager if compat == "vllm-0.4" else BlockSpaceManager
    return cls(cache_config.block_size, cache_config.num_gpu_blocks, cache_config.num_cpu_blocks,
               watermark=cache_config.watermark, enable_prefix_caching=cache_config.enable_prefix_caching)
