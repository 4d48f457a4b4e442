"""How the book's widgets show what they show: text and picture in one piece, sharp, and saved.

Three rules, shared by every widget of the book:

- **Sharp at its displayed size.** A drawing is rendered at ``PIXEL_RATIO`` times the pixels it
  is shown at (``DISPLAY_DPI`` CSS pixels per inch of figure), and the ``<img>`` is given that
  CSS size, so the browser only ever shrinks it (HiDPI screens use the extra pixels), never
  stretches it.
- **Text and picture never disagree.** A step's text and its ``<img>`` go to the browser as one
  HTML value (``step_html``), so no frontend can show one step's text beside another's picture,
  not even while a Play widget runs faster than the kernel draws.
- **A saved view for readers without the widget's kernel.** ``saved_bundle`` returns the live
  widget view together with a static one (``saved_html``): one key frame, drawn so that no text
  is under ``SAVED_MIN_PT`` points when the picture is shown ``SAVED_WIDTH`` pixels wide
  (``legible_png``), under a caption that says to run the cell. A saved widget view outlives
  its kernel's model: reopened, JupyterLab would show "Error displaying widget: model not
  found" in its place. So nothing saves one: ``make book`` drops them (``drop_widget_views``),
  and so does the Jupyter server of the project's .venv whenever a reader's notebook is saved,
  through this module's server extension (``pre_save_hook``; ``make venv`` enables it).
"""

from __future__ import annotations

import base64
import html
import io
import re
import struct
from collections.abc import Sequence

DISPLAY_DPI = 80       # CSS pixels per inch of figure, as the widget shows a drawing
PIXEL_RATIO = 2        # rendered at twice that many pixels, so it stays sharp
SAVED_WIDTH = 900      # CSS pixels: the widest the saved picture is shown (narrower ones at their size)
SAVED_MIN_PT = 8       # the smallest text of the saved picture, in points, as it is shown
CSS_PX_PER_INCH = 96   # a CSS inch: a figure shown this many pixels per inch shows its text at its size
SAVED_PAD_IN = 0.08    # inches of white around the saved picture, cropped to what is drawn
WIDGET_VIEW_MIME = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE_MIME = "application/vnd.jupyter.widget-state+json"
WIDGET_CLASS = "tinyserve-widget"  # every widget's outer box has it (the browser test looks for it)
TEXT_LINE_EM = 1.4     # one line of a widget's text, in em (the widget CSS's own lines are 28 px)


def render_png(fig, dpi: float) -> bytes:
    """The figure as PNG bytes, at a fixed size (no tight bounding box, so every step of a
    widget has the same size and the page does not jump while stepping)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, facecolor="white")
    return buf.getvalue()


def png_size(png: bytes) -> tuple[int, int]:
    """(width, height) in pixels, read from the PNG header."""
    if png[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError("png: not a PNG image")
    return struct.unpack(">II", png[16:24])


def img_html(png: bytes, alt: str, pixel_ratio: int = PIXEL_RATIO, max_width: int | None = None) -> str:
    """An ``<img>`` shown at 1/``pixel_ratio`` of its pixel size, or ``max_width`` CSS pixels wide
    if that is less (it may shrink to fit a narrow page, keeping its proportions, but it is never
    stretched)."""
    w, h = png_size(png)
    cw = w // pixel_ratio if max_width is None else min(max_width, w // pixel_ratio)
    ch = round(h * cw / w)
    data = base64.b64encode(png).decode("ascii")
    return (f'<img src="data:image/png;base64,{data}" alt="{html.escape(alt)}" width="{cw}" height="{ch}" '
            f'style="width:{cw}px;height:auto;max-width:100%">')


def fields_html(lines: Sequence[tuple[str, str]]) -> str:
    """(label, value) pairs as ``<div><b>label</b>: value</div>`` lines; values are HTML already."""
    return "".join(f"<div><b>{html.escape(label)}</b>: {value}</div>" for label, value in lines)


def step_html(step: int, columns: Sequence[Sequence[tuple[str, str]]], png: bytes | None, alt: str,
              text_lines: int | None = None) -> str:
    """One step of a widget as one HTML value: its text in columns, then its drawing.

    The outer ``div`` carries ``data-step``, and the image's ``alt`` names the same step, which is
    how a test (headless or in the browser) checks that text and picture agree. The columns stand
    side by side and never wrap under one another; with ``text_lines`` the text area is exactly
    that many lines tall (``text_height_em``; a step with more scrolls inside it), so the picture
    under it stays put from step to step."""
    cols = "".join(f'<div class="tinyserve-column" style="margin-right:40px;flex:0 1 auto;min-width:0">'
                   f"{fields_html(col)}</div>" for col in columns)
    height = f"height:{text_height_em(text_lines)}em;overflow-y:auto;" if text_lines else ""
    picture = img_html(png, alt) if png is not None else ""
    return (f'<div class="tinyserve-step" data-step="{step}">'
            f'<div class="tinyserve-text" style="display:flex;flex-wrap:nowrap;align-items:flex-start;{height}'
            f'line-height:{TEXT_LINE_EM};margin-bottom:6px">{cols}</div>{picture}</div>')


def text_height_em(lines: int) -> float:
    """The height of a widget's text area of ``lines`` lines, in em of its own font."""
    return round(lines * TEXT_LINE_EM, 2)


def saved_img_width(width_in: float) -> int:
    """The CSS width a saved picture this many inches wide is shown at."""
    return round(min(SAVED_WIDTH, width_in * CSS_PX_PER_INCH))


