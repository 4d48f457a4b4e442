"""Chapter 05's what-if explorer: move a slider, the scheduler runs the workload again.

``WhatIfExplorer()`` has sliders for the number of GPU blocks, the watermark and the token
budget of a round, and a toggle for the preemption mode. Every change re-simulates the workload
with the real scheduler (``lab.whatif.explore``) and redraws its timeline: one row per request,
one column per round, preemptions in red, with the tokens each round computed underneath, and
the counts (rounds, preemptions, tokens computed again, blocks swapped) beside it.

The x-axis is fixed before the reader moves anything: it spans the longest run over the edge of
the sliders' ranges where the cache is smallest (``lab.whatif.longest_run``), so two settings'
timelines compare by eye. (For the book's workload an exhaustive sweep of all 11,484 settings
finds none longer; a run that were longer would widen the axis rather than be cut off.)
"""

from __future__ import annotations

import html

import ipywidgets as widgets

from tinyserve.lab.records import request_order, request_states
from tinyserve.lab.whatif import WhatIfOutcome, WhatIfSettings, explore, longest_run, whatif_workload
from tinyserve.sim import Request
from tinyserve.viz import widget_view as wv
from tinyserve.viz.style import STATES

MODES = {"recompute": "recompute", "swap": "swap", "vLLM's rule": None}
MODE_TIPS = {"recompute": "free a preempted request's blocks; prefill all its tokens again later",
             "swap": "copy a preempted request's blocks to the CPU; copy them back later",
             "vLLM's rule": "recompute a request of one sequence, swap a group of several"}
TEXT_LINES = 5  # the text area: four lines a column, and one for a value that wraps
FIGSIZE = (10.5, 4.4)


def draw_whatif(outcome: WhatIfOutcome, fig, title: str = "", max_rounds: int | None = None) -> None:
    """The outcome's timeline (requests x rounds, colored by state) over its tokens per round,
    on an x-axis of ``max_rounds`` rounds (or the run's own length, if longer). A request the
    scheduler dropped (ignored) is marked × in the round it was dropped."""
    import numpy as np
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    records, s = outcome.records, outcome.settings
    ids = request_order(records)
    names = list(STATES)
    grid = np.full((len(ids), len(records)), np.nan)
    for col, states in enumerate(request_states(records)):
        for rid, state in states.items():
            grid[ids.index(rid), col] = names.index(state)
    ax, ax_t = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [len(ids) + 1, 2.2]})
    ax.imshow(grid, aspect="auto", interpolation="nearest", cmap=ListedColormap([STATES[n][0] for n in names]),
              vmin=-0.5, vmax=len(names) - 0.5, extent=(0.5, len(records) + 0.5, len(ids) - 0.5, -0.5))
    done = {rid: r.round for r in records for rid in r.finished}
    ax.scatter([done[rid] for rid in ids if rid in done], [i for i, rid in enumerate(ids) if rid in done],
               marker="|", s=40, color="black", linewidths=1.2)
    dropped = {rid: r.round for r in records for rid in r.ignored}
    ax.scatter([dropped[rid] for rid in ids if rid in dropped], [i for i, rid in enumerate(ids) if rid in dropped],
               marker="x", s=28, color="white", linewidths=1.4)
    ax.set_yticks(range(len(ids)), ids, fontsize=8)
    used = {st for states in request_states(records) for st in states.values()}
    ax.legend([Patch(facecolor=STATES[n][0]) for n in names if n in used],
              [STATES[n][1].split(" (")[0].split(":")[0] for n in names if n in used],
              loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=7, frameon=False,
              title="| last token" + ("\n× dropped unfinished" if dropped else ""), title_fontsize=7)
    ax.set_title(title or (f"{s.num_gpu_blocks} GPU blocks · watermark {s.watermark:g} · "
                           f"{s.max_num_batched_tokens} tokens per round · preemption: "
                           f"{s.preemption_mode or 'vLLM rule'}\n{outcome.summary()}"), loc="left", fontsize=8.5)
    ax_t.bar([r.round for r in records], [r.num_batched_tokens for r in records], width=1.0, color="#888888")
    ax_t.axhline(s.max_num_batched_tokens, color="#e15759", lw=0.8, ls="--")
    ax_t.set_ylabel("tokens", fontsize=8)
    ax_t.set_xlabel("round", fontsize=8)
    ax_t.set_xlim(0.5, max(max_rounds or 0, len(records)) + 0.5)
    ax_t.tick_params(labelsize=7)
    fig.subplots_adjust(left=0.05, right=0.84, top=0.88, bottom=0.11, hspace=0.08)


