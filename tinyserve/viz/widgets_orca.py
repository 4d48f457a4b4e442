"""Chapter 04's stepper: one workload under two scheduling policies, round by round, together.

``PolicyStepper(left, right)`` takes two runs of the same requests (RoundRecords from
``sim.simulate``, e.g. the A–E workload under ``policy="orca"`` and ``policy="vllm"``) and
shows round r of both: for each policy what ran (who prefilled, who decoded, who sat idle in
``running``), who waited and who finished, and both timelines drawn up to round r. A run that
has already finished says so, which is how the reader sees one policy end rounds before the other.
"""

from __future__ import annotations

from collections.abc import Sequence

from tinyserve.lab.records import member_kind, request_order, request_states
from tinyserve.sim import RoundRecord
from tinyserve.viz.rounds import draw_timeline
from tinyserve.viz.stepper import Stepper, ids_html
from tinyserve.viz.style import STATES
from tinyserve.viz.widget_view import pick_steps


def policy_lines(name: str, records: Sequence[RoundRecord], index: int) -> list[tuple[str, str]]:
    """What one policy did in round ``index + 1`` (or that it had finished before it)."""
    if index >= len(records):
        return [(name, f"done: every request finished by round {len(records)}")]
    r = records[index]
    previous = records[index - 1] if index else None
    kinds = {rid: member_kind(r, rid, previous) for rid in r.batch}
    idle = [rid for rid in r.running if rid not in r.batch]
    return [
        (name, f"round {r.round} · {r.phase}"),
        ("prefill", ids_html([rid for rid in r.batch if kinds[rid] == "prefill"])),
        ("decode", ids_html([rid for rid in r.batch if kinds[rid] == "decode"])),
        ("tokens in batch", str(r.num_batched_tokens)),
        ("idle in running", ids_html(idle)),
        ("waiting", ids_html(r.waiting)),
        ("finished", ids_html(r.finished)),
    ]


class PolicyStepper(Stepper):
    """Two runs of one workload side by side; step r shows round r of both."""

    noun = "round"

    def __init__(self, left: Sequence[RoundRecord], right: Sequence[RoundRecord],
                 names: tuple[str, str] = ("orca", "vllm"), draw: bool = True, interval_ms: int = 900) -> None:
        if not left or not right:
            raise ValueError("left, right: PolicyStepper needs two non-empty runs")
        self.runs = (list(left), list(right))
        self.names = names
        self.ids = request_order(self.runs[0] + self.runs[1])
        n = max(len(left), len(right))
        self.figsize = (max(7.5, 0.34 * n + 3.0), 2 * (0.3 * len(self.ids) + 1.0) + 0.6)
        super().__init__(n, draw=draw, interval_ms=interval_ms)

    def step_columns(self, index: int) -> list[list[tuple[str, str]]]:
        return [policy_lines(name, run, index) for name, run in zip(self.names, self.runs)]

    def draw_step(self, index: int, fig) -> None:
        axes = fig.subplots(2, 1)
        for ax, name, run in zip(axes, self.names, self.runs):
            shown = run[:index + 1]
            done = len(run) <= index + 1
            title = f"{name}: round {min(index + 1, len(run))} of {len(run)}" + (" (finished)" if done else "")
            draw_timeline(shown, ax=ax, title=title, legend=False)
            # The same frame in every step: all rounds of the longer run, every request's row.
            ax.set_xlim(0, self.num_steps)
            ax.set_xticks([i + 0.5 for i in range(self.num_steps)], [str(i + 1) for i in range(self.num_steps)],
                          fontsize=8)
            ax.set_ylim(len(self.ids), -0.9)
            ax.set_yticks([i + 0.5 for i in range(len(self.ids))], self.ids)
            if not done:
                ax.add_patch(_frame(index, len(self.ids)))
        used = {s for run in self.runs for st in request_states(run) for s in st.values()}
        from matplotlib.patches import Rectangle

        handles = [Rectangle((0, 0), 1, 1, facecolor=STATES[s][0]) for s in STATES if s in used]
        fig.legend(handles, [STATES[s][1].split(" (")[0] for s in STATES if s in used], loc="lower center",
                   ncol=len(handles), fontsize=7, frameon=False)
        fig.subplots_adjust(left=0.07, right=0.99, top=0.93, bottom=0.12, hspace=0.55)

    def step_title(self, index: int) -> str:
        return f"round {index + 1}"

    def key_steps(self) -> list[int]:
        # The first rounds, where the policies part ways, and the round each run ends.
        return pick_steps(self.num_steps, [0, 1, 2, 3, len(self.runs[0]) - 1, len(self.runs[1]) - 1], limit=6)


def _frame(index: int, rows: int):
    from matplotlib.patches import Rectangle

    return Rectangle((index, -0.05), 1, rows + 0.1, facecolor="none", edgecolor="black", linewidth=1.6)