def saved_scale(width_in: float) -> float:
    """How many points a point of text is, once a saved picture this many inches wide is shown."""
    return saved_img_width(width_in) / (width_in * CSS_PX_PER_INCH)


def make_legible(fig, width_in: float | None = None, min_pt: float = SAVED_MIN_PT) -> None:
    """Raise every text of ``fig`` that its saved picture (``width_in`` wide, else the figure's
    width) would show under ``min_pt`` points to that size."""
    from matplotlib.text import Text

    # 1% above: the picture's width is rounded to whole pixels, which may shrink it a little.
    need = 1.01 * min_pt / saved_scale(width_in or fig.get_figwidth())
    for ax in fig.axes:
        # Tick labels through their axis, so that ticks made at drawing time get the size too.
        for name, axis in (("x", ax.xaxis), ("y", ax.yaxis)):
            if any(t.get_text() and t.get_fontsize() < need for t in axis.get_ticklabels(which="both")):
                ax.tick_params(axis=name, which="both", labelsize=need)
    for text in fig.findobj(Text):
        if text.get_text() and text.get_fontsize() < need:
            text.set_fontsize(need)


def drawn_width(fig) -> float:
    """Inches from the leftmost to the rightmost thing drawn (a legend may stick out), padded."""
    return fig.get_tightbbox().width + 2 * SAVED_PAD_IN


def legible_png(fig) -> bytes:
    """``fig`` as a saved picture: cropped to what is drawn, no text under ``SAVED_MIN_PT`` points
    once shown (at ``saved_img_width``), and ``PIXEL_RATIO`` pixels per CSS pixel. The PNG
    records its dpi, so its width in inches can be read back from it."""
    width = fig.get_figwidth()
    for _ in range(5):  # larger text may stick out further (a legend beside the axes): again
        make_legible(fig, width)
        drawn = drawn_width(fig)
        if drawn <= width + 0.01:
            break
        width = drawn
    width = drawn
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=PIXEL_RATIO * saved_img_width(width) / width, facecolor="white",
                bbox_inches="tight", pad_inches=SAVED_PAD_IN)
    return buf.getvalue()


def saved_html(png: bytes | None, caption: str, alt: str) -> str:
    """The static view of a widget: a caption (HTML), then its key frame.

    Plain HTML with the picture inline, which JupyterLab (trusted or not: its sanitizer keeps
    ``data:`` images), nbviewer and GitHub all show; the browser test finds it by its classes."""
    picture = img_html(png, alt, max_width=SAVED_WIDTH) if png is not None else ""
    return (f'<div class="tinyserve-fallback"><div class="tinyserve-caption" style="margin:2px 0 6px">'
            f"{caption}</div>{picture}</div>")


def saved_bundle(widget, png: bytes | None, caption: str, alt: str, **kwargs) -> dict:
    """A mime bundle with the live widget view and the static one (``saved_html``).

    A live frontend shows the widget; one without the widget's model (a committed notebook on
    GitHub or nbviewer, JupyterLab after the kernel is gone) shows the static view. ``text/plain``
    carries the caption's words, for a terminal."""
    bundle = dict(widget._repr_mimebundle_(**kwargs) or {})
    bundle["text/html"] = saved_html(png, caption, alt)
    bundle["text/plain"] = html.unescape(re.sub(r"<[^>]+>", "", caption))
    return bundle


def drop_widget_views(nb: dict) -> int:
    """Drop every widget view of a notebook (a dict, as saved) that could not be shown again
    without its kernel, and say how many. A view is kept where the notebook saved its model's
    state (JupyterLab's "save widget state"), or where it is an output's only content."""
    saved = nb.get("metadata", {}).get("widgets", {}).get(WIDGET_STATE_MIME, {}).get("state", {})
    dropped = 0
    for cell in nb.get("cells", []):
        for out in cell.get("outputs", []) if cell.get("cell_type") == "code" else []:
            data = out.get("data") or {}
            view = data.get(WIDGET_VIEW_MIME)
            if view is None or len(data) == 1:
                continue
            if isinstance(view, dict) and view.get("model_id") in saved:
                continue
            del data[WIDGET_VIEW_MIME]
            dropped += 1
    return dropped


def pre_save_hook(model: dict, **kwargs) -> None:
    """The Jupyter server's hook before it writes a file: a notebook loses its widget views."""
    if model.get("type") == "notebook" and isinstance(model.get("content"), dict):
        drop_widget_views(model["content"])


def _jupyter_server_extension_points() -> list[dict]:
    return [{"module": "tinyserve.viz.widget_view"}]


def _load_jupyter_server_extension(serverapp) -> None:
    """Jupyter server extension, enabled in the .venv by ``make venv``, which installs
    ``jupyter/jupyter_server_config.d/tinyserve.json``."""
    serverapp.contents_manager.register_pre_save_hook(pre_save_hook)


def pick_steps(num_steps: int, wanted: Sequence[int], limit: int = 9) -> list[int]:
    """Up to ``limit`` key step indices (the saved view shows one of them): the ``wanted`` ones
    (0-based; the first and the last step are always added), thinned evenly when there are too many."""
    chosen = sorted({0, num_steps - 1, *(i for i in wanted if 0 <= i < num_steps)})
    if len(chosen) <= limit:
        return chosen
    picks = {chosen[round(k * (len(chosen) - 1) / (limit - 1))] for k in range(limit)}
    return sorted(picks)
