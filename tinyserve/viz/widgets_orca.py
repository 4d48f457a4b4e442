"""Chapters 04 and 13's stepper: one workload under several scheduling policies, round by round.

``PolicyStepper(*runs, names=...)`` takes runs of the same requests (RoundRecords from
``sim.simulate``: chapter 04 gives two, the A–E workload under ``policy="orca"`` and
``policy="vllm"``; chapter 13 three, v0.4's "vllm", "orca" and "v1") and shows round r of all of
them, one column each: what ran (each prefill chunk with its tokens, the decodes), the tokens in
the batch (against the round's token budget when ``budget`` is given), who sat idle in
``running``, who was preempted, who waited (or sat swapped out) and who finished; and every
run's timeline drawn up to round r. A run that has already finished says so, which is how the
reader sees one policy end rounds before another.
"""

from __future__ import annotations

from collections.abc import Sequence

from tinyserve.lab.records import member_kind, request_order, request_states
from tinyserve.sim import RoundRecord
from tinyserve.viz.rounds import draw_timeline
from tinyserve.viz.stepper import Stepper, ids_html
from tinyserve.viz.style import STATES
from tinyserve.viz.widget_view import pick_steps

TWO_POLICY_NAMES = ("orca", "vllm")  # chapter 04's order, the default for two runs
# The drawing's layout, in inches: a request's row (two runs; three or more), a run's title, the
# margin on top, the round numbers under the last run and the key under them.
ROW_IN, ROW_IN_MANY, TITLE_IN, TOP_IN, ROUNDS_IN, KEY_IN = 0.27, 0.22, 0.3, 0.05, 0.42, 0.34


def chunks_html(record: RoundRecord, ids: Sequence[str]) -> str:
    """Prefill members with the tokens each brought this round: "D (4), E (4)"."""
    return ids_html([f"{rid} ({record.chunk_sizes.get(rid, '?')})" for rid in ids])


def policy_lines(name: str, records: Sequence[RoundRecord], index: int,
                 budget: int | None = None) -> list[tuple[str, str]]:
    """What one policy did in round ``index + 1`` (or that it had finished before it).

    A prefill is listed with the tokens it brought (a whole prompt, or one chunk of it); which
    members prefilled is read by ``records.member_kind``. ``swapped`` is shown only for a run
    that ever swapped."""
    if index >= len(records):
        return [(name, f"done: every request finished by round {len(records)}")]
    r = records[index]
    previous = records[index - 1] if index else None
    kinds = {rid: member_kind(r, rid, previous) for rid in r.batch}
    idle = [rid for rid in r.running if rid not in r.batch]
    tokens = str(r.num_batched_tokens) + (f" of {budget}" if budget is not None else "")
    lines = [
        (name, f"round {r.round} · {r.phase}"),
        ("prefill", chunks_html(r, [rid for rid in r.batch if kinds[rid] == "prefill"])),
        ("decode", ids_html([rid for rid in r.batch if kinds[rid] == "decode"])),
        ("tokens in batch", tokens),
        ("idle in running", ids_html(idle)),
        ("preempted", ids_html(r.preempted)),
        ("waiting", ids_html(r.waiting)),
    ]
    if any(q.swapped for q in records):
        lines.append(("swapped", ids_html(r.swapped)))
    lines.append(("finished", ids_html(r.finished)))
    return lines


