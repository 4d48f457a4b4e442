"""Chapter 00's drawing of the whole engine: LLMEngine on top of the two halves, Scheduler | Worker.

``draw_architecture`` shows the parts each half owns and what crosses between them every step;
with ``chapters=True`` each part carries the numbers of the chapters that build it (the book's
map). Chapters 06 and 09 draw it again.
"""

from __future__ import annotations

from tinyserve.viz.style import pyplot

# Which chapters build which part (the book's map, drawn as badges on the architecture).
CHAPTER_BADGES = {
    "LLMEngine": ["09", "11", "12", "14"],
    "queues": ["04", "05", "13"],
    "BlockSpaceManager": ["02", "03"],
    "model": ["07"],
    "attention": ["08"],
    "CacheEngine": ["01", "06"],
    "Worker": ["09", "10"],
}


def _box(ax, x, y, w, h, label, gid, face="#ffffff", edge="#333333", size=9, weight="bold", va="top", lw=1.2,
         pad=0.12):
    from matplotlib.patches import FancyBboxPatch

    patch = FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.12", facecolor=face,
                           edgecolor=edge, linewidth=lw)
    patch.set_gid(gid)
    ax.add_patch(patch)
    if label:
        ty = y + h - pad if va == "top" else y + h / 2
        ax.text(x + pad, ty, label, ha="left", va=va, fontsize=size, fontweight=weight)
    return patch


def _arrow(ax, start, end, label, gid, label_xy, color="#333333", ha="center", rad=0.0):
    from matplotlib.patches import FancyArrowPatch

    arrow = FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=14, linewidth=1.6, color=color,
                            connectionstyle=f"arc3,rad={rad}")
    arrow.set_gid(gid)
    ax.add_patch(arrow)
    ax.text(*label_xy, label, ha=ha, va="center", fontsize=9, color=color, linespacing=1.25)


def _badge(ax, x, y, numbers: list[str]) -> None:
    for i, n in enumerate(numbers):
        circle = pyplot().Circle((x + i * 0.48, y), 0.21, facecolor="#e15759", edgecolor="white", linewidth=1.0,
                               zorder=5)
        circle.set_gid(f"badge:{n}")
        ax.add_patch(circle)
        ax.text(x + i * 0.48, y, n, ha="center", va="center", fontsize=8.5, color="white", fontweight="bold",
                zorder=6)


def _cells(ax, x, y, n, fill: set[int], color: str, gid: str, size=0.34) -> None:
    for i in range(n):
        rect = pyplot().Rectangle((x + i * (size + 0.06), y), size, size, facecolor=color if i in fill else "white",
                                edgecolor="#666", linewidth=0.6)
        rect.set_gid(gid)
        ax.add_patch(rect)


