"""``/metrics``: the engine's state in Prometheus' text format, through ``prometheus_client``.

The names are vLLM's, under a ``tinyserve:`` prefix, so dashboards written for vLLM read them
with a rename. The engine loop takes an ``EngineStats`` snapshot whenever it holds the engine
(after every step, every added request and every abort); a scrape reads the latest snapshot and
never waits for a step or touches the engine from another thread.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tinyserve.engine import LLMEngine

PREFIX = "tinyserve:"


@dataclass(frozen=True)
class EngineStats:
    num_requests_running: int = 0
    num_requests_waiting: int = 0
    num_requests_swapped: int = 0
    gpu_cache_usage_perc: float = 0.0  # a fraction in [0, 1], as vLLM reports it despite the name
    cpu_cache_usage_perc: float = 0.0
    num_preemptions: int = 0
    generation_tokens: int = 0


def snapshot(engine: LLMEngine) -> EngineStats:
    """The engine's queues and block usage now; call it only while no step is running."""
    sched = engine.scheduler
    bm = sched.block_manager

    def used(free: int, total: int) -> float:
        return 1.0 - free / total if total else 0.0

    return EngineStats(
        num_requests_running=len(sched.running), num_requests_waiting=len(sched.waiting),
        num_requests_swapped=len(sched.swapped),
        gpu_cache_usage_perc=used(bm.get_num_free_gpu_blocks(), bm.num_total_gpu_blocks),
        cpu_cache_usage_perc=used(bm.get_num_free_cpu_blocks(), bm.num_total_cpu_blocks),
        num_preemptions=engine.num_preemptions_total, generation_tokens=engine.num_generation_tokens_total)


GAUGES = {
    "num_requests_running": "Number of requests running on the GPU (in the scheduler's running queue).",
    "num_requests_waiting": "Number of requests waiting to be admitted.",
    "num_requests_swapped": "Number of requests swapped out to CPU memory.",
    "gpu_cache_usage_perc": "Fraction of GPU KV-cache blocks in use (1 means full).",
    "cpu_cache_usage_perc": "Fraction of CPU swap-space blocks in use (1 means full).",
}
COUNTERS = {
    "num_preemptions": "Cumulative number of preemptions (swap or recompute) since the server started.",
    "generation_tokens": "Cumulative number of generated tokens since the server started.",
}


class EngineCollector(Collector):
    """Reports the latest snapshot each time the registry is scraped."""

    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self.stats()
        for name, doc in GAUGES.items():
            yield GaugeMetricFamily(PREFIX + name, doc, value=getattr(s, name))
        for name, doc in COUNTERS.items():  # exposed with the counter's "_total" suffix
            yield CounterMetricFamily(PREFIX + name, doc, value=getattr(s, name))


def make_registry(stats: Callable[[], EngineStats]) -> CollectorRegistry:
    """A registry of one app's own: several apps (tests, notebooks) in a process never clash."""
    registry = CollectorRegistry()
    registry.register(EngineCollector(stats))
    return registry
