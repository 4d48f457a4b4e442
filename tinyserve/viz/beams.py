"""Chapter 14's pictures of a beam search: the tree of candidates with the blocks each beam holds,
a stepper over a recorded run, and the blocks held with and without sharing.

All of them draw a ``lab.beams.BeamRun`` recorded from the real engine (``record_beam_search``).
In the tree, a column is a step: each candidate of that step is a box with the token it took,
joined to the beam it continues; a kept beam's box also lists its block table after the step as
``block×ref count`` (a block with ref count 4 is shared by four beams), a finished beam kept as a
result is green, and a candidate dropped (freed) is grey.
"""

from __future__ import annotations

import html

import matplotlib.pyplot as plt
from matplotlib.ticker import MaxNLocator

from tinyserve.lab.beams import BeamRun, BeamStep
from tinyserve.viz.stepper import Stepper

KEPT, FINISHED, DROPPED, PROMPT = "#cfe2f3", "#b6d7a8", "#eeeeee", "#fff2cc"
FONT = 9


def _token(text: str, limit: int = 11) -> str:
    text = repr(text)[1:-1]
    return text if len(text) <= limit else text[:limit - 1] + "…"


def blocks_text(blocks, last: int | None = None) -> str:
    """A block table as ``block×ref count`` pairs ("0×4 1×4 6×3"); with ``last``, only the last
    ``last`` blocks, after "…" for the others."""
    shown = list(blocks) if last is None or len(blocks) <= last else list(blocks)[-last:]
    return ("…" if len(shown) < len(blocks) else "") + " ".join(f"{b}×{r}" for b, r in shown)


def layout(run: BeamRun) -> dict[tuple[int, int], float]:
    """The y of every node, ``(step, seq id)`` -> y: a step's candidates ordered by their parent's
    place, then by score, and centred on the column (step 0 is the prompt, seq id of the first beam)."""
    first = run.steps[0].children[0].parent if run.steps and run.steps[0].children else 0
    ys = {(0, first): 0.0}
    for s in run.steps:
        order = sorted(s.children, key=lambda c: (-ys.get((s.step - 1, c.parent), 0.0), -c.cumulative_logprob))
        n = len(order)
        for i, c in enumerate(order):
            ys[(s.step, c.seq_id)] = (n - 1) / 2 - i
    return ys


def _state(s: BeamStep, seq_id: int, finished: bool) -> str:
    if seq_id not in s.kept:
        return DROPPED
    return FINISHED if finished else KEPT


def draw_beam_tree(run: BeamRun, step: int | None = None, window: int = 5, ax=None, title: str | None = None):
    """The tree of ``run`` up to ``step`` (default: the last), its last ``window`` steps shown."""
    step = len(run.steps) if step is None else step
    if not 1 <= step <= len(run.steps):
        raise ValueError(f"step must be 1..{len(run.steps)}, got {step}")
    if ax is None:
        _, ax = plt.subplots(figsize=(9.5, 5.2))
    ys = layout(run)
    first = max(0, step - window)
    rows = max(2 * run.width, 2)
    if first == 0:
        y0 = ys[(0, run.steps[0].children[0].parent)]
        ax.text(0, y0, f"prompt\n{len(run.prompt_token_ids)} tokens", ha="center", va="center", fontsize=FONT,
                bbox=dict(boxstyle="round,pad=0.3", fc=PROMPT, ec="#999999"))
    for s in run.steps[max(first, 1) - 1:step]:
        beams = {b.seq_id: b for b in s.beams}
        for c in s.children:
            y = ys[(s.step, c.seq_id)]
            state = _state(s, c.seq_id, c.finished)
            parent_y = ys.get((s.step - 1, c.parent))
            if parent_y is not None and s.step - 1 >= first:
                ax.plot([s.step - 1 + 0.32, s.step - 0.32], [parent_y, y], color="#bbbbbb" if state == DROPPED
                        else "#555555", lw=1.0, zorder=1)
            label = _token(c.text)
            if c.seq_id in beams and state == KEPT:
                label += "\n" + blocks_text(beams[c.seq_id].blocks, last=3)
            elif state == FINISHED:
                label += "\nfinished"
            ax.text(s.step, y, label, ha="center", va="center", fontsize=FONT, zorder=2,
                    color="#888888" if state == DROPPED else "black",
                    bbox=dict(boxstyle="round,pad=0.25", fc=state, ec="#999999" if state == DROPPED else "#333333"))
    ax.set_xlim(first - 0.55, step + 0.55)
    ax.set_ylim(-rows / 2, rows / 2)
    ax.set_xticks(range(first, step + 1))
    ax.set_xticklabels(["prompt" if i == 0 else f"step {i}" for i in range(first, step + 1)], fontsize=FONT + 1)
    ax.set_yticks([])
    for side in ("left", "right", "top"):
        ax.spines[side].set_visible(False)
    now = run.steps[step - 1]
    if now.stopped:
        said = f"the search stops with {len(now.finished)} finished beams; every block is freed"
    else:
        said = (f"the {len(now.beams)} running beams hold {now.blocks_shared} blocks "
                f"({now.blocks_unshared} without sharing)")
    ax.set_title(title or f"beam search, width {run.width}, step {step}: {said}", fontsize=FONT + 2)
    return ax.figure


