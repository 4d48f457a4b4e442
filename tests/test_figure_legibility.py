"""Every registered figure can be read at the width a notebook or the README shows it.

A figure is saved as a PNG (``figures.save``: 110 dpi, tight box) and shown at most 900 px wide,
so a text of ``s`` points lands on screen at ``s · 110/72 · min(1, 900/png_width)`` px. The test
draws each figure, records the Text artists the renderer actually draws (tick labels outside the
view are never drawn, so they do not count), and asks of each figure:

- no drawn text below 10 px on screen (a mathtext superscript or subscript counts at the 0.7 size
  matplotlib shrinks it to);
- no legend box over the plotted data of its axes (line vertices and the segments between them,
  scatter points, bars and other patches, images), compared in display coordinates;
- no second y-axis on top of an axes (``twinx``): two quantities get two panels.
"""

from __future__ import annotations

import io
import struct

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from matplotlib.collections import Collection  # noqa: E402
from matplotlib.image import AxesImage  # noqa: E402
from matplotlib.legend import Legend  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402
from matplotlib.text import Text  # noqa: E402

from tinyserve.viz import figures  # noqa: E402

DISPLAY_WIDTH_PX = 900  # the widest a chapter or the README shows a figure
MIN_TEXT_PX = 10.0
SAVE_DPI = 110  # what figures.save uses
MATHTEXT_SHRINK = 0.7  # matplotlib's mathtext SHRINK_FACTOR for super- and subscripts


