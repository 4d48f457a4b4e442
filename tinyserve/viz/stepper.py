"""Step through something one step at a time in a notebook: play, prev, next and a slider.

``Stepper`` is the base of the book's steppers. A subclass says how many steps there are, what
each step's text is (``step_columns``) and how to draw it (``draw_step``); the base does the
controls, draws each step once (cached) and shows text and drawing together (``widget_view``).

``RoundStepper(records)`` is the one over scheduling rounds: it takes RoundRecords from
``sim.simulate`` or from the engine's ``history`` (whose records also carry the text each
request produced) and shows, for the chosen round, what happened (phase, batch, preemptions,
swaps, finished requests and the three queues) and a drawing of the queues and block tables
(``rounds.draw_round``).

The controls are attributes (``slider``, ``prev_button``, ``next_button``, ``play``) and what is
shown is ``view.value``, so a stepper can be driven and read without a browser, which is how the
tests check it.
"""

from __future__ import annotations

import abc
import html
from collections.abc import Sequence

import ipywidgets as widgets
import traitlets

from tinyserve.sim import RoundRecord
from tinyserve.viz import widget_view as wv
from tinyserve.viz.rounds import draw_round, request_colors

PLAY_TOOLTIP = "▶ play / ❚❚ pause · ■ stop (back to the start) · ⟲ repeat (loop at the end)"


