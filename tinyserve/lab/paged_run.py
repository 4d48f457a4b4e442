"""Chapter 07's tool for running the Llama model on a paged cache by hand, without the engine.

``PagedRun`` is the smallest thing that can drive ``LlamaForCausalLM`` through prefill and decode:
a real CacheEngine holds the K/V, a real BlockAllocator hands out blocks, and ``prepare`` turns
"these sequences bring these new tokens" into packed input ids, positions and an
``AttentionMetadata`` (slot mapping, block tables, context lengths). Every token it sends records
a ``TokenWrite``: which sequence, which position, and the physical slot its K/V went to.
``seed_paged_run`` plays the s0/s1/s2 story with it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tinyserve.attention.metadata import AttentionMetadata
from tinyserve.block import BlockAllocator, Device, slot_mapping
from tinyserve.cache_engine import CacheEngine
from tinyserve.config import CacheConfig
from tinyserve.models.llama import LlamaForCausalLM


@dataclass(frozen=True)
class TokenWrite:
    """One token of one step: whose, where in its sequence, and where its K/V was stored."""

    seq: str
    position: int
    token_id: int
    slot: int
    step: int
    prefill: bool  # written by a prefill (the sequence brought several tokens, or its first)


class PagedRun:
    """Prefill and decode with hand-built metadata over a real CacheEngine."""

    def __init__(self, model: LlamaForCausalLM, block_size: int = 4, num_blocks: int = 16) -> None:
        self.model = model
        self.block_size = block_size
        param = model.embed_tokens
        self.engine = CacheEngine(CacheConfig(block_size=block_size, num_gpu_blocks=num_blocks, num_cpu_blocks=0),
                                  model.num_layers, model.num_kv_heads, model.head_dim, param.dtype, param.device)
        self.allocator = BlockAllocator(Device.GPU, block_size, num_blocks)
        self.tables: dict[str, list[int]] = {}
        self.tokens: dict[str, list[int]] = {}  # every token whose K/V is (or is about to be) cached
        self.writes: list[TokenWrite] = []
        self.num_steps = 0

    def prepare(self, new_tokens: dict[str, list[int]]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Pack the new tokens of each sequence back to back, give each a slot (taking a fresh
        block whenever a sequence crosses into a new one) and describe the batch for attention."""
        self.num_steps += 1
        ids, positions, slots, query_lens, context_lens, tables = [], [], [], [], [], []
        for seq, toks in new_tokens.items():
            history = self.tokens.setdefault(seq, [])
            table = self.tables.setdefault(seq, [])
            start, end = len(history), len(history) + len(toks)
            while len(table) * self.block_size < end:
                table.append(self.allocator.allocate().block_number)
            seq_slots = slot_mapping(table, start, end, self.block_size)
            prefill = start == 0 or len(toks) > 1
            self.writes += [TokenWrite(seq, p, t, s, self.num_steps, prefill)
                            for p, t, s in zip(range(start, end), toks, seq_slots)]
            history.extend(toks)
            ids += toks
            positions += range(start, end)
            slots += seq_slots
            query_lens.append(len(toks))
            context_lens.append(end)
            tables.append(list(table))
        device = self.engine.device
        meta = AttentionMetadata.build(query_lens, context_lens, tables, slots, device=device)
        return (torch.tensor(ids, dtype=torch.long, device=device),
                torch.tensor(positions, dtype=torch.long, device=device), meta)

    @torch.no_grad()
    def step(self, new_tokens: dict[str, list[int]]) -> dict[str, torch.Tensor]:
        """Run one packed batch; returns each sequence's next-token logits (its last row)."""
        ids, positions, meta = self.prepare(new_tokens)
        hidden = self.model(ids, positions, self.engine.gpu_cache, meta)
        last = (meta.query_start_loc[1:] - 1).long()
        logits = self.model.compute_logits(hidden.index_select(0, last))
        return dict(zip(new_tokens, logits))


SEED_PROMPTS = {"s0": "Hello, my name is", "s1": "The future of AI is", "s2": "The life is"}


def seed_paged_run(loaded, block_size: int = 4, num_blocks: int = 16, decode_steps: int = 4) -> PagedRun:
    """The seed story on the real model: prefill s0 and s1 together, then s2 alone, then
    ``decode_steps`` greedy decode steps of all three."""
    run = PagedRun(loaded.model, block_size, num_blocks)
    prompts = {k: loaded.tokenizer(v).input_ids for k, v in SEED_PROMPTS.items()}
    nxt = {}
    for batch in (("s0", "s1"), ("s2",)):
        nxt.update({s: int(x.argmax()) for s, x in run.step({s: prompts[s] for s in batch}).items()})
    for _ in range(decode_steps):
        nxt = {s: int(x.argmax()) for s, x in run.step({s: [t] for s, t in nxt.items()}).items()}
    return run
