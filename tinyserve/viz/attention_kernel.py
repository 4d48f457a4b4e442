"""Chapter 08's drawings of the Triton decode kernel: its program grid, one program's walk, its speed.

What they draw is computed in ``tinyserve.lab``: the launch plan (``kernel_plan.plan_decode``),
the inner loop in PyTorch (``softmax_walk.walk_program``), and the bandwidth floor and the GPU
benchmark's CSV (``bandwidth``).
"""

from __future__ import annotations

import math

from tinyserve.lab.bandwidth import FLOOR_SHAPES, H200_BANDWIDTH, floor_table, load_kernel_results
from tinyserve.lab.kernel_plan import EXAMPLE, H200_SMS, DecodePlan, example_batch, example_walk, plan_decode
from tinyserve.lab.softmax_walk import ProgramWalk
from tinyserve.viz.style import MIN_FONT, PALETTE, pick, pyplot, text_size


def draw_program_grid(plan: DecodePlan, block_tables: list[list[int]], title: str | None = None):
    """Top: every program of the grid, one box per (sequence, KV head, partition). Bottom: each
    sequence's context as its logical blocks, coloured by partition, with the physical block
    number each logical block maps to, and the tile boundaries of the kernel's loop."""
    plt = pyplot()
    num_seqs = len(plan.context_lens)
    widest = max(math.ceil(c / plan.block_size) for c in plan.context_lens)
    cols = plan.num_kv_heads * plan.num_parts
    width = max(9.0, 0.26 * widest + 2.0, 2.2 * cols)
    fig, (ax_g, ax_b) = plt.subplots(2, 1, figsize=(width, 1.2 + 1.9 * num_seqs),
                                     gridspec_kw={"height_ratios": [1.1, 1.0]})
    size = text_size(fig)  # a wide grid is shown scaled down: its text grows with the width
    for ax in (ax_g, ax_b):
        ax.set_axis_off()
    box_w = min(2.6, (width - 0.5) / cols)
    for prog in plan.programs:
        x = (prog.kv_head * plan.num_parts + prog.part) * box_w
        y = prog.seq * 1.2
        color = "#eeeeee" if prog.empty else pick(PALETTE, prog.part)
        ax_g.add_patch(plt.Rectangle((x, y), box_w - 0.12, 1.08, facecolor=color, alpha=1 if prog.empty else 0.35,
                                     edgecolor="#333", lw=0.8, gid=f"program:{prog.seq},{prog.kv_head},{prog.part}"))
        heads = f"q heads {prog.q_heads[0]}-{prog.q_heads[-1]}" if plan.group > 1 else f"q head {prog.q_heads[0]}"
        tiles = f"{prog.num_tiles} tile" + ("s" if prog.num_tiles != 1 else "")
        body = "empty: weight 0" if prog.empty else f"tokens {prog.start}-{prog.end - 1}, {tiles}"
        label = f"program ({prog.seq}, {prog.kv_head}, {prog.part})\n{heads}\n{body}"
        ax_g.text(x + (box_w - 0.12) / 2, y + 0.54, label, ha="center", va="center", fontsize=size,
                  gid=f"program_text:{prog.seq},{prog.kv_head},{prog.part}")
    for h in range(plan.num_kv_heads):
        ax_g.text((h * plan.num_parts + plan.num_parts / 2) * box_w - 0.06, -0.2, f"KV head {h}", ha="center",
                  fontsize=size, weight="bold")
    ax_g.set_xlim(-0.05, box_w * cols)
    ax_g.set_ylim(1.2 * num_seqs, -0.5)
    ax_g.set_title(f"the grid: {plan.grid} = (sequences, KV heads, partitions) programs; each holds a "
                   f"{plan.group_pad}-row query tile with {plan.group} real rows", fontsize=size)

    for s, (ctx, table) in enumerate(zip(plan.context_lens, block_tables)):
        y = s * 1.1
        ax_b.text(-0.3, y + 0.35, f"seq {s}\n{ctx} tok", ha="right", va="center", fontsize=size)
        for b in range(math.ceil(ctx / plan.block_size)):
            part = (b * plan.block_size) // plan.partition_size  # the partition of its first token
            filled = min(plan.block_size, ctx - b * plan.block_size) / plan.block_size
            ax_b.add_patch(plt.Rectangle((b, y), 0.95, 0.7, facecolor="white", edgecolor="#666", lw=0.5))
            ax_b.add_patch(plt.Rectangle((b, y), 0.95 * filled, 0.7, alpha=0.55, lw=0,
                                         facecolor=pick(PALETTE, part), gid=f"block:{s},{b}"))
            ax_b.text(b + 0.47, y + 0.37, str(table[b]), ha="center", va="center", fontsize=size,
                      rotation=90 if table[b] >= 100 else 0)
        for t in range(plan.tile_tokens, ctx, plan.tile_tokens):  # tile boundaries of the loop
            xb = t / plan.block_size - 0.025
            edge = t % plan.partition_size == 0
            ax_b.plot([xb, xb], [y - 0.15, y + 0.85], color="#c00" if edge else "#222", lw=2.0 if edge else 0.9,
                      ls="-" if edge else "--")
    ax_b.set_xlim(-2.2, max(widest + 0.2, (width - 2.0) / 0.26))
    ax_b.set_ylim(1.1 * num_seqs, -0.3)
    ax_b.set_title(f"each sequence's logical blocks of {plan.block_size} tokens (number: physical block); dashed: "
                   f"tiles of {plan.tile_tokens} tokens" + ("; red: partition boundary" if plan.split else ""),
                   fontsize=size)
    if title:
        fig.suptitle(title, fontsize=size + 1)
    fig.tight_layout()
    return fig


