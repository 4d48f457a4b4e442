"""Watch a grammar at work: what each step of a constrained request allowed, wanted and drew.

``MaskRecorder`` is a sampler for the engine's ``sampler=`` hook. It samples with the package's
``Sampler`` and, before that, records for every row that follows a grammar: how many tokens the
grammar allows, the tokens the model itself ranked highest (from its raw logits) and whether the
grammar allows them, the highest-ranked allowed tokens, and how long the mask took to fill and to
apply. Chapter 12 draws the record (``tinyserve.viz.structured``) and reads the mask's cost from it.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch

from tinyserve.grammar import allocate_bitmask, apply_bitmask, unpack_bitmask
from tinyserve.sampler import Sampler, SampleRequest


@dataclass
class GuidedStep:
    """One sampled token of a constrained sequence, as the grammar and the model saw it."""

    num_allowed: int  # tokens the grammar allows here
    wanted: list[int]  # the model's own top tokens (raw logits), best first
    wanted_allowed: list[bool]  # whether the grammar allows each of them
    top_allowed: list[int]  # the best tokens among the allowed ones
    chosen: int | None = None  # the token drawn (None if the row failed)
    fill_s: float = 0.0  # seconds to compute the mask (the grammar's work)
    apply_s: float = 0.0  # seconds to set the disallowed logits to -inf

    @property
    def top_masked(self) -> bool:
        """Whether the grammar ruled out the token the model liked best."""
        return not self.wanted_allowed[0]


@dataclass
class MaskRecorder:
    """A ``sampler=`` for the engine: samples as ``inner`` does and keeps a ``GuidedStep`` per
    constrained row, in ``steps[seq]`` by the order of the rows' grammar states (one list per
    sequence that follows a grammar, in the order the sequences first appear)."""

    inner: Sampler = field(default_factory=Sampler)
    top: int = 5
    steps: dict[int, list[GuidedStep]] = field(default_factory=dict)
    _keys: dict[int, int] = field(default_factory=dict)

    def __call__(self, logits: torch.Tensor, requests: list[SampleRequest]) -> list:
        recorded = []
        for i, request in enumerate(requests):
            grammar = request.constraints.grammar if request.constraints is not None else None
            if grammar is None:
                continue
            # The same work the sampler does for this row (fill one bitmask row, apply it), timed
            # apart, on a copy: the sampler below still gets the model's logits.
            bitmask = allocate_bitmask(1, logits.shape[-1])
            t0 = time.perf_counter()
            grammar.fill_bitmask(bitmask, 0)
            t1 = time.perf_counter()
            masked = logits[i:i + 1].clone()
            apply_bitmask(masked, bitmask)
            t2 = time.perf_counter()
            allowed = unpack_bitmask(bitmask, logits.shape[-1])[0]
            wanted = logits[i].topk(self.top).indices.tolist()
            k = min(self.top, int(allowed.sum()))
            step = GuidedStep(int(allowed.sum()), wanted, [bool(allowed[t]) for t in wanted],
                              masked[0].topk(k).indices.tolist(), fill_s=t1 - t0, apply_s=t2 - t1)
            # A sequence is known by its grammar state: the engine keeps one per sequence.
            key = self._keys.setdefault(id(grammar), len(self._keys))
            self.steps.setdefault(key, []).append(step)
            recorded.append((i, step))
        results = self.inner(logits, requests)
        for i, step in recorded:
            if not isinstance(results[i], Exception):
                step.chosen = results[i][0]
        return results


def mask_cost(steps: list[GuidedStep], step_times: list[float]) -> dict[str, float]:
    """Medians over a run: the mask's fill and apply time and the engine's whole step, in ms,
    and the mask's share of a step."""
    fill = statistics.median(s.fill_s for s in steps) * 1e3
    apply = statistics.median(s.apply_s for s in steps) * 1e3
    step = statistics.median(step_times) * 1e3
    return {"fill_ms": fill, "apply_ms": apply, "step_ms": step, "share": (fill + apply) / step}