def png_width(fig) -> int:
    """The width in pixels of the PNG ``figures.save`` writes for ``fig``."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=SAVE_DPI, bbox_inches="tight")
    header = buf.getvalue()[:24]
    return struct.unpack(">I", header[16:20])[0]


def drawn_texts(fig) -> list[Text]:
    """The visible, non-empty Text artists a draw of ``fig`` renders."""
    seen: list[Text] = []
    original = Text.draw

    def recording_draw(self, renderer):
        if self.get_visible() and self.get_text().strip():
            seen.append(self)
        return original(self, renderer)

    Text.draw = recording_draw
    try:
        fig.canvas.draw()
    finally:
        Text.draw = original
    return list(dict.fromkeys(seen))


def effective_points(text: Text) -> float:
    """The point size of the smallest glyphs of ``text`` (scripts in mathtext shrink)."""
    size = text.get_fontsize()
    s = text.get_text()
    if s.count("$") >= 2 and ("^" in s or "_" in s):
        size *= MATHTEXT_SHRINK
    return size


def small_texts(fig) -> tuple[float, list[tuple[str, float]]]:
    """The display scale of ``fig`` and its drawn texts smaller than MIN_TEXT_PX on screen."""
    scale = min(1.0, DISPLAY_WIDTH_PX / png_width(fig))
    out = []
    for t in drawn_texts(fig):
        px = effective_points(t) * SAVE_DPI / 72 * scale
        if px < MIN_TEXT_PX - 1e-6:
            out.append((t.get_text(), round(px, 1)))
    return scale, out


def _segment_points(xy: np.ndarray, step: float = 2.0) -> np.ndarray:
    """Points every ``step`` display pixels along a polyline (its vertices included)."""
    xy = xy[np.isfinite(xy).all(axis=1)]
    if len(xy) < 2:
        return xy
    pts = [xy]
    for a, b in zip(xy[:-1], xy[1:], strict=True):
        n = int(np.hypot(*(b - a)) // step)
        if n > 1:
            t = np.linspace(0, 1, n)[1:-1, None]
            pts.append(a + t * (b - a))
    return np.concatenate(pts)


def _inside(points: np.ndarray, box) -> bool:
    if len(points) == 0:
        return False
    x, y = points[:, 0], points[:, 1]
    return bool(np.any((x > box.x0) & (x < box.x1) & (y > box.y0) & (y < box.y1)))


def _overlaps(a, b) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


def legend_hits(fig) -> list[str]:
    """Descriptions of plotted artists that a legend box covers, in display coordinates."""
    renderer = fig.canvas.get_renderer()
    hits = []
    for ax in fig.axes:
        legends = [c for c in ax.get_children() if isinstance(c, Legend) and c.get_visible()]
        if not legends:
            continue
        clip = ax.get_window_extent(renderer)
        for legend in legends:
            ext = legend.get_window_extent(renderer)
            box = ext.from_extents(ext.x0 + 1, ext.y0 + 1, ext.x1 - 1, ext.y1 - 1)  # touching is fine
            for artist in ax.get_children():
                if not artist.get_visible() or artist is ax.patch or isinstance(artist, Legend):
                    continue
                label = artist.get_label() or type(artist).__name__
                if isinstance(artist, Line2D):
                    xy = artist.get_transform().transform(artist.get_xydata())
                    xy = _segment_points(xy) if artist.get_linestyle() not in ("None", "") else xy
                    xy = xy[(xy[:, 0] >= clip.x0) & (xy[:, 0] <= clip.x1)
                            & (xy[:, 1] >= clip.y0) & (xy[:, 1] <= clip.y1)]
                    if _inside(xy, box):
                        hits.append(f"line {label!r}")
                elif isinstance(artist, Collection):
                    offsets = artist.get_offsets()
                    if len(offsets) and artist.get_offset_transform() is not None:
                        xy = artist.get_offset_transform().transform(offsets)
                        if _inside(xy, box):
                            hits.append(f"points {label!r}")
                            continue
                    for path in artist.get_paths():
                        ext = path.get_extents(artist.get_transform())
                        if ext.width > 0 and ext.height > 0 and _overlaps(ext, box) and _overlaps(ext, clip):
                            hits.append(f"collection {label!r}")
                            break
                elif isinstance(artist, Patch):
                    ext = artist.get_window_extent(renderer)
                    if ext.width > 0.5 and ext.height > 0.5 and _overlaps(ext, box) and _overlaps(ext, clip):
                        hits.append(f"patch {label!r}")
                elif isinstance(artist, AxesImage):
                    if _overlaps(artist.get_window_extent(renderer), box):
                        hits.append(f"image {label!r}")
    return hits


def twin_axes(fig) -> list[int]:
    """Indices of axes drawn on top of another axes at the same place, with a y-axis of their own."""
    shown = [ax for ax in fig.axes if ax.get_visible() and ax.axison]
    twins = []
    for i, a in enumerate(shown):
        for b in shown[:i]:
            if np.allclose(a.get_position().bounds, b.get_position().bounds) and a.yaxis.get_visible():
                twins.append(i)
                break
    return twins


def legibility_problems(fig) -> list[str]:
    """Everything that makes ``fig`` hard to read at its display width (empty when it passes)."""
    scale, small = small_texts(fig)
    problems = [f"text {s!r} is {px} px at {scale:.2f}× (png {round(DISPLAY_WIDTH_PX / scale)} px)"
                if scale < 1 else f"text {s!r} is {px} px" for s, px in small]
    problems += [f"legend covers {hit}" for hit in legend_hits(fig)]
    problems += [f"axes {i} is a second y-axis on another axes (twinx)" for i in twin_axes(fig)]
    return problems


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


@pytest.mark.parametrize("name", sorted(figures.REGISTRY))
def test_registered_figure_is_legible(name):
    problems = legibility_problems(figures.draw(name))
    assert not problems, f"{name}: " + "; ".join(problems[:8]) + (f" (+{len(problems) - 8} more)"
                                                                    if len(problems) > 8 else "")


# -- figures a chapter draws from viz functions without registering them --------------------------------------


def test_chapter_10_step_times_figure_is_legible():
    """``draw_tp_step_times`` as chapter 10 calls it, with times of the shape it measures (the
    second setup far off the others, which switches the axis to log)."""
    from tinyserve.viz.parallel import draw_tp_step_times

    for times in ({"k=1, 1 thread": {"prefill": 0.21, "decode": 0.031},
                   "k=2, 1 thread per rank": {"prefill": 0.15, "decode": 0.027},
                   "k=1, 2 threads": {"prefill": 0.12, "decode": 0.02}},
                  {"k=1, 1 thread": {"prefill": 0.21, "decode": 0.031},
                   "k=2, 1 thread per rank": {"prefill": 2.4, "decode": 0.6}}):
        assert legibility_problems(draw_tp_step_times(times)) == []


def test_chapter_00_token_timeline_is_legible():
    """Chapter 00 draws ``draw_token_timeline`` on its own figure, like ``09_seed_rounds`` but with
    whatever its run produced: here a simulator run of the seed preset with made-up token text."""
    import dataclasses

    from tinyserve import presets, sim
    from tinyserve.viz.engine import draw_token_timeline

    p = presets.seed_rounds("swap")
    records = sim.simulate(p.requests, p.scheduler_config, p.cache_config)
    records = [dataclasses.replace(r, tokens={rid: " capability"[: 2 + (r.round + i) % 10]
                                              for i, rid in enumerate(r.batch)}) for r in records]
    assert len(records) > 10  # long enough to wrap into bands
    assert legibility_problems(draw_token_timeline(records, title="s0, s1, s2 on the real engine")) == []


def test_chapter_12_chunked_timeline_on_its_own_axes_is_legible():
    """Chapter 12 draws the real engine's chunked rounds on a 10×3 figure of its own."""
    from tinyserve.lab.beyond_runs import chunked_run, long_prompt_requests
    from tinyserve.viz.beyond import draw_chunked_timeline

    lens = {r.request_id: r.output_len for r in long_prompt_requests()}
    fig, ax = plt.subplots(figsize=(10, 3))
    draw_chunked_timeline(chunked_run(True), lens, ax=ax, budget=32, title="chunked prefill, budget 32")
    assert legibility_problems(fig) == []


