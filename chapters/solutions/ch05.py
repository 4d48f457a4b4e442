"""Solutions to chapter 05's exercises: admission, preemption, a victim policy, a cautious swap-in."""

from tinyserve.block import Device
from tinyserve.block_manager import BlockSpaceManager
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
