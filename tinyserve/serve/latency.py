"""Request latencies for ``/metrics``: time to first token, time per output token and end-to-end
latency, as Prometheus histograms under vLLM's names (``tinyserve:time_to_first_token_seconds``,
``tinyserve:time_per_output_token_seconds``, ``tinyserve:e2e_request_latency_seconds``).

The engine loop tells ``RequestLatencies`` when a request was added to the engine and when it was
aborted; an engine callback (``stepped``, called at the end of every step) tells it which requests
got tokens and which finished, whatever output kind each asked for. The clock starts when the
request enters the engine, after its body was read and tokenized. As in vLLM, the time per output
token is observed once per step in which a request got tokens after its first: the time since
its previous tokens came. A request that finishes without a token (refused, failed) or is
aborted adds to no histogram.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Histogram

from tinyserve.outputs import StepEvent
from tinyserve.serve.metrics import PREFIX

# Wider than a GPU server's: on a CPU a first token after a long prompt takes seconds.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 300.0)


@dataclass
class _Open:
    added: float
    last: float | None = None  # when its latest tokens came


class RequestLatencies:
    """The three histograms, in ``registry``, and the requests in flight they are measured on."""

    def __init__(self, registry: CollectorRegistry, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time from a request entering the engine "
                              "to its first generated token.", buckets=TTFT_BUCKETS, registry=registry)
        self.tpot = Histogram(PREFIX + "time_per_output_token_seconds", "Time between a request's steps that "
                              "produced tokens, after its first.", buckets=TPOT_BUCKETS, registry=registry)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Time from a request entering the engine "
                             "to its last token.", buckets=E2E_BUCKETS, registry=registry)
        self._open: dict[str, _Open] = {}
        self._lock = threading.Lock()  # steps report on the engine thread, adds and aborts on the server's

    def added(self, request_id: str) -> None:
        with self._lock:
            self._open[request_id] = _Open(self.clock())

    def dropped(self, request_id: str) -> None:
        """An aborted request: its latencies are not a served request's."""
        with self._lock:
            self._open.pop(request_id, None)

    def stepped(self, engine, event: StepEvent) -> None:
        """An engine callback (``LLMEngine.add_callback``): observe what this step produced."""
        now = self.clock()
        with self._lock:
            for request_id in dict.fromkeys(group.request_id for group, _, _ in event.produced):
                req = self._open.get(request_id)
                if req is None:
                    continue
                if req.last is None:
                    self.ttft.observe(now - req.added)
                else:
                    self.tpot.observe(now - req.last)
                req.last = now
            for out in event.outputs:
                if out.finished:
                    req = self._open.pop(out.request_id, None)
                    if req is not None and req.last is not None and out.error is None:
                        self.e2e.observe(now - req.added)

    def __len__(self) -> int:
        return len(self._open)