class PolicyStepper(Stepper):
    """Runs of one workload side by side, one column each; step r shows round r of every run.

    ``names`` labels the runs (two runs default to chapter 04's ``("orca", "vllm")``);
    ``budget`` is the token budget of a round (``max_num_batched_tokens``): one number for all
    runs or one per run, shown as "tokens in batch: 9 of 10"."""

    noun = "round"

    def __init__(self, *runs: Sequence[RoundRecord], names: Sequence[str] | None = None,
                 budget: int | Sequence[int | None] | None = None, draw: bool = True,
                 interval_ms: int = 900) -> None:
        # >>> fold: validation
        if len(runs) < 2 or any(not run for run in runs):
            raise ValueError(f"runs: PolicyStepper needs at least two non-empty runs, got {len(runs)} "
                             f"of lengths {[len(run) for run in runs]}")
        if names is None:
            if len(runs) != 2:
                raise ValueError(f"names: give one name per run ({len(runs)} runs)")
            names = TWO_POLICY_NAMES
        if len(names) != len(runs):
            raise ValueError(f"names: {len(names)} names for {len(runs)} runs")
        budgets = list(budget) if isinstance(budget, Sequence) else [budget] * len(runs)
        if len(budgets) != len(runs):
            raise ValueError(f"budget: {len(budgets)} budgets for {len(runs)} runs")
        # <<<
        self.runs = tuple(list(run) for run in runs)
        self.names = tuple(names)
        self.budgets = tuple(budgets)
        self.ids = request_order([r for run in self.runs for r in run])
        n = max(len(run) for run in self.runs)
        # Inches: one row per request (and the batch-size row), a title over each run, the round
        # numbers and the key once at the bottom. Three runs of five requests stay within a
        # laptop's screen together with the controls and the text (the browser test: 700 px).
        self.row_in = ROW_IN if len(self.runs) == 2 else ROW_IN_MANY
        self.axes_in = self.row_in * (len(self.ids) + 0.9)
        self.figsize = (max(7.5, 0.34 * n + 3.0),
                        len(self.runs) * (self.axes_in + TITLE_IN) + TOP_IN + ROUNDS_IN + KEY_IN)
        super().__init__(n, draw=draw, interval_ms=interval_ms)

    def step_columns(self, index: int) -> list[list[tuple[str, str]]]:
        return [policy_lines(name, run, index, budget)
                for name, run, budget in zip(self.names, self.runs, self.budgets)]

    def draw_step(self, index: int, fig) -> None:
        axes = fig.subplots(len(self.runs), 1, sharex=True)
        for ax, name, run in zip(axes, self.names, self.runs):
            shown = run[:index + 1]
            done = len(run) <= index + 1
            title = f"{name}: round {min(index + 1, len(run))} of {len(run)}" + (" (finished)" if done else "")
            draw_timeline(shown, ax=ax, title=title, legend=False)
            # The same frame in every step: all rounds of the longest run, every request's row.
            ax.set_xlim(0, self.num_steps)
            ax.set_xticks([i + 0.5 for i in range(self.num_steps)], [str(i + 1) for i in range(self.num_steps)],
                          fontsize=8)
            ax.set_ylim(len(self.ids), -0.9)
            ax.set_yticks([i + 0.5 for i in range(len(self.ids))], self.ids)
            if ax is not axes[-1]:  # one axis of rounds, at the bottom: the runs share it
                ax.set_xlabel("")
                ax.tick_params(labelbottom=False)
            if not done:
                ax.add_patch(_frame(index, len(self.ids)))
        used = {s for run in self.runs for st in request_states(run) for s in st.values()}
        from matplotlib.patches import Rectangle

        handles = [Rectangle((0, 0), 1, 1, facecolor=STATES[s][0]) for s in STATES if s in used]
        # One row of short names (the figures' key explains each state at length), large enough
        # to read at the size the widget shows its picture.
        fig.legend(handles, [STATES[s][1].split(" (")[0].split(":")[0] for s in STATES if s in used],
                   loc="lower center", ncol=len(handles), fontsize=9, frameon=False)
        height = fig.get_figheight()
        fig.subplots_adjust(left=0.07, right=0.99, top=1 - (TOP_IN + TITLE_IN) / height,
                            bottom=(ROUNDS_IN + KEY_IN) / height, hspace=TITLE_IN / self.axes_in)

    def step_title(self, index: int) -> str:
        return f"round {index + 1}"

    def key_frame(self) -> int:
        # The saved view shows the last round: every run's whole timeline, side by side.
        return self.num_steps - 1

    def key_steps(self) -> list[int]:
        # The first rounds, where the policies part ways, each run's first preemption, and the
        # round each run ends.
        preempts = [next((i for i, r in enumerate(run) if r.preempted), -1) for run in self.runs]
        ends = [len(run) - 1 for run in self.runs]
        return pick_steps(self.num_steps, [0, 1, 2, 3, *preempts, *ends], limit=6 if len(self.runs) == 2 else 8)


def _frame(index: int, rows: int):
    from matplotlib.patches import Rectangle

    return Rectangle((index, -0.05), 1, rows + 0.1, facecolor="none", edgecolor="black", linewidth=1.6)
