"""The server's latency histograms (tinyserve.serve.latency): what each observes, on a fake clock
with made-up outputs (tests/test_serve.py checks them through the real server; issue 24 §3)."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client import CollectorRegistry

from tinyserve.outputs import RequestOutput, StepEvent
from tinyserve.serve.latency import RequestLatencies

NAMES = ("tinyserve:time_to_first_token_seconds", "tinyserve:time_per_output_token_seconds",
         "tinyserve:e2e_request_latency_seconds")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def step(lat: RequestLatencies, produced: list[str], finished: dict[str, str | None] | None = None) -> None:
    """Report a step that sampled a token for each id in ``produced`` (once per sample) and
    finished the requests in ``finished`` (id -> error or None)."""
    outputs = [RequestOutput(rid, None, [1, 2], [], True, error) for rid, error in (finished or {}).items()]
    outputs += [RequestOutput(rid, None, [1, 2], [], False) for rid in produced if rid not in (finished or {})]
    event = StepEvent(None, list(finished or {}), [(SimpleNamespace(request_id=rid), None, 7) for rid in produced],
                      outputs, (0.0, 0.0, 0.0, 0.0))
    lat.stepped(None, event)


def observed(registry: CollectorRegistry) -> dict[str, tuple[int, float]]:
    """(count, sum) of each histogram."""
    return {name: (registry.get_sample_value(name + "_count"), registry.get_sample_value(name + "_sum"))
            for name in NAMES}


def test_each_histogram_observes_what_its_name_says():
    registry, clock = CollectorRegistry(), Clock()
    lat = RequestLatencies(registry, clock)
    for rid in ("a", "b", "refused"):
        lat.added(rid)
    clock.now += 0.5  # the prefill step
    step(lat, ["a", "b"], {"refused": "the prompt is too long"})
    clock.now += 0.25
    step(lat, ["a", "b"])
    clock.now += 0.125
    step(lat, ["a", "b"], {"a": None, "b": None})
    ttft, tpot, e2e = observed(registry).values()
    assert ttft == (2, 1.0)  # 0.5 s for each; the refused request produced nothing and is not counted
    assert tpot == (4, 2 * (0.25 + 0.125))  # two steps after the first token, for each
    assert e2e == (2, 2 * 0.875)
    assert len(lat) == 0  # nothing is kept for a finished request


def test_samples_of_a_step_count_once_and_aborted_or_failed_requests_report_no_end():
    registry, clock = CollectorRegistry(), Clock()
    lat = RequestLatencies(registry, clock)
    for rid in ("n2", "gone", "failed"):
        lat.added(rid)
    clock.now += 1.0
    step(lat, ["n2", "n2", "gone", "failed"])  # n2 has two samples: one first token, not two
    lat.dropped("gone")
    clock.now += 0.5
    step(lat, ["n2", "n2", "gone"], {"n2": None, "failed": "sampling failed"})
    ttft, tpot, e2e = observed(registry).values()
    assert ttft == (3, 3.0) and tpot == (1, 0.5) and e2e == (1, 1.5)
    assert len(lat) == 0
