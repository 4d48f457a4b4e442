"""Chapter 06's views of the CacheEngine: what its tensors hold, round by round.

The pools are filled with marked K/V by ``tinyserve.lab.marked_cache`` (a key's integer part
names its sequence and position); ``draw_pools`` draws one ``PoolFrame`` of it, every slot
coloured by owner. ``fig_memory_budget`` draws where a GPU's memory goes under the CUDA sizing
rule and ``draw_split_x`` which bytes one load step touches in vLLM's split-x key layout and in
tinyserve's plain one (both computed in ``tinyserve.lab.cache_sizing``).
"""

from __future__ import annotations

import torch

from tinyserve.lab.cache_sizing import GiB, memory_budget, plain_offset, split_x_offset
from tinyserve.lab.marked_cache import CopyOnWriteStory, PoolFrame, copy_on_write_story, seed_cache_rounds
from tinyserve.viz.style import MIN_FONT, PALETTE, owner_colors, pick, pyplot, text_size


def _pool_row(ax, marks, device: str, frame: PoolFrame, y: float, colors: dict[str, str], gap: float) -> None:
    from matplotlib.patches import Rectangle

    bs = frame.block_size
    for b, block in enumerate(marks):
        x0 = b * (bs + gap)
        for off, mark in enumerate(block):
            live = frame.live(device, b, off)
            if mark is None:
                face, alpha, text = "white", 1.0, ""
            else:
                face = colors.get(frame.name(mark[0]), "#bbbbbb")
                # Stale bytes (a freed block, a reused block's old tail) are drawn faded: they are
                # still in memory, but no block table points a reader at them.
                alpha = 1.0 if live is not None else 0.25
                text = str(mark[1])
            rect = Rectangle((x0 + off, y), 0.92, 0.85, facecolor=face, alpha=alpha, edgecolor="#555",
                             linewidth=0.6)
            rect.set_gid(f"slot:{device}:{b}:{off}")
            ax.add_patch(rect)
            if text:
                t = ax.text(x0 + off + 0.46, y + 0.42, text, ha="center", va="center", fontsize=8.5,
                            color="black" if alpha == 1.0 else "#777")
                t.set_gid(f"pos:{device}:{b}:{off}")
        owners = [rid for rid, table in (frame.gpu_tables if device == "GPU" else frame.cpu_tables).items()
                  if b in table]
        # "block b", not "GPU b": the number is a block of this pool, not a device
        ax.text(x0 + bs / 2, y - 0.2, f"block {b}" + (f" ({','.join(owners)})" if owners else ""),
                ha="center", va="top", fontsize=MIN_FONT, color="#333")
    if len(marks):
        ax.text(-0.6, y + 0.42, f"{device}\npool", ha="right", va="center", fontsize=MIN_FONT, fontweight="bold")


def draw_pools(frame: PoolFrame, ax=None, colors: dict[str, str] | None = None, title: str | None = None):
    """Both pools of one frame: every slot colored by the request whose marked K/V it holds and
    numbered with the token's position; faded when no block table points at it any more."""
    plt = pyplot()
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 2.6))
    colors = colors or owner_colors([frame.name(o) for o in sorted({m[0] for pool in (frame.gpu, frame.cpu)
                                                                   for block in pool for m in block if m})])
    gap = 0.6
    _pool_row(ax, frame.gpu, "GPU", frame, 1.9, colors, gap)
    _pool_row(ax, frame.cpu, "CPU", frame, 0.0, colors, gap)
    width = max(len(frame.gpu), len(frame.cpu)) * (frame.block_size + gap)
    ax.set_xlim(-3.2, width)
    ax.set_ylim(-0.85, 3.0)
    ax.set_aspect("equal")
    ax.axis("off")
    if title is None:
        moves = []
        if frame.swapped_out:
            moves.append("swap_out " + ", ".join(f"GPU block {g}→CPU block {c}"
                                                 for g, c in frame.swapped_out.items()))
        if frame.swapped_in:
            moves.append("swap_in " + ", ".join(f"CPU block {c}→GPU block {g}" for c, g in frame.swapped_in.items()))
        if frame.copied:
            moves.append("copy block " + ", ".join(f"{s}→{d}" for s, ds in frame.copied.items() for d in ds))
        title = f"after round {frame.round}" + (": " + "; ".join(moves) if moves else "")
    ax.set_title(title, loc="left", fontsize=MIN_FONT)
    return ax.figure


