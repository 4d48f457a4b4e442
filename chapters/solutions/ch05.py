"""Solutions to chapter 05's exercises: admission, preemption, the vLLM round, a victim policy, a
cautious swap-in."""

from collections import deque

from tinyserve import refusals
from tinyserve.block import Device
from tinyserve.block_manager import AllocStatus, BlockSpaceManager
from tinyserve.scheduler import Scheduler as PackageScheduler
from tinyserve.scheduler import SchedulerOutputs
from tinyserve.sequence import SequenceStatus


def admission(waiting, token_budget, max_num_seqs, num_free_blocks, block_size):
    # Walk the queue from the front. A prompt that can never run is ignored and the walk goes
    # on (section 5.6); the first one that only has to wait stops it (first come, first served).
    admitted, budget_left, free_left = [], token_budget, num_free_blocks
    for rid, prompt_len in waiting:
        blocks = -(-prompt_len // block_size)
        if prompt_len > token_budget or blocks > num_free_blocks:
            continue  # longer than any round, or more blocks than the whole cache: ignored
        if prompt_len > budget_left or len(admitted) == max_num_seqs or blocks > free_left:
            break
        admitted.append(rid)
        budget_left -= prompt_len
        free_left -= blocks
    return admitted


def preempted(running, needs_block, num_free_blocks):
    # Serve the oldest first; take blocks from the newest not yet served.
    queue, victims = list(running), []
    while queue:
        rid = queue.pop(0)
        if not needs_block[rid]:
            continue
        while num_free_blocks == 0 and queue:
            victims.append(queue.pop())
            num_free_blocks += 1
        if num_free_blocks == 0:
            victims.append(rid)  # nobody newer is left: it gives way itself
        else:
            num_free_blocks -= 1
    return victims


# -- exercise 3: the vLLM round ---------------------------------------------------------------------

class VllmRound(PackageScheduler):
    """The vLLM policy's round: all prefill or all decode. A refill cut into pieces goes on
    first; waiting prompts are admitted, first come first served, only while nothing is swapped
    out, and a round that admitted or refused one is a prefill round; otherwise running groups
    decode, oldest first, the newest preempted when a slot does not fit, and swapped groups come
    back only in a round that preempted nobody. Every other part of the Scheduler is the
    package's."""

    def _schedule_vllm(self):
        out, budget = SchedulerOutputs(), self._new_budget()
        self._continue_prefills(out, budget)  # a refill cut into pieces (5.3) goes on first
        if not self.swapped:  # swapped groups were admitted before: they come back first
            self._admit_waiting(out, budget)
        if out.scheduled_seq_groups or out.ignored_seq_groups:
            return out  # a prefill round: vLLM never mixes it with decodes
        self._decode_running(out, budget)
        if not out.preempted:  # memory was short this round: bringing a group back would thrash
            self._swap_in_swapped(out, budget)
        return out

    def _admit_waiting(self, out, budget):
        cfg = self.scheduler_config
        while self.waiting:
            group = self.waiting[0]
            seq = group.get_seqs(SequenceStatus.WAITING)[0]
            # A refill after recompute may be cut into pieces; any other prompt must fit one round.
            limit = cfg.max_model_len if self._may_split(seq) else cfg.prompt_limit
            reason = refusals.admission_refusal(group, limit, self.block_manager, cfg)
            status = self.block_manager.can_allocate(group) if reason is None else None
            if status == AllocStatus.NEVER:
                reason = refusals.no_room(group, self.block_manager)
            if reason is not None:
                self._ignore(group, out, reason)  # it can never run: out, and the next one's turn
                continue
            num_new_tokens = self._num_new_tokens(seq, budget)
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

    def _decode_running(self, out, budget):
        todo, kept = deque(self.running), deque()  # oldest first; kept: those that stay
        while todo:
            group = todo.popleft()
            seq = group.get_seqs(SequenceStatus.RUNNING)[0]
            if seq.is_prefill():  # a prompt prefilled in pieces (a mixed round): its next piece
                kept.append(group)
                num_new_tokens = self._num_new_tokens(seq, budget)
                if num_new_tokens > 0:
                    self._schedule(out, budget, group, num_new_tokens, is_prompt=True)
                continue
            while not self.block_manager.can_append_slot(group):
                victim = self.choose_victim([group, *todo])  # by default the newest
                if victim is group:  # nobody newer is left: it gives way itself
                    self._preempt(group, out, budget)
                    break
                todo.remove(victim)
                self._preempt(victim, out, budget)
            else:  # the slot is there
                self._append_slots(group, out)
                kept.append(group)
                self._schedule(out, budget, group, 1, is_prompt=False)
        self.running = kept

    def _swap_in_swapped(self, out, budget):
        while self.swapped:
            group = self.swapped[0]  # oldest first, and nobody overtakes it
            n = group.get_max_num_running_seqs()
            if not self.block_manager.can_swap_in(group) or not budget.can_schedule(n, n):
                break
            self.swapped.popleft()
            out.blocks_to_swap_in.update(self.block_manager.swap_in(group))
            for seq in group.get_seqs(SequenceStatus.SWAPPED):
                seq.status = SequenceStatus.RUNNING
            self._append_slots(group, out)  # the slot for the token it adds now
            self.running.append(group)
            budget.add(num_new_seqs=n)
            out.swapped_in.append(group.request_id)
            seq = group.get_seqs(SequenceStatus.RUNNING)[0]
            if seq.is_prefill():  # swapped out between two pieces of a prefill: the rest of it
                self._schedule(out, budget, group, self._num_new_tokens(seq, budget), is_prompt=True)
            else:
                self._schedule(out, budget, group, 1, is_prompt=False)


def most_tokens_victim(running):
    def tokens(group):
        return sum(seq.get_len() for seq in group.get_seqs(SequenceStatus.RUNNING))
    # max() keeps the first of equals; scanning from the newest end makes that the newest.
    return max(reversed(running), key=tokens)


class CautiousSwapManager(BlockSpaceManager):
    def can_swap_in(self, seq_group):
        swapped = seq_group.get_seqs(SequenceStatus.SWAPPED)
        blocks = {id(block) for seq in swapped for block in self.block_tables[seq.seq_id]}  # shared ones once
        on_gpu = sum(1 for seq_id in self.block_tables if self.block_tables[seq_id][0].device == Device.GPU)
        needed = len(blocks) + len(swapped) + on_gpu
        return self.get_num_free_gpu_blocks() - needed >= self._reserve()
