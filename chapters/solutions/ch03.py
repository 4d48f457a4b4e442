"""Solutions to chapter 03's exercises: copy-on-write counted, and v0.4's can_append_slot."""

from tinyserve.block_manager import BlockSpaceManager
from tinyserve.sequence import SequenceStatus


def group_blocks(prompt_len, n, num_tokens, block_size):
    if num_tokens == 0:
        return -(-prompt_len // block_size)          # every sample still shares the prompt's blocks
    shared = prompt_len // block_size                # full prompt blocks are never written again
    own = -(-(prompt_len + num_tokens) // block_size) - shared
    return shared + n * own                          # the partial last block was copied per sample


class ConservativeManager(BlockSpaceManager):
    def can_append_slot(self, seq_group):
        # v0.4's heuristic: a block for every running sequence, whether it needs one or not.
        return seq_group.num_seqs(SequenceStatus.RUNNING) <= self.get_num_free_gpu_blocks()
