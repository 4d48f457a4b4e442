"""How the book's widgets show what they show: text and picture in one piece, sharp, and saved.

Three rules, shared by every widget of the book:

- **Sharp at its displayed size.** A drawing is rendered at ``PIXEL_RATIO`` times the pixels it
  is shown at (``DISPLAY_DPI`` CSS pixels per inch of figure), and the ``<img>`` is given that
  CSS size, so the browser only ever shrinks it (HiDPI screens use the extra pixels), never
  stretches it.
- **Text and picture never disagree.** A step's text and its ``<img>`` go to the browser as one
  HTML value (``step_html``), so no frontend can show one step's text beside another's picture,
  not even while a Play widget runs faster than the kernel draws.
- **A saved view for readers who do not run the notebook.** ``saved_bundle`` returns the live
  widget view together with an ``image/png`` filmstrip (``filmstrip``: several steps in one
  image) and a text line. Committed notebooks keep the PNG and the text (``make book`` drops
  the widget state), so GitHub and nbviewer show the steps instead of a line of text.
"""

from __future__ import annotations

import base64
import html
import io
import struct
from collections.abc import Sequence

DISPLAY_DPI = 80       # CSS pixels per inch of figure, as the widget shows a drawing
PIXEL_RATIO = 2        # rendered at twice that many pixels, so it stays sharp
FILMSTRIP_DPI = 64     # one panel of the saved filmstrip (a static image, shown as it is)
FILMSTRIP_MAX_WIDTH = 1700  # pixels: panels per row are chosen to stay within this
WIDGET_CLASS = "tinyserve-widget"  # every widget's outer box has it (the browser test looks for it)


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


def img_html(png: bytes, alt: str, pixel_ratio: int = PIXEL_RATIO) -> str:
    """An ``<img>`` shown at 1/``pixel_ratio`` of its pixel size (it may shrink to fit a narrow
    page, keeping its proportions, but it is never stretched)."""
    w, h = png_size(png)
    cw, ch = w // pixel_ratio, h // pixel_ratio
    data = base64.b64encode(png).decode("ascii")
    return (f'<img src="data:image/png;base64,{data}" alt="{html.escape(alt)}" width="{cw}" height="{ch}" '
            f'style="width:{cw}px;height:auto;max-width:100%">')


def fields_html(lines: Sequence[tuple[str, str]]) -> str:
    """(label, value) pairs as ``<div><b>label</b>: value</div>`` lines; values are HTML already."""
    return "".join(f"<div><b>{html.escape(label)}</b>: {value}</div>" for label, value in lines)


def step_html(step: int, columns: Sequence[Sequence[tuple[str, str]]], png: bytes | None, alt: str) -> str:
    """One step of a widget as one HTML value: its text in columns, then its drawing.

    The outer ``div`` carries ``data-step``, and the image's ``alt`` names the same step, which is
    how a test (headless or in the browser) checks that text and picture agree."""
    cols = "".join(f'<div style="margin-right:40px">{fields_html(col)}</div>' for col in columns)
    picture = img_html(png, alt) if png is not None else ""
    return (f'<div class="tinyserve-step" data-step="{step}">'
            f'<div style="display:flex;flex-wrap:wrap;margin-bottom:6px">{cols}</div>{picture}</div>')


def filmstrip(pngs: Sequence[bytes], max_width: int = FILMSTRIP_MAX_WIDTH, gap: int = 8) -> bytes:
    """Several PNGs of one size (or not) laid out in rows on white, as one PNG."""
    from PIL import Image  # Pillow comes with matplotlib

    if not pngs:
        raise ValueError("pngs: a filmstrip needs at least one image")
    panels = [Image.open(io.BytesIO(p)).convert("RGB") for p in pngs]
    pw = max(p.width for p in panels)
    ph = max(p.height for p in panels)
    ncols = max(1, min(len(panels), (max_width + gap) // (pw + gap)))
    nrows = -(-len(panels) // ncols)
    sheet = Image.new("RGB", (ncols * pw + (ncols - 1) * gap, nrows * ph + (nrows - 1) * gap), "white")
    for i, p in enumerate(panels):
        r, c = divmod(i, ncols)
        sheet.paste(p, (c * (pw + gap), r * (ph + gap)))
    buf = io.BytesIO()
    sheet.save(buf, format="PNG", optimize=True)
    return buf.getvalue()


def saved_bundle(widget, still_png: bytes, text: str, **kwargs) -> dict:
    """A mime bundle with the live widget view, a still picture and a line of text.

    A live frontend shows the widget; one without the widget's state (a committed notebook on
    GitHub or nbviewer, a JupyterLab without a kernel) shows the picture."""
    bundle = dict(widget._repr_mimebundle_(**kwargs) or {})
    bundle["image/png"] = base64.b64encode(still_png).decode("ascii")
    bundle["text/plain"] = text
    return bundle


def pick_steps(num_steps: int, wanted: Sequence[int], limit: int = 9) -> list[int]:
    """Up to ``limit`` step indices for a filmstrip: the ``wanted`` ones (0-based; the first and
    the last step are always added), thinned evenly when there are too many."""
    chosen = sorted({0, num_steps - 1, *(i for i in wanted if 0 <= i < num_steps)})
    if len(chosen) <= limit:
        return chosen
    picks = {chosen[round(k * (len(chosen) - 1) / (limit - 1))] for k in range(limit)}
    return sorted(picks)
