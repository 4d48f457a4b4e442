"""Chapter 08's stepper: one decode program's walk through a sequence's K/V blocks.

``KernelWalkStepper(q, k_cache, v_cache, block_tables, context_lens, scale)`` picks one program
of the decode kernel (a sequence and a KV head, chosen with two toggles) and steps through the
blocks it loads, in block-table order (``lab.kernel_walk``). Each step shows which physical
block the program reads, and its online-softmax state after that block: the running max ``m``,
the running sum ``l`` and the accumulator ``acc`` (drawn as ``acc / l``, the output so far).
The last step compares the result with ``attention.reference.paged_decode_attention``.
"""

from __future__ import annotations

import ipywidgets as widgets
import torch

from tinyserve.lab.kernel_walk import KernelWalk, walk_sequence_blocks
from tinyserve.viz.stepper import Stepper
from tinyserve.viz.widget_view import pick_steps

WALK_POOL_COLS = 16
READ, CURRENT, AHEAD, OTHER = "#4e79a7", "#f28e2b", "#c6d9ec", "#d0d0d0"


def _row(values: torch.Tensor) -> str:
    return "[" + ", ".join(f"{float(v):.3g}" for v in values) + "]"


class KernelWalkStepper(Stepper):
    """Steps through the blocks one decode program loads; toggles choose the program."""

    noun = "block"
    figsize = (12.0, 3.3)

    def __init__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables,
                 context_lens, scale: float, seq: int = 0, kv_head: int = 0, draw: bool = True,
                 interval_ms: int = 700) -> None:
        self.inputs = (q, k_cache, v_cache, block_tables, context_lens, scale)
        self.lens = context_lens.tolist() if isinstance(context_lens, torch.Tensor) else list(context_lens)
        self.num_blocks = k_cache.shape[0]
        self.walk = self._walk(seq, kv_head)
        self.seq_toggle = widgets.ToggleButtons(options=[(f"seq {s} ({n} tokens)", s) for s, n in enumerate(self.lens)],
                                                value=seq, description="sequence")
        self.head_toggle = widgets.ToggleButtons(options=[(f"KV head {h}", h) for h in range(k_cache.shape[2])],
                                                 value=kv_head, description="program")
        super().__init__(len(self.walk.visits), draw=draw, interval_ms=interval_ms,
                         extra_controls=[self.seq_toggle, self.head_toggle])
        self.seq_toggle.observe(self._on_program, names="value")
        self.head_toggle.observe(self._on_program, names="value")

    @classmethod
    def from_example(cls, example, seq: int = 1, kv_head: int = 0, **kwargs) -> KernelWalkStepper:
        """Over chapter 08's example batch (``attention_kernel.example_inputs()``)."""
        e = example
        return cls(e.q, e.k_cache, e.v_cache, e.tables, e.context_lens, e.scale, seq=seq, kv_head=kv_head, **kwargs)

    def _walk(self, seq: int, kv_head: int) -> KernelWalk:
        q, k, v, tables, lens, scale = self.inputs
        return walk_sequence_blocks(q, k, v, tables, lens, scale, seq=seq, kv_head=kv_head)

    def _on_program(self, _change) -> None:
        self.walk = self._walk(self.seq_toggle.value, self.head_toggle.value)
        self.reset_steps(len(self.walk.visits))

    # -- what each step shows ------------------------------------------------------------------

    def step_columns(self, index: int) -> list[list[tuple[str, str]]]:
        w, v = self.walk, self.walk.visits[index]
        left = [
            ("program", f"seq {w.seq}, KV head {w.kv_head} (query heads {w.heads[0]}–{w.heads[-1]})"),
            ("block", f"{index + 1} of {len(w.visits)}: logical L{v.logical} → physical block {v.physical}"),
            ("tokens", f"{v.start}–{v.end - 1} ({v.end - v.start} of {w.block_size} slots)"),
            ("loads", f"K[{v.physical}, :{v.end - v.start}, {w.kv_head}] and V[{v.physical}, :{v.end - v.start}, "
                      f"{w.kv_head}]"),
        ]
        right = [
            ("max score in block", _row(v.scores.max(dim=1).values)),
            ("m before → after", f"{_row(v.m_before)} → {_row(v.m)}"),
            ("alpha = exp(m_old − m_new)", _row(v.alpha)),
            ("l", _row(v.l)),
            ("|acc| per row", _row(v.acc.norm(dim=1))),
        ]
        if index == len(w.visits) - 1:
            right.append(("acc / l vs reference", f"max |walk − reference.paged_decode_attention| = {w.max_error:.1e}"))
        return [left, right]

    def draw_step(self, index: int, fig) -> None:
        from matplotlib.patches import Rectangle
        from matplotlib.ticker import MaxNLocator

        w, visit = self.walk, self.walk.visits[index]
        ax_p, ax_m, ax_l, ax_o = fig.subplots(1, 4, gridspec_kw={"width_ratios": [1.7, 1, 1, 1.1]})
        # The pool: what this program has read, is reading, will read; other sequences' blocks.
        tables = self.inputs[3].tolist() if isinstance(self.inputs[3], torch.Tensor) else self.inputs[3]
        others = {b for s, t in enumerate(tables) if s != w.seq
                  for b in t[:-(-self.lens[s] // w.block_size)]}
        read = {v.physical for v in w.visits[:index]}
        ahead = {v.physical for v in w.visits[index + 1:]}
        for b in range(self.num_blocks):
            color = (CURRENT if b == visit.physical else READ if b in read else AHEAD if b in ahead
                     else OTHER if b in others else "white")
            x, y = b % WALK_POOL_COLS, b // WALK_POOL_COLS
            ax_p.add_patch(Rectangle((x, y), 0.92, 0.88, facecolor=color, edgecolor="black" if b == visit.physical
                                     else "#888888", lw=1.6 if b == visit.physical else 0.4))
            ax_p.text(x + 0.46, y + 0.45, str(b), ha="center", va="center", fontsize=5.5,
                      color="white" if b in read else "black")
        ax_p.set_xlim(0, WALK_POOL_COLS)
        ax_p.set_ylim(-(-self.num_blocks // WALK_POOL_COLS), 0)
        ax_p.set_aspect("equal")
        ax_p.set_axis_off()
        ax_p.set_title(f"block {index + 1}/{len(w.visits)}: reads physical {visit.physical}\n"
                       "orange: now · blue: read · pale: next · grey: other seqs", fontsize=7.5, loc="left")
        # The running state of each query row, over the whole walk (so the axes never move).
        n = len(w.visits)
        for ax, key, label in ((ax_m, "m", "running max m"), (ax_l, "l", "running sum l")):
            full = torch.stack([getattr(v, key) for v in w.visits])  # [n, group]
            for r, head in enumerate(w.heads):
                ax.plot(range(1, index + 2), full[:index + 1, r], marker="o", ms=2.5, lw=1, label=f"head {head}")
            lo, hi = float(full.min()), float(full.max())
            pad = 0.08 * (hi - lo or 1.0)
            ax.set_xlim(0.5, n + 0.5)
            ax.set_ylim(lo - pad, hi + pad)
            ax.set_title(label, fontsize=8)
            ax.set_xlabel("blocks read", fontsize=7)
            ax.tick_params(labelsize=6)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax_m.legend(fontsize=6, loc="lower right")
        final = w.out
        # One color scale for the whole walk: early outputs (few tokens) swing wider than the final.
        lim = max(float(v.output().abs().max()) for v in w.visits)
        ax_o.imshow(visit.output().numpy(), aspect="auto", cmap="RdBu_r", vmin=-lim, vmax=lim, interpolation="nearest")
        ax_o.set_yticks(range(len(w.heads)), [f"head {h}" for h in w.heads], fontsize=6)
        ax_o.tick_params(labelsize=6)
        gap = float((visit.output() - final).abs().max())
        ax_o.set_title(f"acc / l so far (max |· − final| = {gap:.2g})", fontsize=8)
        ax_o.set_xlabel("head_dim", fontsize=7)
        fig.subplots_adjust(left=0.01, right=0.99, top=0.8, bottom=0.15, wspace=0.3)

    def step_title(self, index: int) -> str:
        v = self.walk.visits[index]
        return f"block {index + 1} of seq {self.walk.seq}, KV head {self.walk.kv_head} (physical {v.physical})"

    def key_steps(self) -> list[int]:
        # Where a block raised the max (the old sums were rescaled), and the ends.
        raised = [i for i, v in enumerate(self.walk.visits) if i and bool((v.alpha < 1).any())]
        return pick_steps(len(self.walk.visits), raised, limit=6)