def test_chapter_05_watermark_timelines_are_legible():
    """Chapter 05's five arrivals on 10 blocks without and with a watermark: timelines of 32 and
    37 rounds, the widest the chapter draws."""
    from tinyserve import sim
    from tinyserve.config import CacheConfig, SchedulerConfig
    from tinyserve.viz.rounds import draw_preemption_runs

    few = [sim.Request(f"r{i}", 6, 14, arrival_round=1 + i) for i in range(5)]
    sched = SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=8, max_model_len=64, preemption_mode="recompute")
    runs = {f"watermark {wm}": sim.simulate(few, sched, CacheConfig(block_size=4, num_gpu_blocks=10,
                                                                      num_cpu_blocks=16, watermark=wm))
            for wm in (0.0, 0.3)}
    assert max(len(records) for records in runs.values()) > 30
    assert legibility_problems(draw_preemption_runs(runs, few)) == []


def test_chapter_05_compat_timelines_are_legible():
    """Chapter 05's seed example under tinyserve's rules and v0.4's, three timelines stacked."""
    from tinyserve import presets, sim
    from tinyserve.viz.rounds import draw_timelines

    runs = [(name, sim.simulate(p.requests, p.scheduler_config, p.cache_config))
            for name, p in (("tinyserve, swap", presets.seed_rounds("swap")),
                            ("v0.4, swap", presets.seed_rounds("swap", compat="vllm-0.4")),
                            ("v0.4, its default", presets.seed_rounds(None, compat="vllm-0.4")))]
    assert legibility_problems(draw_timelines(runs)) == []


def test_chapter_05_abort_rounds_are_legible():
    """Chapter 05 draws two states of the seed example's pools (before and after the aborts) with
    ``draw_round_panels``; here two rounds of the swap run, with the same pools and a swapped request."""
    from tinyserve import presets, sim
    from tinyserve.viz.rounds import draw_round_panels

    p = presets.seed_rounds("swap")
    records = sim.simulate(p.requests, p.scheduler_config, p.cache_config)
    assert records[2].num_cpu_blocks and records[2].swapped
    fig = draw_round_panels([("after round 3, with s2 swapped out", records[2]),
                             ("after round 12", records[11])])
    assert legibility_problems(fig) == []


def test_chapter_11_decode_cost_is_legible():
    """``draw_decode_cost`` with step times of the shape chapter 11 measures (the small batches
    noisy, so the line is not monotone)."""
    from tinyserve.viz.performance import draw_decode_cost

    for step_ms in ([73, 122, 97, 138, 193], [73, 75, 80, 96, 140], [200, 150, 160, 180, 210]):
        assert legibility_problems(draw_decode_cost([1, 4, 8, 16, 32], step_ms)) == []


# -- the measure itself catches what it should --------------------------------------------------------------


def test_measure_flags_small_text_on_a_wide_figure():
    fig, ax = plt.subplots(figsize=(16, 3))
    ax.plot([0, 1], [0, 1])
    ax.set_title("tiny", fontsize=7)
    assert any(s == "tiny" for s, _ in small_texts(fig)[1])
    fig2, ax2 = plt.subplots(figsize=(6, 3))
    ax2.plot([0, 1], [0, 1])
    ax2.set_title("readable", fontsize=10)
    ax2.tick_params(labelsize=9)
    assert small_texts(fig2)[1] == []


def test_measure_flags_a_legend_on_the_data_and_not_one_beside_it():
    fig, ax = plt.subplots(figsize=(6, 3))
    x = np.linspace(0, 1, 50)
    ax.plot(x, np.full_like(x, 0.9), label="top")
    ax.plot(x, x * 0.1, label="bottom")
    ax.set_ylim(0, 1)
    ax.legend(loc="upper center")
    assert any("top" in h for h in legend_hits(fig))
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1))
    assert legend_hits(fig) == []


def test_measure_flags_twinx():
    fig, ax = plt.subplots()
    ax.plot([0, 1], [0, 1])
    ax.twinx().plot([0, 1], [5, 3])
    assert twin_axes(fig) == [1]
    fig2, (a, b) = plt.subplots(2, 1, sharex=True)
    assert twin_axes(fig2) == []
