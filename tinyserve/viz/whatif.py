"""Chapter 05's what-if explorer: move a slider, the scheduler runs the workload again.

``WhatIfExplorer()`` has sliders for the number of GPU blocks, the watermark and the token
budget of a round, and a toggle for the preemption mode. Every change re-simulates the workload
with the real scheduler (``lab.whatif.explore``) and redraws its timeline: one row per request,
one column per round, preemptions in red, with the tokens each round computed underneath, and
the counts (rounds, preemptions, tokens computed again, blocks swapped) beside it.
"""

from __future__ import annotations

import html

import ipywidgets as widgets

from tinyserve.lab.records import request_order, request_states
from tinyserve.lab.whatif import WhatIfOutcome, WhatIfSettings, explore, whatif_workload
from tinyserve.sim import Request
from tinyserve.viz import widget_view as wv
from tinyserve.viz.style import STATES

MODES = {"recompute": "recompute", "swap": "swap", "vLLM's rule": None}
FIGSIZE = (10.5, 4.4)


def draw_whatif(outcome: WhatIfOutcome, fig, title: str = "") -> None:
    """The outcome's timeline (requests x rounds, colored by state) over its tokens per round."""
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
    ax.set_yticks(range(len(ids)), ids, fontsize=8)
    used = {st for states in request_states(records) for st in states.values()}
    ax.legend([Patch(facecolor=STATES[n][0]) for n in names if n in used],
              [STATES[n][1].split(" (")[0].split(":")[0] for n in names if n in used],
              loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=7, frameon=False, title="| last token",
              title_fontsize=7)
    ax.set_title(title or (f"{s.num_gpu_blocks} GPU blocks · watermark {s.watermark:g} · "
                           f"{s.max_num_batched_tokens} tokens per round · preemption: "
                           f"{s.preemption_mode or 'vLLM rule'}\n{outcome.summary()}"), loc="left", fontsize=8.5)
    ax_t.bar([r.round for r in records], [r.num_batched_tokens for r in records], width=1.0, color="#888888")
    ax_t.axhline(s.max_num_batched_tokens, color="#e15759", lw=0.8, ls="--")
    ax_t.set_ylabel("tokens", fontsize=8)
    ax_t.set_xlabel("round", fontsize=8)
    ax_t.set_xlim(0.5, len(records) + 0.5)
    ax_t.tick_params(labelsize=7)
    fig.subplots_adjust(left=0.05, right=0.84, top=0.88, bottom=0.11, hspace=0.08)


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
                                          style=style)
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
            ("ignored (can never run)", html.escape(", ".join(outcome.ignored)) or "—"),
            ("tokens spent on ignored requests", str(outcome.wasted_tokens)),
        ]]

    def png(self, outcome: WhatIfOutcome, dpi: float = wv.DISPLAY_DPI * wv.PIXEL_RATIO, title: str = "") -> bytes:
        from matplotlib.figure import Figure

        if self.figure is None:
            self.figure = Figure(figsize=FIGSIZE)
        self.figure.clear()
        draw_whatif(outcome, self.figure, title)
        return wv.render_png(self.figure, dpi)

    def _render(self) -> None:
        settings = self.settings
        alt = (f"{settings.num_gpu_blocks} blocks, watermark {settings.watermark:g}, "
               f"budget {settings.max_num_batched_tokens}, {self.mode.value}")
        try:
            outcome = explore(self.requests, settings)
        except ValueError as e:  # a setting the configs refuse: say which, keep the controls live
            self.outcome, self.error = None, str(e)
            self.view.value = wv.step_html(0, [[("not a valid setting", html.escape(str(e)))]], None, alt)
            return
        self.outcome, self.error = outcome, None
        png = self.png(outcome) if self.draw else None
        self.view.value = wv.step_html(0, self.columns(outcome), png, alt)

    # -- display -----------------------------------------------------------------------------

    def key_settings(self) -> list[WhatIfSettings]:
        """What the saved picture shows: this setting, the other preemption mode, half the
        blocks, and a watermark."""
        s = self.settings
        other = "swap" if s.preemption_mode != "swap" else "recompute"
        return [s, s.but(preemption_mode=other), s.but(num_gpu_blocks=max(8, s.num_gpu_blocks // 2)),
                s.but(watermark=0.2)]

    def filmstrip_png(self) -> bytes:
        pngs = []
        for s in self.key_settings():
            try:
                pngs.append(self.png(explore(self.requests, s), dpi=wv.FILMSTRIP_DPI))
            except ValueError:
                continue
        return wv.filmstrip(pngs)

    def __repr__(self) -> str:
        state = self.outcome.summary() if self.outcome else self.error
        return (f"WhatIfExplorer over {len(self.requests)} requests ({state}); "
                "run the notebook to move the sliders")

    def _repr_mimebundle_(self, **kwargs) -> dict:
        return wv.saved_bundle(self.widget, self.filmstrip_png(), repr(self), **kwargs)