def slider_values(slider) -> list[float]:
    """Every value a slider offers, min to max (rounded as its readout shows them)."""
    count = round((slider.max - slider.min) / slider.step)
    return [round(slider.min + k * slider.step, 6) for k in range(count + 1)]


def ignored_html(outcome: WhatIfOutcome) -> str:
    """Who the scheduler dropped, and why, as the picture shows it: a request preempted by
    recompute comes back as a prompt of all its tokens, and once that needs more blocks than the
    cache has it is ignored, after rounds of running; only a prompt too long from the start never ran."""
    ran = outcome.ran_then_ignored
    never = [rid for rid in outcome.ignored if rid not in ran]
    parts = []
    if ran:
        parts.append(f"{', '.join(ran)} after running: back from preemption, too long for the whole cache")
    if never:
        parts.append(f"{', '.join(never)} never ran: its prompt is too long")
    return html.escape("; ".join(parts)) or "—"


class WhatIfExplorer:
    """Sliders and a toggle over ``WhatIfSettings``; ``requests`` default to ``whatif_workload()``."""

    def __init__(self, requests: list[Request] | None = None, settings: WhatIfSettings | None = None,
                 draw: bool = True) -> None:
        self.requests = list(requests) if requests is not None else whatif_workload()
        start = settings or WhatIfSettings()
        self.base = start
        self.draw = draw
        self.figure = None
        # The same requests with room for everything: what the counts are measured against.
        self.unconstrained = explore(self.requests, start.but(num_gpu_blocks=1024, watermark=0.0,
                                                              max_num_batched_tokens=max(1024, start.max_model_len)))
        style = {"description_width": "150px"}
        wide = widgets.Layout(width="480px")
        self.gpu_blocks = widgets.IntSlider(value=start.num_gpu_blocks, min=8, max=64, step=2, description="GPU blocks",
                                            continuous_update=False, style=style, layout=wide)
        self.watermark = widgets.FloatSlider(value=start.watermark, min=0.0, max=0.5, step=0.05,
                                             description="watermark", continuous_update=False, style=style,
                                             layout=wide, readout_format=".2f")
        self.token_budget = widgets.IntSlider(value=start.max_num_batched_tokens, min=8, max=96, step=8,
                                              description="tokens per round", continuous_update=False, style=style,
                                              layout=wide)
        mode = next(k for k, v in MODES.items() if v == start.preemption_mode)
        self.mode = widgets.ToggleButtons(options=list(MODES), value=mode, description="preemption",
                                          style=style, tooltips=list(MODE_TIPS.values()))
        self.view = widgets.HTML()
        for control in (self.gpu_blocks, self.watermark, self.token_budget, self.mode):
            control.observe(lambda _: self._render(), names="value")
        self.widget = widgets.VBox([self.gpu_blocks, self.watermark, self.token_budget, self.mode, self.view])
        self.widget.add_class(wv.WIDGET_CLASS)
        self.outcome: WhatIfOutcome | None = None
        self.error: str | None = None
        self._render()

    @property
    def settings(self) -> WhatIfSettings:
        return self.base.but(num_gpu_blocks=self.gpu_blocks.value, watermark=round(self.watermark.value, 2),
                             max_num_batched_tokens=self.token_budget.value, preemption_mode=MODES[self.mode.value])

    def columns(self, outcome: WhatIfOutcome) -> list[list[tuple[str, str]]]:
        best, s = self.unconstrained, outcome.settings
        mode = s.preemption_mode or "vLLM's rule (recompute a single sequence, swap a group)"
        return [[
            ("setting", f"{s.num_gpu_blocks} GPU blocks, watermark {s.watermark:g}, "
                        f"{s.max_num_batched_tokens} tokens per round"),
            ("preemption", html.escape(mode)),
            ("rounds to finish", f"{outcome.rounds} (with room for everything: {best.rounds})"),
            ("preemptions", str(outcome.preemptions)),
        ], [
            ("tokens computed again", str(outcome.recomputed_tokens)),
            ("blocks swapped out / in", f"{outcome.swapped_out_blocks} / {outcome.swapped_in_blocks}"),
            ("ignored (dropped unfinished)", ignored_html(outcome)),
            ("tokens spent on ignored requests", str(outcome.wasted_tokens)),
        ]]

    def png(self, outcome: WhatIfOutcome, dpi: float = wv.DISPLAY_DPI * wv.PIXEL_RATIO, title: str = "") -> bytes:
        from matplotlib.figure import Figure

        if self.figure is None:
            self.figure = Figure(figsize=FIGSIZE)
        self.figure.clear()
        draw_whatif(outcome, self.figure, title, self.max_rounds())
        return wv.render_png(self.figure, dpi)

    def max_rounds(self) -> int:
        """The x-axis of every timeline: the longest run where the cache is smallest, over every
        watermark, token budget and preemption mode the controls offer."""
        blocks = self.gpu_blocks.min
        # Watermarks that keep the same whole number of blocks free behave alike: one of each.
        watermarks = {int(w * blocks): w for w in reversed(slider_values(self.watermark))}.values()
        edge = [self.base.but(num_gpu_blocks=blocks, watermark=w, max_num_batched_tokens=t, preemption_mode=m)
                for w in sorted(watermarks) for t in slider_values(self.token_budget) for m in MODES.values()]
        return longest_run(self.requests, edge)

    def _render(self) -> None:
        settings = self.settings
        alt = (f"{settings.num_gpu_blocks} blocks, watermark {settings.watermark:g}, "
               f"budget {settings.max_num_batched_tokens}, {self.mode.value}")
        try:
            outcome = explore(self.requests, settings)
        except ValueError as e:  # a setting the configs refuse: say which, keep the controls live
            self.outcome, self.error = None, str(e)
            self.view.value = wv.step_html(0, [[("not a valid setting", html.escape(str(e)))]], None, alt,
                                           TEXT_LINES)
            return
        self.outcome, self.error = outcome, None
        png = self.png(outcome) if self.draw else None
        self.view.value = wv.step_html(0, self.columns(outcome), png, alt, TEXT_LINES)

    # -- display -----------------------------------------------------------------------------

    def saved_figure(self):
        """The setting on show, drawn for the saved view (``widget_view.legible_png`` makes it legible)."""
        from matplotlib.figure import Figure

        if self.outcome is None:
            return None
        fig = Figure(figsize=FIGSIZE)
        draw_whatif(self.outcome, fig, max_rounds=self.max_rounds())
        return fig

    def caption(self) -> str:
        """The saved view's caption (HTML)."""
        if self.outcome is None:
            return f"<b>▶ run the cell</b> to move the sliders (this setting is refused: {html.escape(self.error)})"
        return f"<b>▶ run the cell</b> to move the sliders; the picture shows {html.escape(self.outcome.summary())}"

    def __repr__(self) -> str:
        state = self.outcome.summary() if self.outcome else self.error
        return f"WhatIfExplorer over {len(self.requests)} requests ({state})"

    def _repr_mimebundle_(self, **kwargs) -> dict:
        fig = self.saved_figure()
        png = wv.legible_png(fig) if fig is not None else None
        s = self.settings
        alt = (f"{s.num_gpu_blocks} blocks, watermark {s.watermark:g}, budget {s.max_num_batched_tokens}, "
               f"{self.mode.value}")
        return wv.saved_bundle(self.widget, png, self.caption(), alt, **kwargs)