def draw_program_walk(walk: ProgramWalk, block_tables: list[list[int]], num_blocks: int, seq: int,
                      row: int = 0, per_row: int = 16):
    """Top: the physical block pool; the blocks one program reads are numbered by the tile that
    reads them, other sequences' blocks are grey. Below, two panels: that program's running max
    and running sum (for query row ``row``) after each tile; the sum drops when a new max
    rescales it."""
    plt = pyplot()
    pool_rows = math.ceil(num_blocks / per_row)
    fig = plt.figure(figsize=(10, 0.45 * pool_rows + 4.2), layout="constrained")
    grid = fig.add_gridspec(2, 2, height_ratios=[0.45 * pool_rows + 0.4, 3.0])
    ax_p = fig.add_subplot(grid[0, :])
    ax_s, ax_l = fig.add_subplot(grid[1, 0]), fig.add_subplot(grid[1, 1])
    tile_of = {}
    for i, step in enumerate(walk.steps):
        for b in step.blocks:
            tile_of.setdefault(b, i)
    others = {b for s, t in enumerate(block_tables) if s != seq for b in t}
    cmap = plt.get_cmap("viridis")
    n = max(1, len(walk.steps) - 1)
    for b in range(num_blocks):
        x, y = b % per_row, b // per_row
        if b in tile_of:
            color, label = cmap(tile_of[b] / n), f"{b} t{tile_of[b]}"
        else:
            color, label = ("#d0d0d0" if b in others else "white"), str(b)
        ax_p.add_patch(plt.Rectangle((x, y), 0.94, 0.9, facecolor=color, edgecolor="#777", lw=0.5, gid=f"pool:{b}"))
        ax_p.text(x + 0.47, y + 0.46, label, ha="center", va="center", fontsize=9,
                  color="white" if b in tile_of and tile_of[b] / n < 0.6 else "black")
    ax_p.set_xlim(0, per_row)
    ax_p.set_ylim(pool_rows, 0)
    ax_p.set_axis_off()
    ax_p.set_title(f"the block pool: blocks read by one program of seq {seq} (tN = tile N); grey: other sequences",
                   fontsize=MIN_FONT)

    # Two panels rather than two y-axes on one: m and l have different units and scales.
    x = range(len(walk.steps))
    ax_s.plot(x, [float(s.m[row]) for s in walk.steps], "o-", label="running max m")
    ax_s.set_xlabel("after tile")
    ax_s.set_title(f"running max m of query row {row}\n(score units)", fontsize=MIN_FONT)
    ax_l.plot(x, [float(s.l[row]) for s in walk.steps], "s--", color="#f58518", label="running sum l")
    ax_l.set_xlabel("after tile")
    ax_l.set_title("running sum l = Σ exp(score − m)\n(drops when a new max rescales it)", fontsize=MIN_FONT)
    for ax in (ax_s, ax_l):
        ax.set_xticks(list(x))
        ax.grid(alpha=0.3)
    return fig


