"""The v1 round (``SchedulerConfig(policy="v1")``): one token budget, running requests first.

vLLM V1 (``vllm/v1/core/sched/scheduler.py``, ``Scheduler.schedule``) has no prefill round and no
decode round. Every request has tokens and computed tokens, and a step lets computed tokens
catch up with tokens under one budget of ``max_num_batched_tokens``:

1. Running requests come first, in queue order, while budget is left. A decode brings one
   token; a prompt brings what it still lacks, cut to ``long_prefill_token_threshold`` (if set)
   and to the budget left. Blocks are allocated for those tokens only (V1's
   ``KVCacheManager.allocate_slots``), not for the whole prompt at admission. When they do not
   fit, the newest running request is preempted by recompute: its blocks are freed, its computed
   tokens reset, and it goes to the front of ``waiting``. If that is the request itself, the
   step stops there.
2. Only in a step that preempted nobody are waiting requests admitted, in order, with the
   budget that is left: prefix-cache hits count as computed, in whole blocks of all tokens but
   the last (whose logits are needed to sample; V1's ``KVCacheManager.get_computed_blocks``), so
   a prompt cached whole computes its last block again; the first chunk is cut like a running
   prompt's, and a request whose blocks do not fit stops admission. There is no watermark and
   no swap.

``V1RoundMixin`` is that part of the ``Scheduler``. What it simplifies, against V1's code:

- V1 runs ``n > 1`` as ``n`` requests (``vllm/v1/engine/parallel_sampling.py``), so every
  request can be recomputed. tinyserve keeps the samples in one group; a group with several live
  sequences cannot be recomputed from one prompt, so it is swapped, and swapped groups come back
  before any admission, as under the other policies.
- V1's ``max_num_seqs`` counts requests (``len(self.running)``); tinyserve counts sequences.
- With chunked prefill off, V1 skips a prompt that does not fit the budget left and tries the
  next; tinyserve does too (first come first served is given up, as in V1). V1 0.9.2 puts
  several skipped requests back in reverse order (each is prepended to the skipped queue, which
  ``FCFSRequestQueue.prepend_requests`` reverses once more); tinyserve keeps their order.
- V1 names a block when it allocates it (``KVCacheManager.allocate_slots``), so a request
  admitted later in the same step already hits a block that step computes; tinyserve's prefix
  cache hits a block only after the step that wrote it (``mark_computed``).
- Evictions: V1's one free queue takes the least recently used block, a freed request's last
  block first (``FreeKVCacheBlockQueue``); tinyserve takes never-cached free blocks first, then
  its LRU evictor's oldest, so different cached prefixes may survive.
- A request that stops on EOS with its last allowed token finishes as "stop" here; V1 checks the
  length first and says "length" (``vllm/v1/core/sched/utils.py``, ``check_stop``).
- No speculative decoding, encoder inputs, structured output, KV connectors, priorities or
  LoRA limits; blocks come from tinyserve's own allocator, whose free order differs from V1's
  free-block queue (``vllm/v1/core/block_pool.py``).
"""

from __future__ import annotations

from collections import deque

from tinyserve import refusals
from tinyserve.scheduler_outputs import SchedulerOutputs, SchedulingBudget
from tinyserve.sequence import Sequence, SequenceGroup, SequenceStatus


