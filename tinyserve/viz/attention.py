"""Chapter 07's tools for running the Llama model on a paged cache by hand, and its drawing.

``PagedRun`` is the smallest thing that can drive ``LlamaForCausalLM`` through prefill and decode
without the engine: a real CacheEngine holds the K/V, a real BlockAllocator hands out blocks, and
``prepare`` turns "these sequences bring these new tokens" into packed input ids, positions and an
``AttentionMetadata`` (slot mapping, block tables, context lengths). Every token it sends records
a ``TokenWrite``: which sequence, which position, and the physical slot its K/V went to.
``draw_token_slots`` draws those records: each sequence's tokens in order above, the pool they
landed in below.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tinyserve.attention.metadata import AttentionMetadata
from tinyserve.block import BlockAllocator, Device, slot_mapping
from tinyserve.cache_engine import CacheEngine
from tinyserve.config import CacheConfig
from tinyserve.models.llama import LlamaForCausalLM
from tinyserve.viz.blocks import owner_colors
from tinyserve.viz.figures import figure


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


def token_label(tokenizer, token_id: int, width: int = 7) -> str:
    """A token's text for a small cell: spaces shown as '·', cut to ``width`` (``#id`` when the
    text cannot be drawn)."""
    if tokenizer is None:
        return str(token_id)
    text = tokenizer.decode([token_id]).replace("\n", "⏎").replace(" ", "·")
    if not text or not text.isprintable():  # a byte piece or control character has no glyph
        return f"#{token_id}"
    return text if len(text) <= width else text[: width - 1] + "…"


def draw_token_slots(writes: list[TokenWrite], block_size: int, num_blocks: int, tokenizer=None,
                     title: str | None = None, tables: dict[str, list[int]] | None = None,
                     blocks_per_row: int = 4):
    """Above: each sequence's tokens in order, with the slot each one's K/V went to. Below: the
    pool, block by block, each slot filled by whoever wrote there (with the step that did)."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    seqs = list(dict.fromkeys(w.seq for w in writes))
    colors = owner_colors(seqs)
    by_slot = {w.slot: w for w in writes}
    used_blocks = max((w.slot // block_size for w in writes), default=-1) + 1
    shown_blocks = max(1, min(num_blocks, used_blocks))
    pool_rows = -(-shown_blocks // blocks_per_row)
    gap = 0.5
    seq_w = max((sum(1 for w in writes if w.seq == s) for s in seqs), default=1)
    width = max(min(shown_blocks, blocks_per_row) * (block_size + gap), seq_w * 1.05 + 4.0)
    seq_h, pool_h = len(seqs) * 1.15, pool_rows * 1.5
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(0.7 * (width + 1.5), 0.7 * (seq_h + pool_h) + 1.6),
                                      gridspec_kw={"height_ratios": [seq_h + 0.6, pool_h + 0.4]})

    def cell(ax, x, y, w: TokenWrite, gid: str, sub: str):
        rect = Rectangle((x, y), 0.95, 0.8, facecolor=colors[w.seq], edgecolor="#444", linewidth=0.6,
                         alpha=1.0 if w.prefill else 0.7, hatch=None if w.prefill else "///")
        rect.set_gid(gid)
        ax.add_patch(rect)
        ax.text(x + 0.47, y + 0.52, token_label(tokenizer, w.token_id), ha="center", va="center", fontsize=6.5)
        ax.text(x + 0.47, y + 0.17, sub, ha="center", va="center", fontsize=5.5, color="#222")

    for row, seq in enumerate(seqs):
        y = (len(seqs) - 1 - row) * 1.15
        top.text(-0.3, y + 0.4, seq, ha="right", va="center", fontsize=9, fontweight="bold")
        mine = [w for w in writes if w.seq == seq]
        for w in mine:
            cell(top, w.position * 1.05, y, w, f"token:{seq}:{w.position}", sub=f"p{w.position}→{w.slot}")
        if tables and seq in tables:
            top.text(len(mine) * 1.05 + 0.3, y + 0.4, f"block table {tables[seq]}", va="center", fontsize=8)
    top.set_xlim(-1.5, width)
    top.set_ylim(-0.3, seq_h + 0.1)
    top.set_aspect("equal")
    top.axis("off")
    top.set_title("each sequence's tokens: p = position → slot = block_table[p // block_size] × block_size"
                  " + p % block_size", loc="left", fontsize=9)

    for b in range(shown_blocks):
        r, c = divmod(b, blocks_per_row)
        x0, y0 = c * (block_size + gap), (pool_rows - 1 - r) * 1.5
        for off in range(block_size):
            slot = b * block_size + off
            if slot in by_slot:
                w = by_slot[slot]
                cell(bottom, x0 + off, y0, w, f"slot:{slot}", sub=f"{slot} · step {w.step}")
            else:
                rect = Rectangle((x0 + off, y0), 0.95, 0.8, facecolor="white", edgecolor="#999", linewidth=0.6)
                rect.set_gid(f"slot:{slot}")
                bottom.add_patch(rect)
                bottom.text(x0 + off + 0.47, y0 + 0.17, str(slot), ha="center", va="center", fontsize=5.5,
                            color="#999")
        bottom.text(x0 + block_size / 2, y0 - 0.12, f"block {b}", ha="center", va="top", fontsize=7)
    bottom.set_xlim(-1.5, width)
    bottom.set_ylim(-0.6, pool_h)
    bottom.set_aspect("equal")
    bottom.axis("off")
    bottom.set_title("the K/V pool, slot by slot (small text: slot · the step that wrote it; hatched: decode)",
                     loc="left", fontsize=9)
    if title:
        fig.suptitle(title, fontsize=10, x=0.02, ha="left")
    fig.tight_layout()
    return fig


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


@figure("07_token_slots")
def fig_token_slots(run: PagedRun | None = None, tokenizer=None):
    if run is None:
        from tinyserve.models.loader import load_model

        loaded = load_model("smollm2-135m")
        run, tokenizer = seed_paged_run(loaded), loaded.tokenizer
    return draw_token_slots(run.writes, run.block_size, run.engine.num_gpu_blocks, tokenizer, tables=run.tables,
                            title="Where each token's K/V lands: step 1 prefills s0+s1, step 2 s2, then decodes")