def draw_bandwidth_floor(rows: list[dict] | None = None, bandwidth: float = H200_BANDWIDTH, ax=None):
    """The floor time of one layer's decode step against context length: K/V bytes / bandwidth."""
    plt = pyplot()
    rows = rows or floor_table(bandwidth=bandwidth)
    if ax is None:
        _, ax = plt.subplots(figsize=(8, 4.2))
    styles = dict(zip(FLOOR_SHAPES, ("--", "-")))
    for shape in FLOOR_SHAPES:
        for i, batch in enumerate(sorted({r["batch"] for r in rows})):
            pts = [r for r in rows if r["shape"] == shape and r["batch"] == batch]
            ax.plot([r["context"] for r in pts], [r["floor_us"] for r in pts], styles[shape], marker="o", ms=3,
                    color=pick(PALETTE, i), label=f"{shape.split(' (')[0]}, batch {batch}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context length (tokens per sequence)")
    ax.set_ylabel("floor per decode step and layer (µs)")
    ax.set_title(f"the bandwidth floor at {bandwidth / 1e12:.1f} TB/s (bf16 K/V, read once): arithmetic, "
                 "not a measurement", fontsize=10)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=7.5, ncol=2)
    return ax.figure


def draw_kernel_bandwidth(rows: list[dict]):
    """Measured share of the device copy bandwidth against context length, one panel per batch
    size and one line per (dtype, head_dim, GQA); the reference dashed; 100% = the floor."""
    plt = pyplot()
    timed = [r for r in rows if r.get("pct_of_copy") is not None]
    batches = sorted({r["batch"] for r in timed})
    fig, axes = plt.subplots(1, len(batches), figsize=(4.6 * len(batches), 4.0), sharey=True, squeeze=False)
    configs = sorted({(r["dtype"], r["head_dim"], r["gqa"]) for r in timed})
    copy_gbps = timed[0]["copy_gbps"] if timed else 0.0
    for ax, batch in zip(axes[0], batches):
        for i, cfg in enumerate(configs):
            pts = sorted((r for r in timed if r["batch"] == batch and (r["dtype"], r["head_dim"], r["gqa"]) == cfg),
                         key=lambda r: r["context"])
            if not pts:
                continue
            color = plt.get_cmap("tab10")(i % 10)
            ax.plot([r["context"] for r in pts], [r["pct_of_copy"] for r in pts], "o-", ms=3, color=color,
                    label=f"{cfg[0]} d={cfg[1]} gqa {cfg[2]}")
            ref = [r for r in pts if r.get("ref_gbps") is not None]
            if ref:
                ax.plot([r["context"] for r in ref], [100 * r["ref_gbps"] / r["copy_gbps"] for r in ref], ":",
                        color=color, lw=1)
        ax.axhline(100, color="black", lw=1.2)
        ax.text(min(r["context"] for r in timed), 101, "bandwidth floor (device copy)",
                fontsize=8, va="bottom")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context length")
        ax.set_title(f"batch {batch}", fontsize=10)
        ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel("% of copy bandwidth (solid: triton, dotted: reference)")
    fig.suptitle(f"measured: the decode kernel against a copy at {copy_gbps:.0f} GB/s", fontsize=11)
    fig.tight_layout()
    legend = {}
    for ax in axes[0]:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(label, handle)
    fig.legend(list(legend.values()), list(legend), fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    return fig


# -- the figures of make figures (listed in figures.py) -----------------------------------------


def fig_program_grid():
    ex = EXAMPLE
    tables, _ = example_batch(ex["context_lens"], ex["block_size"])
    plan = plan_decode(list(ex["context_lens"]), ex["num_heads"], ex["num_kv_heads"], ex["head_dim"],
                       ex["block_size"], tables, num_sms=H200_SMS)
    return draw_program_grid(plan, tables, title=f"the decode grid on a GPU with {H200_SMS} SMs")


def fig_program_walk():
    walk, e = example_walk()
    return draw_program_walk(walk, e.tables, e.num_blocks, seq=0)


def fig_bandwidth_floor():
    return draw_bandwidth_floor()


def fig_kernel_bandwidth():
    """The GPU benchmark's measured bandwidth (a figure only where a GPU run left its CSV)."""
    return draw_kernel_bandwidth(load_kernel_results())