class V1RoundMixin:
    """The Scheduler's v1 round (it uses the scheduler's queues, block_manager and config)."""

    def _schedule_v1(self) -> SchedulerOutputs:
        out, budget = SchedulerOutputs(), self._new_budget()
        self._run_running_v1(out, budget)
        if not out.preempted:
            # >>> fold: only a group of several samples is ever swapped under v1
            self._swap_in_swapped(out, budget)
            # <<<
            if not self.swapped:
                self._admit_waiting_v1(out, budget)
        return out

    def _v1_chunk(self, seq: Sequence, computed: int, budget: SchedulingBudget) -> int:
        """Tokens a prefill with ``computed`` tokens done brings this step: what it lacks, cut to
        the threshold and, under chunked prefill, to the budget left."""
        num = seq.get_len() - computed
        threshold = self.scheduler_config.long_prefill_token_threshold
        if 0 < threshold < num:
            num = threshold
        # Without chunked prefill V1 never cuts a prompt to the budget. tinyserve cuts a
        # sequence preempted after it sampled that has outgrown the whole budget (V1 makes the
        # budget hold max_model_len when chunking is off, so there it cannot happen).
        outgrown = seq.get_output_len() > 0 and num > self.scheduler_config.max_num_batched_tokens
        if self.scheduler_config.enable_chunked_prefill or outgrown:
            num = min(num, budget.remaining_token_budget())
        return num

    def _fits_v1(self, group: SequenceGroup, num_new_tokens: int) -> bool:
        """Whether the group's blocks for this step's tokens can be had now."""
        seq = group.get_seqs(SequenceStatus.RUNNING)[0]
        if seq.is_prefill():
            return self.block_manager.can_grow(seq, seq.num_computed_tokens + num_new_tokens)
        return self.block_manager.can_append_slot(group)

    def _run_running_v1(self, out: SchedulerOutputs, budget: SchedulingBudget) -> None:
        """Give running groups their tokens, oldest first, preempting the newest when blocks run out."""
        remaining = deque(self.running)
        kept: deque[SequenceGroup] = deque()
        while remaining and budget.remaining_token_budget() > 0:
            group = remaining.popleft()
            seq = group.get_seqs(SequenceStatus.RUNNING)[0]
            prefill = seq.is_prefill()
            num_new_tokens = self._v1_chunk(seq, seq.num_computed_tokens, budget) if prefill else 1
            if num_new_tokens * group.num_seqs(SequenceStatus.RUNNING) > budget.remaining_token_budget():
                kept.append(group)  # not chunked, or several samples: it waits for a step with room
                continue
            while not self._fits_v1(group, num_new_tokens):
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
                if prefill:
                    self.block_manager.grow(seq, seq.num_computed_tokens + num_new_tokens)
                else:
                    self._append_slots(group, out)
                kept.append(group)
                self._schedule(out, budget, group, num_new_tokens, is_prompt=prefill)
                continue
            break  # the group preempted itself: V1 schedules nobody after it
        self.running = kept + remaining

    def _admit_waiting_v1(self, out: SchedulerOutputs, budget: SchedulingBudget) -> None:
        """Admit waiting groups in order with the budget left, a first chunk each."""
        cfg, bm = self.scheduler_config, self.block_manager
        skipped: list[SequenceGroup] = []
        while self.waiting and budget.remaining_token_budget() > 0:
            group = self.waiting[0]
            seq = group.get_seqs(SequenceStatus.WAITING)[0]
            # >>> fold: refusals: too long, too many samples, more blocks than the cache has
            # Without chunked prefill a prompt must fit one step, unless the threshold cuts it.
            cut = self._may_split(seq) or 0 < cfg.long_prefill_token_threshold <= cfg.max_num_batched_tokens
            reason = refusals.admission_refusal(group, cfg.max_model_len if cut else cfg.prompt_limit, bm, cfg)
            if reason is None and seq.n_blocks > bm.num_total_gpu_blocks:
                reason = refusals.no_room(group, bm)
            if reason is not None:
                self._ignore(group, out, reason)
                continue
            # <<<
            num_new_seqs = group.get_max_num_running_seqs()
            if not budget.can_schedule(0, num_new_seqs):
                break
            cached = self._num_cached_tokens(group)
            cached -= cached % bm.block_size  # V1 hits whole blocks of all but the last token
            num_new_tokens = self._v1_chunk(seq, cached, budget)
            if num_new_tokens > budget.remaining_token_budget():  # chunked prefill off: try the next one
                skipped.append(self.waiting.popleft())
                continue
            if not bm.can_grow(seq, cached + num_new_tokens, cached):
                break
            # >>> fold: the can_admit hook
            if self.can_admit is not None and not self.can_admit(group, budget, bm):
                break
            # <<<
            self.waiting.popleft()
            bm.grow(seq, cached + num_new_tokens, cached)
            seq.num_computed_tokens, seq.status = cached, SequenceStatus.RUNNING
            self.running.append(group)
            budget.add(num_new_seqs=num_new_seqs)
            self._schedule(out, budget, group, num_new_tokens, is_prompt=True)
        self.waiting.extendleft(reversed(skipped))
