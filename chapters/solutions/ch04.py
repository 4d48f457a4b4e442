"""Solutions to chapter 04's exercises: Orca's rounds, both policies, Orca's reservation, and the
main one, the Orca round itself."""

from collections import deque

from tinyserve import refusals
from tinyserve.block_manager import AllocStatus
from tinyserve.scheduler import Scheduler as PackageScheduler
from tinyserve.scheduler import SchedulerOutputs
from tinyserve.sequence import SequenceStatus


def orca_batches(requests):
    # A request is in the batch from its arrival round until it has all its tokens.
    left = {r.request_id: r.output_len for r in requests}
    sizes = []
    while any(left.values()):
        now = len(sizes) + 1
        batch = [r.request_id for r in requests if r.arrival_round <= now and left[r.request_id] > 0]
        for rid in batch:
            left[rid] -= 1
        sizes.append(len(batch))
    return sizes


def finish_rounds(requests, policy):
    # Each round, decide who runs, then give each of them one token.
    left = {r.request_id: r.output_len for r in requests}
    started, done, now = [], {}, 0
    while len(done) < len(requests):
        now += 1
        new = [r.request_id for r in requests if r.arrival_round <= now and r.request_id not in started]
        if policy == "vllm" and new:
            batch = new                       # a prefill-only round
        else:
            batch = [rid for rid in started if rid not in done] + new
        for rid in batch:
            if rid not in started:
                started.append(rid)
            left[rid] -= 1
            if left[rid] == 0:
                done[rid] = now
    return done


class OrcaReservation:
    """Admit a request only if its prompt and all of its max_tokens fit beside the reservations
    of the admitted requests that have not finished."""

    def __init__(self):
        self.reserved = {}  # request id -> (group, blocks reserved for it)

    def __call__(self, group, budget, block_manager):
        bs = block_manager.block_size
        need = -(-(group.get_seqs()[0].get_prompt_len() + group.sampling_params.max_tokens) // bs)
        held = sum(blocks for rid, (g, blocks) in self.reserved.items()
                   if rid != group.request_id and not g.is_finished())
        if held + need > block_manager.num_total_gpu_blocks:
            return False
        self.reserved[group.request_id] = (group, need)
        return True


# -- the main exercise: the Orca round ------------------------------------------------------------

class OrcaRound(PackageScheduler):
    """The orca policy's round: decodes and prefills in one batch. Running groups first, oldest
    first, each with its next token (or its next refill piece), the newest preempted when a slot
    does not fit; swapped groups back only in a round that preempted nobody; then waiting
    prompts, first come first served, only while nothing is swapped out. Every other part of the
    Scheduler (the vLLM round, preemption, refusals, the bookkeeping) is the package's."""

    def _schedule_mixed(self):
        out, budget = SchedulerOutputs(), self._new_budget()
        self._orca_decode(out, budget)
        if not out.preempted:  # memory ran short this round: bringing a group back would thrash
            self._orca_swap_in(out, budget)
        if not self.swapped:  # groups admitted before come back before anyone new starts
            self._orca_admit(out, budget)
        return out

    def _orca_decode(self, out, budget):
        todo, kept = deque(self.running), deque()  # oldest first; kept: the groups that stay
        while todo:
            group = todo.popleft()
            seq = group.get_seqs(SequenceStatus.RUNNING)[0]
            if seq.is_prefill():  # a refill cut short last round: its next piece, not a decode
                kept.append(group)
                num_new_tokens = self._num_new_tokens(seq, budget)
                if num_new_tokens > 0:
                    self._schedule(out, budget, group, num_new_tokens, is_prompt=True)
                continue
            while not self.block_manager.can_append_slot(group):
                victim = self.choose_victim([group, *todo])  # by default the newest
                if victim is group:  # nobody newer is left to make room: it leaves itself
                    self._preempt(group, out, budget)
                    break
                todo.remove(victim)
                self._preempt(victim, out, budget)
            else:  # the loop ended because the slot is there
                self._append_slots(group, out)
                kept.append(group)
                self._schedule(out, budget, group, 1, is_prompt=False)
        self.running = kept

    def _orca_swap_in(self, out, budget):
        while self.swapped:
            group = self.swapped[0]  # oldest first, and nobody overtakes it
            n = group.get_max_num_running_seqs()
            if not self.block_manager.can_swap_in(group) or not budget.can_schedule(n, n):
                break
            self.swapped.popleft()
            out.blocks_to_swap_in.update(self.block_manager.swap_in(group))
            for seq in group.get_seqs(SequenceStatus.SWAPPED):
                seq.status = SequenceStatus.RUNNING
            self._append_slots(group, out)  # the slot of the token it decodes this round
            self.running.append(group)
            budget.add(num_new_seqs=n)
            out.swapped_in.append(group.request_id)
            seq = group.get_seqs(SequenceStatus.RUNNING)[0]
            if seq.is_prefill():  # it left halfway through a refill: the next piece
                self._schedule(out, budget, group, self._num_new_tokens(seq, budget), is_prompt=True)
            else:
                self._schedule(out, budget, group, 1, is_prompt=False)

    def _orca_admit(self, out, budget):
        cfg = self.scheduler_config
        while self.waiting:
            group = self.waiting[0]
            seq = group.get_seqs(SequenceStatus.WAITING)[0]
            # A refill after recompute may be cut into pieces; a new prompt must fit one round.
            limit = cfg.max_model_len if self._may_split(seq) else cfg.prompt_limit
            reason = refusals.admission_refusal(group, limit, self.block_manager, cfg)
            status = self.block_manager.can_allocate(group) if reason is None else None
            if status == AllocStatus.NEVER:
                reason = refusals.no_room(group, self.block_manager)
            if reason is not None:  # it can never run: refuse it, and the next one gets its turn
                self._ignore(group, out, reason)
                continue
            num_new_tokens = self._num_new_tokens(seq, budget)  # what the decodes left, if it may split
            num_new_seqs = group.get_max_num_running_seqs()
            if (status == AllocStatus.LATER or num_new_tokens <= 0
                    or not budget.can_schedule(num_new_tokens, num_new_seqs)):
                break  # first come, first served: nobody overtakes the head of the queue
            if self.can_admit is not None and not self.can_admit(group, budget, self.block_manager):
                break
            self.waiting.popleft()
            self.block_manager.allocate(group)
            for s in group.get_seqs(SequenceStatus.WAITING):
                s.status = SequenceStatus.RUNNING
            self.running.append(group)
            budget.add(num_new_seqs=num_new_seqs)
            self._schedule(out, budget, group, num_new_tokens, is_prompt=True)
