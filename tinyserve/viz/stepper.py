"""Step through scheduling rounds in a notebook: buttons, a round slider, text and a drawing.

``RoundStepper(records)`` takes RoundRecords from ``sim.simulate`` or from the engine's
``history`` (whose records also carry the text each request produced) and shows, for the
chosen round, what happened as text (phase, batch, preemptions, swaps, finished requests and
the three queues) and as a drawing of the queues and block tables (``rounds.draw_round``).

The widgets are attributes (``slider``, ``prev_button``, ``next_button``, ``play``,
``summary``, ``queues_html``, ``image``), so it can be driven and read without a browser,
which is how the tests check it.
"""

from __future__ import annotations

import html
import io
from collections.abc import Sequence

import ipywidgets as widgets
import traitlets

from tinyserve.sim import RoundRecord
from tinyserve.viz.rounds import draw_round, request_colors


def _ids(ids: Sequence[str]) -> str:
    return html.escape(", ".join(ids)) if ids else "—"


def summary_lines(record: RoundRecord) -> list[tuple[str, str]]:
    """(label, value) pairs describing one round, in the order the stepper shows them."""
    lines = [
        ("round", str(record.round)),
        ("phase", record.phase),
        ("batch", _ids(record.batch)),
        ("tokens in batch", str(record.num_batched_tokens)),
        ("preempted", _ids(record.preempted)),
        ("swapped out", _ids(record.swapped_out)),
        ("swapped in", _ids(record.swapped_in)),
        ("finished", _ids(record.finished)),
    ]
    if record.ignored:
        lines.append(("ignored", _ids(record.ignored)))
    if record.tokens:
        lines.append(("produced", html.escape(", ".join(f"{k} → {v!r}" for k, v in record.tokens.items()))))
    return lines


def queue_lines(record: RoundRecord) -> list[tuple[str, str]]:
    return [("waiting", _ids(record.waiting)), ("running", _ids(record.running)), ("swapped", _ids(record.swapped))]


def _as_html(lines: list[tuple[str, str]]) -> str:
    return "".join(f"<div><b>{label}</b>: {value}</div>" for label, value in lines)


class RoundStepper:
    """A widget over a list of RoundRecords. Display it as the last expression of a cell."""

    def __init__(self, records: Sequence[RoundRecord], draw: bool = True, interval_ms: int = 900) -> None:
        if not records:
            raise ValueError("RoundStepper needs at least one round")
        self.records = list(records)
        self.draw = draw
        self.colors = request_colors(self.records)
        n = len(self.records)
        self.slider = widgets.IntSlider(value=1, min=1, max=n, step=1, description="round",
                                        continuous_update=False)
        self.play = widgets.Play(value=1, min=1, max=n, step=1, interval=interval_ms, description="play")
        # A kernel-side link, so Play drives the slider even without a browser in between.
        traitlets.link((self.play, "value"), (self.slider, "value"))
        self.prev_button = widgets.Button(description="◀ prev", layout=widgets.Layout(width="80px"))
        self.next_button = widgets.Button(description="next ▶", layout=widgets.Layout(width="80px"))
        self.prev_button.on_click(lambda _: self.step(-1))
        self.next_button.on_click(lambda _: self.step(+1))
        self.summary = widgets.HTML(layout=widgets.Layout(margin="0 40px 0 0"))
        self.queues_html = widgets.HTML()
        self.image = widgets.Image(format="png")
        self.figure = None
        self.slider.observe(self._on_round, names="value")
        self.widget = widgets.VBox([
            widgets.HBox([self.play, self.prev_button, self.next_button, self.slider]),
            widgets.HBox([self.summary, self.queues_html]),
            self.image,
        ])
        self._render()

    @property
    def record(self) -> RoundRecord:
        """The record of the round on show."""
        return self.records[self.slider.value - 1]

    def step(self, delta: int) -> None:
        self.slider.value = min(max(self.slider.value + delta, self.slider.min), self.slider.max)

    def _on_round(self, _change) -> None:
        self._render()

    def _render(self) -> None:
        record = self.record
        self.summary.value = _as_html(summary_lines(record))
        self.queues_html.value = _as_html(queue_lines(record))
        self.prev_button.disabled = self.slider.value == self.slider.min
        self.next_button.disabled = self.slider.value == self.slider.max
        if self.draw:
            self.image.value = self._png(record)

    def _png(self, record: RoundRecord) -> bytes:
        # A Figure outside pyplot: nothing leaks into the notebook as a stray inline plot.
        from matplotlib.figure import Figure

        if self.figure is None:
            self.figure = Figure(figsize=(9, 4.2))
        self.figure.clear()
        draw_round(record, ax=self.figure.add_subplot(), colors=self.colors)
        buf = io.BytesIO()
        self.figure.savefig(buf, format="png", dpi=90, bbox_inches="tight")
        return buf.getvalue()

    # -- display ---------------------------------------------------------------------------

    def __repr__(self) -> str:
        r = self.record
        return (f"RoundStepper over {len(self.records)} rounds (showing round {r.round}: {r.phase}, "
                f"batch [{', '.join(r.batch)}]); run the notebook to step through them")

    def _repr_mimebundle_(self, **kwargs) -> dict:
        bundle = self.widget._repr_mimebundle_(**kwargs) or {}
        # Saved notebooks drop the widget state; this text is what a reader then sees.
        bundle["text/plain"] = repr(self)
        return bundle
