"""Iteration-level scheduling: at every step, decide which requests run.

The scheduler owns three queues of SequenceGroups:

- ``waiting``: arrived, not started (or preempted by recompute and sent back to the front);
- ``running``: their K/V is on the GPU, they take part in rounds;
- ``swapped``: preempted by swapping; their K/V sits in CPU swap space.

Three policies fill a round under one ``SchedulingBudget`` (``max_num_seqs`` sequences,
``max_num_batched_tokens`` tokens):

- ``"vllm"`` (vLLM v0.4): a round is either all prefill or all decode. Waiting prompts are
  admitted, first come first served, only while nothing is swapped out; if any was admitted
  the round is a prefill round. Otherwise every running group decodes one token; when the
  cache cannot give a group its next slot, the newest running group is preempted. Swapped
  groups come back when nothing was preempted in the round.
- ``"orca"``: one batch mixes decodes of running groups with prefills of newly arrived ones.
- ``"v1"`` (vLLM V1): one token budget, running groups first, blocks allocated a step at a time,
  preemption by recompute, admission only in a step that preempted nobody (``v1_round.py``).

The Scheduler class is written in parts, one idea to a module: the round itself (here), prefills
split over rounds (``split_prefill.py``), preemption (``preemption.py``), refusing what can never
run (``refusals.py``) and the bookkeeping after the model ran (``postprocess.py``); what a round
decides is in ``scheduler_outputs.py``. Three constructor arguments let a reader's component take
part: ``block_manager``, ``choose_victim`` and ``can_admit`` (see ``Scheduler``).

``SchedulerConfig(compat="vllm-0.4")`` follows vLLM v0.4.0's runtime rules instead of tinyserve's
(``vllm/core/scheduler.py``, ``vllm/core/block_manager_v1.py``; the ``"vllm"`` policy only): the
block manager's rules and stack of free blocks (``V04BlockSpaceManager``), ``running`` and
``swapped`` sorted stably by arrival (swapped-out groups join at the back), the batch
in request-id order, and a group preempted by recompute admitted again whole (dropped if it has
outgrown the limit). Preemption decides as v0.4's ``_preempt`` does under either setting. Even under
compat no request stalls the others (v0.4 waits forever on one that never fits, stops on full swap).

tinyserve relaxes one of v0.4.0's configuration checks: ``max_num_batched_tokens <
max_model_len`` without chunked prefill (the seed preset's budget of 10 tokens takes two of three
prompts in round 1; the prompt limit becomes the smaller of the two). v0.4.0 checks no block size
(its ``--block-size`` offers 8, 16, 32 and 128, and its CUDA kernel takes 8, 16 or 32, so the seed
preset's 5 would fail there, not in the scheduler) and takes block counts given by hand
(``forced_num_gpu_blocks``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from tinyserve import refusals
from tinyserve.block_manager import AllocStatus, BlockSpaceManager, V04BlockSpaceManager
from tinyserve.config import CacheConfig, SchedulerConfig
from tinyserve.postprocess import PostprocessMixin
from tinyserve.preemption import PreemptionMixin, VictimPolicy, preempt_newest
from tinyserve.prefix_cache import PrefixCachingBlockSpaceManager
from tinyserve.refusals import RefusalMixin
from tinyserve.scheduler_outputs import PreemptionMode, ScheduledSequenceGroup, SchedulerOutputs, SchedulingBudget
from tinyserve.sequence import Sequence, SequenceGroup, SequenceGroupMetadata, SequenceStatus
from tinyserve.split_prefill import SplitPrefillMixin
from tinyserve.v1_round import V1RoundMixin

__all__ = ["PreemptionMode", "ScheduledSequenceGroup", "Scheduler", "SchedulerOutputs", "SchedulingBudget",
           "preempt_newest"]

AdmissionRule = Callable[[SequenceGroup, SchedulingBudget, BlockSpaceManager], bool]


class Scheduler(SplitPrefillMixin, V1RoundMixin, PreemptionMixin, RefusalMixin, PostprocessMixin):
    """Decides every round which groups run, keeping the block tables through a BlockSpaceManager.

    Hooks (all optional): ``block_manager`` replaces the one built from ``cache_config``.
    ``choose_victim(running)`` gets the running groups that still wait for their slot this round,
    oldest first, starting with the one that needs a block, and returns the one to preempt
    (itself included). ``can_admit(group, budget, block_manager)`` is asked about the group at
    the head of ``waiting`` after every other check has passed: False keeps it (and everyone
    behind it) waiting, True admits it at once.
    """

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig, *,
                 block_manager: BlockSpaceManager | None = None, choose_victim: VictimPolicy | None = None,
                 can_admit: AdmissionRule | None = None) -> None:
        if cache_config.num_gpu_blocks is None or cache_config.num_cpu_blocks is None:
            raise ValueError("the scheduler needs num_gpu_blocks and num_cpu_blocks set in the CacheConfig")
        if scheduler_config.compat == "vllm-0.4" and cache_config.enable_prefix_caching:
            raise ValueError("compat='vllm-0.4' does not cover enable_prefix_caching: tinyserve's prefix cache "
                             "charges only uncached prompt tokens to a round's budget, v0.4.0 charges all of them")
        for name, hook in (("choose_victim", choose_victim), ("can_admit", can_admit)):
            if hook is not None and not callable(hook):
                raise ValueError(f"{name} must be a function, got {hook!r}")
        if block_manager is None:
            block_manager = make_block_manager(cache_config, scheduler_config.compat)
        elif getattr(block_manager, "block_size", None) != cache_config.block_size:
            raise ValueError(f"block_manager has block_size={getattr(block_manager, 'block_size', None)!r}, "
                             f"but the CacheConfig says {cache_config.block_size}")
        if cache_config.enable_prefix_caching and not hasattr(block_manager, "num_cached_tokens"):
            raise ValueError("enable_prefix_caching needs a block_manager with num_cached_tokens and mark_computed "
                             "(a prefix_cache.PrefixCachingBlockSpaceManager)")
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.block_manager = block_manager
        self.choose_victim = choose_victim or preempt_newest
        self.can_admit = can_admit
        self.waiting: deque[SequenceGroup] = deque()
        self.running: deque[SequenceGroup] = deque()
        self.swapped: deque[SequenceGroup] = deque()

    @property
    def mixes_phases(self) -> bool:
        return self.scheduler_config.policy in ("orca", "v1") or self.scheduler_config.enable_chunked_prefill

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

    # -- the round -------------------------------------------------------------------------

    def schedule(self) -> tuple[list[SequenceGroupMetadata], SchedulerOutputs]:
        out = self._schedule_round()
        # >>> fold: safety net: a round that schedules nobody
        if out.is_empty() and not (out.ignored_seq_groups or out.preempted) and self.has_unfinished_seqs():
            self._resolve_stuck_round(out)
        # <<<
        return [self._metadata(s) for s in out.scheduled_seq_groups], out

    def _schedule_round(self) -> SchedulerOutputs:
        """The round of the configured policy."""
        # >>> chapter 13: the v1 round
        if self.scheduler_config.policy == "v1":
            return self._schedule_v1()
        # <<<
        return self._schedule_mixed() if self.mixes_phases else self._schedule_vllm()

    def _metadata(self, scheduled: ScheduledSequenceGroup) -> SequenceGroupMetadata:
        group, chunk = scheduled.seq_group, scheduled.token_chunk_size
        seqs = group.get_seqs(SequenceStatus.RUNNING)
        return SequenceGroupMetadata(
            request_id=group.request_id,
            is_prompt=scheduled.is_prompt,
            seq_data={s.seq_id: s for s in seqs},
            sampling_params=group.sampling_params,
            block_tables={s.seq_id: self.block_manager.get_block_table(s) for s in seqs},
            token_chunk_size=chunk,
            # A prefill piece that stops short of the last token has nothing to sample yet.
            do_sample=seqs[0].num_computed_tokens + chunk >= seqs[0].get_len(),
        )

    def _new_budget(self) -> SchedulingBudget:
        cfg = self.scheduler_config
        return SchedulingBudget(cfg.max_num_batched_tokens, cfg.max_num_seqs,
                                num_curr_seqs=sum(g.get_max_num_running_seqs() for g in self.running))

    def _schedule_vllm(self) -> SchedulerOutputs:
        out, budget = SchedulerOutputs(), self._new_budget()
        # >>> fold: vLLM v0.4 compat
        if self.scheduler_config.compat == "vllm-0.4":
            self._sort_by_arrival()
        # <<<
        # >>> chapter 05: recompute in pieces
        self._continue_prefills(out, budget)
        # <<<
        if not self.swapped:
            self._admit_waiting(out, budget)
        if out.scheduled_seq_groups or out.ignored_seq_groups:
            return out
        self._decode_running(out, budget)
        if not out.preempted:
            self._swap_in_swapped(out, budget)
        return out

    def _schedule_mixed(self) -> SchedulerOutputs:
        out, budget = SchedulerOutputs(), self._new_budget()
        self._decode_running(out, budget)
        if not out.preempted:
            self._swap_in_swapped(out, budget)
        if not self.swapped:
            self._admit_waiting(out, budget)
        return out

    def _sort_by_arrival(self) -> None:
        """v0.4's FCFS policy re-sorts ``running`` before decoding and ``swapped`` before swapping
        in, in the rounds that reach the decode phase. Sorting both at the start of every round
        decides the same: a stable sort of a sorted queue plus newcomers orders them as one sort of
        the unsorted queue does, and a round that swaps in preempted nobody.
        tinyserve does not sort: its queues keep arrival order unless preemptions mix swap and
        recompute. The sort is stable, as v0.4's: among equal arrival times queue order wins."""
        def key(group: SequenceGroup) -> float:
            return group.arrival_time
        self.running = deque(sorted(self.running, key=key))
        self.swapped = deque(sorted(self.swapped, key=key))

    def _admit_waiting(self, out: SchedulerOutputs, budget: SchedulingBudget) -> None:
        """Move prompts from the front of ``waiting`` into the round, first come first served."""
        cfg = self.scheduler_config
        while self.waiting:
            group = self.waiting[0]
            seq = group.get_seqs(SequenceStatus.WAITING)[0]
            # A prefill that must fit one round is limited by the budget too (cfg.prompt_limit).
            limit = cfg.max_model_len if self._may_split(seq) else cfg.prompt_limit
            reason = refusals.admission_refusal(group, limit, self.block_manager, cfg)
            status = self.block_manager.can_allocate(group) if reason is None else None
            if status == AllocStatus.NEVER:
                reason = refusals.no_room(group, self.block_manager)
            if reason is not None:
                self._ignore(group, out, reason)
                continue
            if status == AllocStatus.LATER:
                break
            # >>> chapter 12: prefix caching
            if self.cache_config.enable_prefix_caching:  # the cached head of the prompt needs no compute
                cached = self._num_cached_tokens(group)
                for s in group.get_seqs(SequenceStatus.WAITING):
                    s.num_computed_tokens = cached
            # <<<
            num_new_tokens = self._num_new_tokens(seq, budget)
            num_new_seqs = group.get_max_num_running_seqs()
            if num_new_tokens <= 0 or not budget.can_schedule(num_new_tokens, num_new_seqs):
                break
            # >>> fold: the can_admit hook
            if self.can_admit is not None and not self.can_admit(group, budget, self.block_manager):
                break
            # <<<
            self.waiting.popleft()
            self.block_manager.allocate(group)
            for s in group.get_seqs(SequenceStatus.WAITING):
                s.status = SequenceStatus.RUNNING
            self.running.append(group)
            budget.add(num_new_seqs=num_new_seqs)
            self._schedule(out, budget, group, num_new_tokens, is_prompt=True)

    def _num_cached_tokens(self, group: SequenceGroup) -> int:
        """Leading prompt tokens of a waiting group that a prefix-cache hit spares computing. A
        request that asks for ``prompt_logprobs`` takes no hit (as vLLM V1's ``get_computed_blocks``):
        a cached position would have no logits."""
        if not self.cache_config.enable_prefix_caching or group.sampling_params.prompt_logprobs is not None:
            return 0
        return self.block_manager.num_cached_tokens(group.get_seqs(SequenceStatus.WAITING)[0])

    def _decode_running(self, out: SchedulerOutputs, budget: SchedulingBudget) -> None:
        """Give every running group its next slot, preempting groups when blocks run out."""
        remaining = deque(self.running)
        kept: deque[SequenceGroup] = deque()
        while remaining:
            group = remaining.popleft()
            # >>> chapter 12: chunked prefill
            seq = group.get_seqs(SequenceStatus.RUNNING)[0]
            if seq.is_prefill():  # a prompt split over rounds gets its next piece instead
                kept.append(group)
                num_new_tokens = self._num_new_tokens(seq, budget)
                if num_new_tokens > 0:
                    self._schedule(out, budget, group, num_new_tokens, is_prompt=True)
                continue
            # <<<
            while not self.block_manager.can_append_slot(group):
                victim = self.choose_victim([group, *remaining])  # by default the newest
                # >>> fold: safety net: a victim that cannot leave
                stand_in = self._stand_in(victim, [group, *remaining], kept)
                if stand_in is not None and stand_in in kept:
                    self._unschedule(stand_in, kept, out, budget)
                    self._preempt(stand_in, out, budget)
                    continue
                victim = stand_in or victim
                # <<<
                if victim is group:
                    self._preempt(group, out, budget)
                    break
                self._take_victim(victim, remaining)
                self._preempt(victim, out, budget)
            else:
                self._append_slots(group, out)
                kept.append(group)
                self._schedule(out, budget, group, 1, is_prompt=False)
        self.running = kept

    def _swap_in_swapped(self, out: SchedulerOutputs, budget: SchedulingBudget) -> None:
        while self.swapped:
            group = self.swapped[0]
            if not self.block_manager.can_swap_in(group):
                break
            n = group.get_max_num_running_seqs()
            if not budget.can_schedule(n, n):  # each sequence brings at least one token
                break
            self.swapped.popleft()
            out.blocks_to_swap_in.update(self.block_manager.swap_in(group))
            for seq in group.get_seqs(SequenceStatus.SWAPPED):
                seq.status = SequenceStatus.RUNNING
            self._append_slots(group, out)
            self.running.append(group)
            budget.add(num_new_seqs=n)
            out.swapped_in.append(group.request_id)
            seq = group.get_seqs(SequenceStatus.RUNNING)[0]
            # >>> chapter 12: chunked prefill
            if seq.is_prefill():  # swapped out halfway through a split prefill: resume it
                self._schedule(out, budget, group, self._num_new_tokens(seq, budget), is_prompt=True)
                continue
            # <<<
            self._schedule(out, budget, group, 1, is_prompt=False)

    def _schedule(self, out: SchedulerOutputs, budget: SchedulingBudget, group: SequenceGroup,
                  num_new_tokens: int, is_prompt: bool) -> None:
        scheduled = ScheduledSequenceGroup(group, num_new_tokens, is_prompt)
        out.scheduled_seq_groups.append(scheduled)
        # >>> fold: vLLM v0.4 compat
        if self.scheduler_config.compat == "vllm-0.4":
            # v0.4's SchedulerOutputs sorts its batch by (LoRA id, request id): without LoRA, by
            # request id as text ("r10" before "r9").
            out.scheduled_seq_groups.sort(key=lambda s: s.seq_group.request_id)
        # <<<
        budget.add(num_new_tokens=scheduled.num_batched_tokens)
        out.num_batched_tokens = budget.num_batched_tokens

    def _append_slots(self, group: SequenceGroup, out: SchedulerOutputs) -> None:
        for seq in group.get_seqs(SequenceStatus.RUNNING):
            cow = self.block_manager.append_slot(seq)
            if cow is not None:
                src, dst = cow
                out.blocks_to_copy.setdefault(src, []).append(dst)


def make_block_manager(cache_config: CacheConfig, compat: str = "tinyserve") -> BlockSpaceManager:
    """The block manager a config asks for: vLLM v0.4's rules, prefix caching, or the plain one.

    It lives here, a layer above the managers, because it picks among ``block_manager``'s classes
    and their extension in ``prefix_cache``, which imports ``block_manager``."""
    if compat == "vllm-0.4":
        cls = V04BlockSpaceManager
    elif cache_config.enable_prefix_caching:
        cls = PrefixCachingBlockSpaceManager
    else:
        cls = BlockSpaceManager
    return cls(cache_config.block_size, cache_config.num_gpu_blocks, cache_config.num_cpu_blocks,
               watermark=cache_config.watermark)