class Stepper(abc.ABC):
    """Controls and one view over steps 1..n. Display it as the last expression of a cell."""

    noun = "step"                 # the slider's label, and how the text names a step
    text_spare_lines = 1          # lines of the text area beyond the longest step's, for values that wrap
    figsize = (9.0, 4.2)          # inches; shown at widget_view.DISPLAY_DPI pixels per inch

    def __init__(self, num_steps: int, draw: bool = True, interval_ms: int = 900,
                 extra_controls: Sequence[widgets.Widget] = ()) -> None:
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        self.draw = draw
        self.figure = None
        self._pngs: dict[tuple[int, float], bytes] = {}
        self.slider = widgets.IntSlider(value=1, min=1, max=num_steps, step=1, description=self.noun,
                                        continuous_update=False)
        # The Play widget's buttons are bare icons; its tooltip (no description, or the frontend
        # drops it) names them on hover.
        self.play = widgets.Play(value=1, min=1, max=num_steps, step=1, interval=interval_ms, tooltip=PLAY_TOOLTIP)
        # A kernel-side link, so Play drives the slider even without a browser in between.
        traitlets.link((self.play, "value"), (self.slider, "value"))
        self.prev_button = widgets.Button(description="◀ prev", tooltip=f"the previous {self.noun}",
                                          layout=widgets.Layout(width="80px"))
        self.next_button = widgets.Button(description="next ▶", tooltip=f"the next {self.noun}",
                                          layout=widgets.Layout(width="80px"))
        self.prev_button.on_click(lambda _: self.step(-1))
        self.next_button.on_click(lambda _: self.step(+1))
        self.view = widgets.HTML()
        self._text_lines: int | None = None
        self.slider.observe(lambda _: self._render(), names="value")
        self.widget = widgets.VBox([*extra_controls,
                                    widgets.HBox([self.play, self.prev_button, self.next_button, self.slider]),
                                    self.view])
        self.widget.add_class(wv.WIDGET_CLASS)
        self._render()

    # -- what a subclass provides ------------------------------------------------------------

    @property
    def num_steps(self) -> int:
        return self.slider.max

    @abc.abstractmethod
    def step_columns(self, index: int) -> list[list[tuple[str, str]]]:
        """The text of step ``index`` (0-based): columns of (label, HTML value) pairs."""

    @abc.abstractmethod
    def draw_step(self, index: int, fig) -> None:
        """Draw step ``index`` (0-based) into the empty matplotlib Figure ``fig``."""

    def step_title(self, index: int) -> str:
        """A few words naming the step (the picture's alt text; the saved view's caption)."""
        return f"{self.noun} {index + 1}"

    def text_lines(self) -> int:
        """The text area's height in lines: the most lines any step's column has, and
        ``text_spare_lines`` for values that wrap. Every step has it, so the picture stays put."""
        if self._text_lines is None:
            most = max(len(col) for i in range(self.num_steps) for col in self.step_columns(i))
            self._text_lines = most + self.text_spare_lines
        return self._text_lines

    def key_steps(self) -> list[int]:
        """The steps (0-based) worth a look; the base takes up to nine, evenly."""
        return wv.pick_steps(self.num_steps, range(self.num_steps))

    def key_frame(self) -> int:
        """The step (0-based) the saved view shows: the middle one of ``key_steps``."""
        steps = self.key_steps()
        return steps[len(steps) // 2]

    # -- stepping ----------------------------------------------------------------------------

    @property
    def index(self) -> int:
        """The step on show, 0-based."""
        return self.slider.value - 1

    def step(self, delta: int) -> None:
        self.slider.value = min(max(self.slider.value + delta, self.slider.min), self.slider.max)

    def reset_steps(self, num_steps: int) -> None:
        """Start over with ``num_steps`` steps (a subclass whose content changed calls this)."""
        self._pngs.clear()
        self._text_lines = None
        with self.slider.hold_trait_notifications():
            self.play.playing = False
            self.slider.value = 1
            self.slider.max = self.play.max = num_steps
        self._render()

    def png(self, index: int, dpi: float = wv.DISPLAY_DPI * wv.PIXEL_RATIO) -> bytes:
        """Step ``index`` drawn as PNG bytes (each step and size is drawn once)."""
        key = (index, dpi)
        if key not in self._pngs:
            # A Figure outside pyplot: nothing leaks into the notebook as a stray inline plot.
            from matplotlib.figure import Figure

            if self.figure is None:
                self.figure = Figure(figsize=self.figsize)
            self.figure.clear()
            self.draw_step(index, self.figure)
            self._pngs[key] = wv.render_png(self.figure, dpi)
        return self._pngs[key]

    def _render(self) -> None:
        i = self.index
        # Draw first, then publish text and picture in one value: they always show one step.
        png = self.png(i) if self.draw else None
        self.view.value = wv.step_html(i + 1, self.step_columns(i), png, self.step_title(i), self.text_lines())
        self.prev_button.disabled = self.slider.value == self.slider.min
        self.next_button.disabled = self.slider.value == self.slider.max

    # -- display -----------------------------------------------------------------------------

    def saved_figure(self):
        """The key frame, drawn for the saved view (``widget_view.legible_png`` makes it legible)."""
        from matplotlib.figure import Figure

        fig = Figure(figsize=self.figsize)
        self.draw_step(self.key_frame(), fig)
        return fig

    def caption(self) -> str:
        """The saved view's caption (HTML)."""
        n, k = self.num_steps, self.key_frame()
        return (f"<b>▶ run the cell</b> to step through the {n} {self.noun}{'s' if n != 1 else ''}; "
                f"the picture shows {html.escape(self.step_title(k))}")

    def __repr__(self) -> str:
        return f"{type(self).__name__} over {self.num_steps} {self.noun}s"

    def _repr_mimebundle_(self, **kwargs) -> dict:
        alt = self.step_title(self.key_frame())
        return wv.saved_bundle(self.widget, wv.legible_png(self.saved_figure()), self.caption(), alt, **kwargs)


# -- scheduling rounds --------------------------------------------------------------------------


def ids_html(ids: Sequence[str]) -> str:
    """Request ids as HTML text, "—" when there are none."""
    return html.escape(", ".join(ids)) if ids else "—"


def summary_lines(record: RoundRecord) -> list[tuple[str, str]]:
    """(label, value) pairs describing one round, in the order the stepper shows them."""
    lines = [
        ("round", str(record.round)),
        ("phase", record.phase),
        ("batch", ids_html(record.batch)),
        ("tokens in batch", str(record.num_batched_tokens)),
        ("preempted", ids_html(record.preempted)),
        ("swapped out", ids_html(record.swapped_out)),
        ("swapped in", ids_html(record.swapped_in)),
        ("finished", ids_html(record.finished)),
    ]
    if record.ignored:
        lines.append(("ignored", ids_html(record.ignored)))
    if record.tokens:
        lines.append(("produced", html.escape(", ".join(f"{k} → {v!r}" for k, v in record.tokens.items()))))
    return lines


def queue_lines(record: RoundRecord) -> list[tuple[str, str]]:
    return [("waiting", ids_html(record.waiting)), ("running", ids_html(record.running)),
            ("swapped", ids_html(record.swapped))]


class RoundStepper(Stepper):
    """A stepper over a list of RoundRecords, one round per step."""

    noun = "round"

    def __init__(self, records: Sequence[RoundRecord], draw: bool = True, interval_ms: int = 900) -> None:
        if not records:
            raise ValueError("records: RoundStepper needs at least one round")
        self.records = list(records)
        self.colors = request_colors(self.records)
        first = self.records[0]
        cols = max(4, min(16, max(first.num_gpu_blocks, first.num_cpu_blocks, 1)))
        rows = -(-first.num_gpu_blocks // cols) + (-(-first.num_cpu_blocks // cols) if first.num_cpu_blocks else 0)
        # The size draw_round's layout needs for this pool, so the drawing fills the picture.
        self.figsize = (0.5 * (max(cols, 9) + 7.5) + 0.3, 0.5 * (rows + 6) + 0.5)
        super().__init__(len(self.records), draw=draw, interval_ms=interval_ms)

    @property
    def record(self) -> RoundRecord:
        """The record of the round on show."""
        return self.records[self.index]

    def step_columns(self, index: int) -> list[list[tuple[str, str]]]:
        record = self.records[index]
        return [summary_lines(record), queue_lines(record)]

    def draw_step(self, index: int, fig) -> None:
        draw_round(self.records[index], ax=fig.add_subplot(), colors=self.colors)
        fig.subplots_adjust(left=0.01, right=0.99, bottom=0.01, top=0.93)

    def step_title(self, index: int) -> str:
        return f"round {self.records[index].round}"

    def key_steps(self) -> list[int]:
        # Rounds where something happens to a request, and the first rounds of the story.
        events = [i for i, r in enumerate(self.records)
                  if r.preempted or r.swapped_out or r.swapped_in or r.ignored or r.finished or i < 3]
        return wv.pick_steps(len(self.records), events)

    def key_frame(self) -> int:
        # The first preemption (or swap) is the moment the scheduler's rules show; else the middle.
        first = next((i for i, r in enumerate(self.records) if r.preempted or r.swapped_out), None)
        return first if first is not None else super().key_frame()
