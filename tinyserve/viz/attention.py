"""Chapter 07's drawing: where each token's K/V lands in the paged cache.

``draw_token_slots`` draws the ``TokenWrite`` records of a ``tinyserve.lab.paged_run.PagedRun``:
each sequence's tokens in order above, the pool they landed in below.
"""

from __future__ import annotations

from tinyserve.lab.paged_run import PagedRun, TokenWrite, seed_paged_run
from tinyserve.viz.style import owner_colors, pyplot, text_size


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
                     blocks_per_row: int = 2):
    """Above: each sequence's tokens in order, with the slot each one's K/V went to. Below: the
    pool, block by block, each slot filled by whoever wrote there (with the step that did)."""
    plt = pyplot()
    from matplotlib.patches import Rectangle

    seqs = list(dict.fromkeys(w.seq for w in writes))
    colors = owner_colors(seqs)
    by_slot = {w.slot: w for w in writes}
    used_blocks = max((w.slot // block_size for w in writes), default=-1) + 1
    shown_blocks = max(1, min(num_blocks, used_blocks))
    pool_rows = -(-shown_blocks // blocks_per_row)
    gap = 0.5
    seq_w = max((sum(1 for w in writes if w.seq == s) for s in seqs), default=1)
    # The block tables go under the sequence names, at the left, so the figure is only as wide as
    # the longest sequence: narrow enough to show at a column's width with its text legible.
    width = max(min(shown_blocks, blocks_per_row) * (block_size + gap), seq_w * 1.05)
    left = 3.2
    seq_h, pool_h = len(seqs) * 1.25, pool_rows * 1.5
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(0.72 * (width + left), 0.72 * (seq_h + pool_h) + 1.9),
                                      gridspec_kw={"height_ratios": [seq_h + 0.6, pool_h + 0.4]})
    big, small = text_size(fig, 9.0), text_size(fig, 7.5)

    def cell(ax, x, y, w: TokenWrite, gid: str, sub: str):
        rect = Rectangle((x, y), 0.95, 0.8, facecolor=colors[w.seq], edgecolor="#444", linewidth=0.6,
                         alpha=1.0 if w.prefill else 0.7, hatch=None if w.prefill else "///")
        rect.set_gid(gid)
        ax.add_patch(rect)
        ax.text(x + 0.47, y + 0.55, token_label(tokenizer, w.token_id), ha="center", va="center", fontsize=big)
        ax.text(x + 0.47, y + 0.18, sub, ha="center", va="center", fontsize=small, color="#222")

    for row, seq in enumerate(seqs):
        y = (len(seqs) - 1 - row) * 1.25
        top.text(-0.3, y + 0.55, seq, ha="right", va="center", fontsize=11, fontweight="bold")
        mine = [w for w in writes if w.seq == seq]
        for w in mine:
            cell(top, w.position * 1.05, y, w, f"token:{seq}:{w.position}", sub=f"p{w.position}→{w.slot}")
        if tables and seq in tables:
            top.text(-0.3, y + 0.1, f"block table {tables[seq]}", ha="right", va="center", fontsize=big)
    top.set_xlim(-left, width)
    top.set_ylim(-0.3, seq_h + 0.1)
    top.set_aspect("equal")
    top.axis("off")
    top.set_title("each sequence's tokens, p = position → slot\n"
                  "slot = block_table[p // block_size] × block_size + p % block_size", loc="left", fontsize=10)

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
                bottom.text(x0 + off + 0.47, y0 + 0.18, str(slot), ha="center", va="center", fontsize=small,
                            color="#777")
        bottom.text(x0 + block_size / 2, y0 - 0.12, f"block {b}", ha="center", va="top", fontsize=big)
    bottom.set_xlim(-left, width)
    bottom.set_ylim(-0.6, pool_h)
    bottom.set_aspect("equal")
    bottom.axis("off")
    bottom.set_title("the K/V pool, slot by slot\nsmall text: slot · the step that wrote it; hatched: a decode",
                     loc="left", fontsize=10)
    if title:
        fig.suptitle(title, fontsize=11, x=0.02, ha="left")
    fig.tight_layout()
    return fig


def fig_token_slots(run: PagedRun | None = None, tokenizer=None):
    if run is None:
        from tinyserve.models.loader import load_model

        loaded = load_model("smollm2-135m")
        run, tokenizer = seed_paged_run(loaded), loaded.tokenizer
    return draw_token_slots(run.writes, run.block_size, run.engine.num_gpu_blocks, tokenizer, tables=run.tables,
                            title="Where each token's K/V lands: step 1 prefills s0+s1, step 2 s2, then decodes")