def pool_key(fig, colors: dict[str, str], owner: str = "request", ncol: int | None = None) -> None:
    """The key of a pool drawing, below it: a colour per owner, faded = stale, number = position."""
    from matplotlib.patches import Patch

    handles = [Patch(facecolor=c, edgecolor="#555", label=f"{owner} {name}") for name, c in colors.items()]
    handles.append(Patch(facecolor=next(iter(colors.values())), alpha=0.25, edgecolor="#555",
                         label="faded: stale bytes (no table points here)"))
    handles.append(Patch(facecolor="white", edgecolor="#555", label="number: the token's position"))
    fig.legend(handles=handles, loc="lower center", ncol=ncol or len(handles), fontsize=MIN_FONT, frameon=False,
               handlelength=1.2, columnspacing=1.2)


SWAP_FIGURE_ROUNDS = (2, 3, 8, 12)


def fig_swap_pools(frames: list[PoolFrame] | None = None, rounds: tuple[int, ...] = SWAP_FIGURE_ROUNDS):
    """The seed story's pools after the rounds that move blocks: s2 leaves in round 3, s1 in
    round 8, s2 comes back in round 12 into a different GPU block."""
    frames = frames or seed_cache_rounds(max(rounds))
    by_round = {f.round: f for f in frames}
    plt = pyplot()
    fig, axes = plt.subplots(len(rounds), 1, figsize=(10, 2.3 * len(rounds) + 0.4))
    colors = owner_colors(["s0", "s1", "s2"])
    for ax, r in zip(axes, rounds):
        draw_pools(by_round[r], ax=ax, colors=colors)
    fig.suptitle("Marked K/V in the CacheEngine's pools, after the rounds that move blocks",
                 fontsize=11, x=0.02, ha="left")
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    pool_key(fig, colors, "sequence")
    return fig


def fig_copy_on_write(story: CopyOnWriteStory | None = None):
    story = story or copy_on_write_story()
    plt = pyplot()
    fig, axes = plt.subplots(2, 1, figsize=(8, 4.0))
    colors = owner_colors(["prompt", "r.0", "r.1"])
    shared = sorted(set(story.before.gpu_tables["r.0"]))
    draw_pools(story.before, ax=axes[0], colors=colors,
               title=f"after the prefill: both samples share blocks {', '.join(map(str, shared))}")
    draw_pools(story.after, ax=axes[1], colors=colors,
               title="after copying block " + ", ".join(f"{a}→{b}" for a, bs in story.copies.items() for b in bs)
               + " and each sample's first token")
    for ax in axes:
        ax.set_ylim(1.5, 3.0)  # there is no CPU pool in this story
    fig.tight_layout(rect=(0, 0.13, 1, 1))
    pool_key(fig, {"prompt": colors["prompt"], "r.0": colors["r.0"], "r.1": colors["r.1"]}, "tokens of", ncol=3)
    return fig


# -- sizing a device -----------------------------------------------------------------------------


def fig_memory_budget(total: int = 80 * GiB, used: int = int(13.5e9) + GiB // 2, activation: int = 2 * GiB,
                      shape: tuple[int, int, int] = (32, 32, 128), dtype: torch.dtype = torch.float16,
                      utilization: float = 0.9, block_size: int = 16):
    """Where a device's memory goes once the CUDA sizing rule has run (by default: Llama-2-7B in
    float16 on an 80 GiB card), computed by ``profile_num_gpu_blocks`` on a pretend device."""
    blocks, parts = memory_budget(total, used, activation, shape, dtype, utilization, block_size)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(10, 1.7))
    left = 0
    for (name, size), color in zip(parts.items(), ["#9c755f", "#edc948", "#4e79a7", "#dddddd"]):
        bar = ax.barh(0, size / GiB, left=left / GiB, color=color, edgecolor="white",
                      label=f"{name}: {size / GiB:.1f} GiB")
        bar.patches[0].set_gid(f"part:{name}")
        left += size
    ax.set_xlim(0, total / GiB)
    ax.set_yticks([])
    ax.set_xlabel(f"GiB of a {total / GiB:g} GiB device")
    ax.legend(ncol=4, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.5), frameon=False)
    ax.set_title(f"Where the device's memory goes: {blocks:,} blocks of {block_size} tokens "
                 f"(utilization {utilization:g})", loc="left", fontsize=10)
    return fig