def draw_blocks_held(runs: dict[str, BeamRun], step_run: str | None = None,
                     title: str = "GPU blocks held by the running beams"):
    """Two panels: one run's blocks at each step (``step_run``, default the first), with sharing
    and without (each beam its own copy of its table); then, for every run, those blocks summed
    over its steps, with the share sharing saves. Labels sit on the lines and bars, not in a
    legend box."""
    fig, (steps_ax, bars_ax) = plt.subplots(1, 2, figsize=(9.5, 3.8), gridspec_kw={"width_ratios": [1.3, 1]})
    name = step_run if step_run is not None else next(iter(runs))
    run = runs[name]
    held = [s for s in run.steps if s.beams]
    xs = [s.step for s in held]
    for values, style, label in (([s.blocks_unshared for s in held], "--", "without sharing"),
                                 ([s.blocks_shared for s in held], "-", "with sharing")):
        steps_ax.plot(xs, values, style, color="#3d85c6", lw=2.0)
        steps_ax.annotate(label, (xs[-1], values[-1]), xytext=(0, 7), textcoords="offset points", ha="right",
                          fontsize=FONT, color="#1c4587")
    steps_ax.set_xlabel("step", fontsize=FONT + 1)
    steps_ax.set_ylabel("GPU blocks", fontsize=FONT + 1)
    steps_ax.set_ylim(0, max(s.blocks_unshared for s in held) * 1.25)
    steps_ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    steps_ax.set_title(f"{name}, step by step", fontsize=FONT + 1)
    names = list(runs)
    without = [sum(s.blocks_unshared for s in r.steps) for r in runs.values()]
    with_ = [sum(s.blocks_shared for s in r.steps) for r in runs.values()]
    xs = range(len(names))
    bars_ax.bar([x - 0.2 for x in xs], without, 0.4, color="#cfe2f3", edgecolor="#3d85c6")
    bars_ax.bar([x + 0.2 for x in xs], with_, 0.4, color="#3d85c6")
    for x, a, b in zip(xs, without, with_):
        bars_ax.text(x, a * 1.03, f"saves {1 - b / a:.0%}", ha="center", va="bottom", fontsize=FONT)
    bars_ax.set_xticks(list(xs))
    bars_ax.set_xticklabels(names, fontsize=FONT)
    bars_ax.set_ylim(0, max(without) * 1.2)
    bars_ax.set_ylabel("block-steps", fontsize=FONT + 1)
    bars_ax.set_title("summed over the steps: copies (light), shared (dark)", fontsize=FONT + 1)
    for ax in (steps_ax, bars_ax):
        ax.tick_params(labelsize=FONT)
        for side in ("right", "top"):
            ax.spines[side].set_visible(False)
    fig.suptitle(title, fontsize=FONT + 2)
    fig.tight_layout()
    return fig


class BeamStepper(Stepper):
    """Steps through a recorded beam search: the tree up to the step, and as text the decision
    (kept, dropped, stopped), each running beam with its score and block table, the blocks held."""

    noun = "step"
    figsize = (9.5, 5.2)
    text_spare_lines = 1

    def __init__(self, run: BeamRun, draw: bool = True, interval_ms: int = 1200) -> None:
        if not run.steps:
            raise ValueError("run: BeamStepper needs a run of at least one step")
        self.run = run
        super().__init__(len(run.steps), draw=draw, interval_ms=interval_ms)

    @property
    def current(self) -> BeamStep:
        """The step on show."""
        return self.run.steps[self.index]

    def step_columns(self, index: int) -> list[list[tuple[str, str]]]:
        s = self.run.steps[index]
        texts = {c.seq_id: c.text for c in s.children}
        decision = [("step", str(s.step)),
                    ("candidates", str(len(s.children))),
                    ("kept", html.escape(", ".join(repr(texts.get(i, "")) for i in s.kept)) or "—"),
                    ("dropped", str(len(s.dropped))),
                    ("search", "stopped" if s.stopped else "goes on"),
                    ("blocks held", f"{s.blocks_shared} ({s.blocks_unshared} without sharing)")]
        beams = [(f"beam {b.seq_id}", html.escape(f"{b.text!r} ({b.cumulative_logprob:.2f}): {blocks_text(b.blocks)}"))
                 for b in s.beams]
        done = [(f"finished {c.seq_id}", html.escape(f"{c.text!r} ({c.cumulative_logprob:.2f})")) for c in s.finished]
        return [decision, (beams + done) or [("beams", "—")]]

    def draw_step(self, index: int, fig) -> None:
        draw_beam_tree(self.run, index + 1, ax=fig.add_subplot())
        fig.subplots_adjust(left=0.02, right=0.98, bottom=0.08, top=0.92)

    def step_title(self, index: int) -> str:
        return f"step {index + 1} of the beam search"

    def key_steps(self) -> list[int]:
        return list(range(min(self.num_steps, 9)))

    def key_frame(self) -> int:
        # Step 4: the tree has branched a few times, and the prompt's blocks and the common
        # prefixes show their ref counts.
        return min(3, self.num_steps - 1)
