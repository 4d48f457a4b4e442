"""Chapter 02's view of the slot mapping: the cache slot by slot, each token where the
worker writes its K/V (block number x block size + offset)."""

from __future__ import annotations

from tinyserve.lab.block_stories import seed_tables_example
from tinyserve.viz.style import owner_colors, pyplot


def draw_slots(block_tables: dict[str, list[int]], seq_lens: dict[str, int], num_blocks: int, block_size: int,
               ax=None):
    """The cache seen slot by slot: one row per physical block, one column per offset. Each slot
    a sequence writes is labelled with its position in that sequence; the small number is the
    slot (block number x block size + offset) that the slot mapping hands the worker."""
    plt = pyplot()
    from matplotlib.patches import Patch, Rectangle

    if ax is None:
        _, ax = plt.subplots(figsize=(1.0 * block_size + 2.2, 0.42 * num_blocks + 0.8))
    colors = owner_colors(list(block_tables))
    holder: dict[int, tuple[str, int]] = {}
    for label, table in block_tables.items():
        n = seq_lens[label]
        if n > len(table) * block_size:
            raise ValueError(f"{label} has {n} tokens but its table holds only {len(table) * block_size}")
        for pos in range(n):
            holder[table[pos // block_size] * block_size + pos % block_size] = (label, pos)
    for b in range(num_blocks):
        y = num_blocks - 1 - b
        ax.text(-0.15, y + 0.4, f"block {b}", ha="right", va="center", fontsize=8)
        for off in range(block_size):
            slot = b * block_size + off
            owner = holder.get(slot)
            ax.add_patch(Rectangle((off, y), 0.95, 0.8, gid=f"slot:{slot}", edgecolor="#555555", lw=0.8,
                                   facecolor=colors[owner[0]] if owner else "white", alpha=0.8 if owner else 1))
            ax.text(off + 0.06, y + 0.7, str(slot), ha="left", va="top", fontsize=7.5, color="#555555")
            if owner:
                ax.text(off + 0.5, y + 0.32, f"{owner[0]}[{owner[1]}]", ha="center", va="center", fontsize=7.5,
                        gid=f"token:{owner[0]}:{owner[1]}")
    ax.legend(handles=[Patch(facecolor=colors[k], label=k) for k in block_tables], fontsize=8,
              loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    ax.set_xlim(-1.6, block_size + 0.1)
    ax.set_ylim(-0.2, num_blocks)
    ax.axis("off")
    ax.set_title("offset in block →", fontsize=9, loc="center")
    return ax


def slot_mapping_figure():
    alloc, live = seed_tables_example()
    return draw_slots({k: [b.block_number for b in t] for k, (_, t) in live.items()},
                      {k: s.get_len() for k, (s, _) in live.items()}, alloc.num_blocks, alloc.block_size).figure
