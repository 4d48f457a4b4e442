"""Solutions to chapter 13's exercises: the chunk a prefill brings, the v1 round, and the rounds
in which first tokens come out under each policy."""

from collections import deque

from tinyserve import refusals
from tinyserve.scheduler import Scheduler as PackageScheduler
from tinyserve.scheduler import SchedulerOutputs
from tinyserve.sequence import SequenceStatus


def v1_chunk(prompt_len, num_computed, budget_left, threshold, chunked):
    # What the prompt still lacks, cut to the threshold (0: no cap), then, when prompts may be
    # chunked, to what the step's budget has left.
    num = prompt_len - num_computed
    if 0 < threshold < num:
        num = threshold
    if chunked:
        num = min(num, budget_left)
    return num


# -- exercise 2: the v1 round --------------------------------------------------------------------

class V1Round(PackageScheduler):
    """The v1 policy's round: one token budget, running requests first, oldest first, each with
    its next token or prompt chunk and the blocks of this step's tokens only, the newest
    preempted (recompute) when they do not fit; then, only in a step that preempted nobody,
    waiting requests in order with the budget left, a prefix hit counted in whole blocks of all
    tokens but the last. Every other part of the Scheduler (the other rounds, _v1_chunk,
    _fits_v1, preemption, refusals, the bookkeeping) is the package's."""

    def _schedule_v1(self):
        out, budget = SchedulerOutputs(), self._new_budget()
        self._run_running_v1(out, budget)
        if not out.preempted:  # blocks ran short this step: a newcomer would only push someone out
            self._swap_in_swapped(out, budget)  # only a group of several samples is ever swapped
            if not self.swapped:
                self._admit_waiting_v1(out, budget)
        return out

    def _run_running_v1(self, out, budget):
        todo, kept = deque(self.running), deque()  # oldest first; kept: the groups that stay
        while todo and budget.remaining_token_budget() > 0:
            group = todo.popleft()
            seq = group.get_seqs(SequenceStatus.RUNNING)[0]
            prefill = seq.is_prefill()
            num_new_tokens = self._v1_chunk(seq, seq.num_computed_tokens, budget) if prefill else 1
            if num_new_tokens * group.num_seqs(SequenceStatus.RUNNING) > budget.remaining_token_budget():
                kept.append(group)  # a piece that may not be cut: it waits for a step with room
                continue
            while not self._fits_v1(group, num_new_tokens):
                victim = self.choose_victim([group, *todo])  # by default the newest
                if victim is group:  # nobody newer is left to make room: it leaves itself
                    self._preempt(group, out, budget)
                    break
                todo.remove(victim)
                self._preempt(victim, out, budget)
            else:  # the loop ended because the blocks are there
                if prefill:
                    self.block_manager.grow(seq, seq.num_computed_tokens + num_new_tokens)
                else:
                    self._append_slots(group, out)
                kept.append(group)
                self._schedule(out, budget, group, num_new_tokens, is_prompt=prefill)
                continue
            break  # the group preempted itself: nobody after it runs this step
        self.running = kept + todo

    def _admit_waiting_v1(self, out, budget):
        cfg, bm = self.scheduler_config, self.block_manager
        skipped = []
        while self.waiting and budget.remaining_token_budget() > 0:
            group = self.waiting[0]
            seq = group.get_seqs(SequenceStatus.WAITING)[0]
            # A prompt that may be cut (chunked prefill, or a threshold within one step's budget)
            # is limited by the model only; any other must fit one step.
            cut = self._may_split(seq) or 0 < cfg.long_prefill_token_threshold <= cfg.max_num_batched_tokens
            reason = refusals.admission_refusal(group, cfg.max_model_len if cut else cfg.prompt_limit, bm, cfg)
            if reason is None and seq.n_blocks > bm.num_total_gpu_blocks:
                reason = refusals.no_room(group, bm)
            if reason is not None:  # it can never run: refuse it, and the next one gets its turn
                self._ignore(group, out, reason)
                continue
            num_new_seqs = group.get_max_num_running_seqs()
            if not budget.can_schedule(0, num_new_seqs):
                break
            cached = self._num_cached_tokens(group)  # never the last token: it must be sampled
            cached -= cached % bm.block_size  # and only whole blocks count
            num_new_tokens = self._v1_chunk(seq, cached, budget)
            if num_new_tokens > budget.remaining_token_budget():  # a prompt that may not be cut
                skipped.append(self.waiting.popleft())  # does not hold up the ones behind it
                continue
            if not bm.can_grow(seq, cached + num_new_tokens, cached):
                break  # blocks for this step's tokens only (the cached head's by name); short of them, stop
            if self.can_admit is not None and not self.can_admit(group, budget, bm):
                break
            self.waiting.popleft()
            bm.grow(seq, cached + num_new_tokens, cached)
            seq.num_computed_tokens, seq.status = cached, SequenceStatus.RUNNING
            self.running.append(group)
            budget.add(num_new_seqs=num_new_seqs)
            self._schedule(out, budget, group, num_new_tokens, is_prompt=True)
        self.waiting.extendleft(reversed(skipped))  # back at the front, in their order


# -- exercise 3: first tokens under each policy -------------------------------------------------------

def first_token_rounds(requests, token_budget, policy):
    # Follow both rounds with counters only: memory never binds, so nobody is preempted.
    pending = sorted(requests, key=lambda r: r.arrival_round)
    waiting, running = [], []  # running: [request, prompt tokens computed, tokens made]
    first, round_no = {}, 0
    while pending or waiting or running:
        round_no += 1
        while pending and pending[0].arrival_round <= round_no:
            waiting.append(pending.pop(0))
        left = token_budget
        if policy == "vllm":
            # Prefill whole prompts, first come first served; only a round without one decodes.
            admitted = []
            while waiting and waiting[0].prompt_len <= left:
                r = waiting.pop(0)
                left -= r.prompt_len
                admitted.append([r, r.prompt_len, 1])
                first[r.request_id] = round_no
            running += admitted
            if not admitted:
                for entry in running:
                    entry[2] += 1
        else:
            # Running requests first, a decode or a piece of prompt each, then newcomers with the rest.
            for entry in running:
                if left == 0:
                    break
                r, done, _ = entry
                n = min(r.prompt_len - done, left) if done < r.prompt_len else 1
                left -= n
                if done < r.prompt_len:
                    entry[1] += n
                    if entry[1] == r.prompt_len:
                        entry[2], first[r.request_id] = 1, round_no
                else:
                    entry[2] += 1
            while waiting and left > 0:
                r = waiting.pop(0)
                n = min(r.prompt_len, left)
                left -= n
                running.append([r, n, 0])
                if n == r.prompt_len:
                    running[-1][2], first[r.request_id] = 1, round_no
        running = [e for e in running if e[2] < e[0].output_len]
    return first
