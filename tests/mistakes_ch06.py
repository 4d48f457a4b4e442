"""Wrong answers for chapter 06's core exercise, the reader's CacheEngine (``check_cache_engine``);
merged into ``MISTAKES`` by tests/exercise_mistakes.py.

Each is a correct CacheEngine (block by block, layer by layer, K and V) with one slip a reader
makes, switched on by a class attribute."""

from __future__ import annotations

import torch

from tinyserve.cache_engine import CacheEngine


class _Engine(CacheEngine):
    """A correct answer; each subclass below slips once."""

    halves = 2  # K and V
    num_layers_moved = None  # every layer
    swap_in_map_reversed = first_dst_only = copy_backwards = wipe_saved = stage_in_float32 = False

    def swap_out(self, src_to_dst):
        self._blocks(self.gpu_cache, self.cpu_cache, list(src_to_dst.items()))
        if self.wipe_saved:
            self._wipe(list(src_to_dst))

    def swap_in(self, src_to_dst):
        pairs = list(src_to_dst.items())
        if self.swap_in_map_reversed:
            pairs = [(dst, src) for src, dst in pairs]
        self._blocks(self.cpu_cache, self.gpu_cache, pairs)

    def copy(self, src_to_dsts):
        pairs = [(src, dst) for src, dsts in src_to_dsts.items() for dst in (dsts[:1] if self.first_dst_only else dsts)]
        if self.copy_backwards:
            pairs = [(dst, src) for src, dst in pairs]
        self._blocks(self.gpu_cache, self.gpu_cache, pairs)

    def _blocks(self, src_pool, dst_pool, pairs):
        if not pairs:
            return
        for src_pair, dst_pair in list(zip(src_pool, dst_pool))[:self.num_layers_moved]:
            for src_cache, dst_cache in list(zip(src_pair, dst_pair))[:self.halves]:
                if self.stage_in_float32:
                    staged = torch.stack([src_cache[s].float() for s, _ in pairs]).to(dst_cache.device)
                    dst_cache.index_copy_(0, torch.tensor([d for _, d in pairs], device=dst_cache.device), staged)
                    continue
                for src, dst in pairs:
                    dst_cache[dst] = src_cache[src].to(dst_cache.device)

    def _wipe(self, blocks):
        for pair in self.gpu_cache:
            for cache in pair:
                cache[blocks] = 0


class _KeysOnly(_Engine):  # moves the key cache and forgets the values
    halves = 1


class _FirstLayerOnly(_Engine):  # stops after layer 0
    num_layers_moved = 1


class _SwapInReadsMapBackwards(_Engine):  # takes swap_in's {CPU block: GPU block} as {GPU: CPU}
    swap_in_map_reversed = True


class _CopiesToFirstDestinationOnly(_Engine):  # one source, several forks: only the first gets it
    first_dst_only = True


class _CopiesBackwards(_Engine):  # writes the fresh block over the shared one
    copy_backwards = True


class _WipesWhatItSaved(_Engine):  # a swap-out "moves": zeroes the device blocks it saved
    wipe_saved = True


class _StagesInFloat32(_Engine):  # gathers into a float32 tensor: index_copy_ refuses half precision
    stage_in_float32 = True


MISTAKES = {
    "check_cache_engine": [_KeysOnly, _FirstLayerOnly, _SwapInReadsMapBackwards, _CopiesToFirstDestinationOnly,
                           _CopiesBackwards, _WipesWhatItSaved, _StagesInFloat32],
}