def draw_architecture(ax=None, chapters: bool = False, title: str | None = None):
    """The engine as boxes and arrows: LLMEngine (requests in, outputs out, the sampler) on top;
    below it the Scheduler (three queues, the BlockSpaceManager's block tables) and the Worker
    (the model, the CacheEngine's GPU blocks and CPU swap space); arrows for one step."""
    plt = pyplot()
    if ax is None:
        _, ax = plt.subplots(figsize=(13.0, 7.4))
    wx = 9.6  # left edge of the Worker
    # LLMEngine
    _box(ax, 0.3, 7.2, 16.3, 2.5, "LLMEngine", "box:LLMEngine", face="#f4f4f4", size=11)
    ax.text(0.45, 9.05, "creates the Scheduler and the Worker(s); step() = schedule → execute → sample → update",
            fontsize=9.5, va="center", color="#333")
    _box(ax, 2.2, 7.45, 3.4, 1.15, "requests", "box:requests", face="#ffffff", size=9.5)
    ax.text(2.34, 7.75, "SequenceGroup per prompt\nadd_request · abort_request", fontsize=8.5, va="center")
    _box(ax, 6.6, 7.45, 3.2, 1.15, "Sampler", "box:Sampler", face="#e8f3e6", size=9.5)
    ax.text(6.74, 7.75, "greedy · temperature\ntop-k · top-p · seeds", fontsize=8.5, va="center")
    _box(ax, 11.0, 7.45, 3.6, 1.15, "outputs", "box:outputs", face="#ffffff", size=9.5)
    ax.text(11.14, 7.75, "detokenize, stop checks\nRequestOutput · history", fontsize=8.5, va="center")
    _arrow(ax, (-0.9, 8.0), (2.2, 8.0), "prompts", "arrow:prompts", (0.35, 8.25))
    _arrow(ax, (14.6, 8.0), (17.9, 8.0), "text", "arrow:text", (17.1, 8.25))

    # Scheduler
    _box(ax, 0.3, 0.3, 7.0, 5.6, "Scheduler", "box:Scheduler", face="#eef3fa", size=11)
    ax.text(0.45, 5.1, "which requests run this round (vllm: all prefill or all decode)", fontsize=9)
    for i, (name, fill) in enumerate((("waiting", {0, 1}), ("running", {0, 1, 2}), ("swapped", {0}))):
        x = 0.6 + i * 2.2
        _box(ax, x, 3.75, 2.0, 1.1, name, f"box:{name}", face="#ffffff", size=9.5, pad=0.1)
        _cells(ax, x + 0.15, 3.9, 4, fill, "#80b1d3", f"queue:{name}")
    _box(ax, 0.6, 0.6, 6.4, 2.8, "BlockSpaceManager", "box:BlockSpaceManager", face="#ffffff", size=9)
    ax.text(0.8, 2.55, "block tables: s0→[0,3]  s1→[1,2]  s2→cpu[0]", fontsize=9, family="monospace")
    ax.text(0.8, 2.0, "GPU allocator: free list, ref counts", fontsize=9)
    ax.text(0.8, 1.55, "CPU allocator: swap space", fontsize=9)
    ax.text(0.8, 1.0, "can_allocate · append_slot (copy-on-write)\nfork · swap_out · swap_in · free", fontsize=8.5,
            color="#444", va="center")

    # Worker, with shadows for the tensor-parallel copies
    for k in (2, 1):
        _box(ax, wx + 0.14 * k, 0.3 - 0.14 * k, 7.0, 5.6, "", f"box:Worker-shadow{k}", face="#f7efe6",
             edge="#bbbbbb", lw=0.8)
    _box(ax, wx, 0.3, 7.0, 5.6, "Worker", "box:Worker", face="#fbf1e4", size=11)
    ax.text(wx + 0.15, 5.1, "runs the model; one per GPU (× tensor_parallel_size)", fontsize=9)
    _box(ax, wx + 0.3, 3.75, 6.4, 1.1, "model runner + Llama model", "box:model", face="#ffffff", size=9.5, pad=0.1)
    ax.text(wx + 0.4, 4.05, "prepare_inputs (packed, no padding) → 30 layers,\npaged attention reads K/V by "
            "block table → logits", fontsize=8.5, va="center")
    _box(ax, wx + 0.3, 0.6, 6.4, 2.8, "CacheEngine", "box:CacheEngine", face="#ffffff", size=9)
    ax.text(wx + 0.45, 2.55, "GPU [num_blocks, block_size, kv_heads, head_dim]", fontsize=8.5)
    _cells(ax, wx + 0.5, 2.0, 12, {0, 1, 2, 3}, "#fdb462", "cache:gpu")
    ax.text(wx + 0.45, 1.55, "CPU swap space", fontsize=8.5)
    _cells(ax, wx + 0.5, 1.0, 6, {0}, "#bebada", "cache:cpu")
    ax.text(wx + 3.0, 1.15, "swap_out · swap_in · copy", fontsize=8.5, color="#444")

    # One step's traffic
    _arrow(ax, (3.9, 7.2), (3.9, 5.95), "schedule()", "arrow:schedule", (3.1, 6.55))
    _arrow(ax, (7.35, 3.0), (wx - 0.05, 3.0), "metadata\n+ swap in/out\n+ copy orders",
           "arrow:orders", (8.45, 3.85))
    _arrow(ax, (wx + 3.2, 5.95), (8.7, 7.4), "logits of the\nsampled rows", "arrow:logits", (11.6, 6.55), rad=0.15)
    _arrow(ax, (6.9, 7.4), (5.4, 5.95), "new tokens,\nfinished → free", "arrow:tokens", (7.2, 6.55))

    if chapters:
        _badge(ax, 2.75, 9.45, CHAPTER_BADGES["LLMEngine"])
        _badge(ax, 2.7, 5.6, CHAPTER_BADGES["queues"])
        _badge(ax, 4.25, 3.05, CHAPTER_BADGES["BlockSpaceManager"])
        _badge(ax, wx + 5.5, 4.6, CHAPTER_BADGES["model"])
        _badge(ax, wx + 6.05, 4.6, CHAPTER_BADGES["attention"])
        _badge(ax, wx + 2.55, 3.05, CHAPTER_BADGES["CacheEngine"])
        _badge(ax, wx + 1.95, 5.6, CHAPTER_BADGES["Worker"])
    ax.set_xlim(-1.0, 18.0)
    ax.set_ylim(-0.2, 9.9)
    ax.set_aspect("equal")
    ax.axis("off")
    if title:
        ax.set_title(title, loc="left", fontsize=11)
    return ax.figure


def fig_architecture():
    return draw_architecture(title="The engine: the Scheduler decides, the Worker computes")


def fig_chapter_map():
    return draw_architecture(chapters=True, title="Where each chapter builds its part (red badges: chapter numbers)")