# -- the split-x key layout of vLLM's CUDA kernel ---------------------------------------------------


def draw_split_x(block_size: int = 4, num_heads: int = 2, head_dim: int = 8, x: int = 4, head: int = 0,
                 chunk: int = 0):
    """One block's keys as memory, in both layouts: each cell is one element, colored by token.
    Outlined: what one load step reads when thread ``t`` fetches the ``chunk``-th x-wide piece of
    token ``t``'s key for ``head`` (scattered in the plain layout, one contiguous run in split-x)."""
    plt = pyplot()
    from matplotlib.patches import Rectangle

    n = block_size * num_heads * head_dim
    layouts = {
        "tinyserve [block, token, head, d]": lambda t, h, d: plain_offset(0, t, h, d, block_size, num_heads,
                                                                        head_dim),
        f"vLLM split-x [block, head, d/x, token, x], x={x}": lambda t, h, d: split_x_offset(
            0, t, h, d, block_size, num_heads, head_dim, x),
    }
    cols = min(n, 32)
    rows_per = -(-n // cols)
    fig, axes = plt.subplots(2, 1, figsize=(0.36 * cols + 1.2, 0.45 * rows_per * 2 + 2.0))
    size = text_size(fig)  # 32 cells a row make a wide figure: its text must be large to survive the scaling
    for ax, (name, offset) in zip(axes, layouts.items()):
        read = []
        for t in range(block_size):
            for h in range(num_heads):
                for d in range(head_dim):
                    off = offset(t, h, d)
                    r, c = divmod(off, cols)
                    hot = h == head and d // x == chunk
                    rect = Rectangle((c, -r), 0.94, 0.9, facecolor=pick(PALETTE, t),
                                     alpha=1.0 if h == head else 0.35, edgecolor="black" if hot else "white",
                                     linewidth=2.0 if hot else 0.5, zorder=3 if hot else 1)
                    rect.set_gid(f"elem:{off}:{'hot' if hot else 'cold'}")
                    ax.add_patch(rect)
                    ax.text(c + 0.47, -r + 0.45, f"{d}", ha="center", va="center", fontsize=size, color="white")
                    if hot:
                        read.append(off)
        for r in range(rows_per):
            ax.text(-0.3, -r + 0.45, f"+{r * cols}", ha="right", va="center", fontsize=size, color="#555")
        read.sort()
        runs = 1 + sum(1 for a, b in zip(read, read[1:]) if b != a + 1)
        where = "one contiguous run" if runs == 1 else f"{runs} separate runs"
        ax.set_xlim(-1.6, cols + 0.2)
        ax.set_ylim(-rows_per + 0.85, 1.0)
        ax.set_aspect("equal")
        ax.axis("off")
        ax.set_title(f"{name}: the outlined {len(read)} elements lie in {where}", loc="left", fontsize=size)
    handles = [Rectangle((0, 0), 1, 1, facecolor=pick(PALETTE, t)) for t in range(block_size)]
    fig.legend(handles, [f"token {t}" for t in range(block_size)], loc="lower center", ncol=block_size,
               fontsize=size, frameon=False)
    fig.suptitle(f"One block's keys in memory, element by element, {cols} to a row (numbers: channel d; "
                 f"faded: heads other than {head})", fontsize=size, x=0.02, ha="left")
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return fig


def fig_split_x_layout():
    return draw_split_x()
