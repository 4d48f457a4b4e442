"""How the driver tells a rank that is working from one that has hung, well before any hang guard.

A rank can fail in three ways. It can raise (it answers with the trace) or die (its pipe closes
and its process handle becomes ready): the driver sees both at once. Or it can stop answering
while its process lives on: stopped by ``SIGSTOP`` or a debugger, frozen, or alive but stuck (in
a collective that will never complete, say). This module covers that third way, twice:

- Heartbeats catch a rank that has stopped running. Each rank has a thread that adds 1 to its
  slot of a shared array a few times a second (``start_beating``). Torch ops and collectives
  release the GIL, so a rank busy computing, or waiting in an all-reduce, still beats; a stopped
  or frozen process does not. The driver (``Heartbeats``) fails a rank whose count has not moved
  for ``heartbeat_timeout_s``. It watches counts, not timestamps, so the ranks' clocks never
  matter, and it measures silence from the start of each call, so a driver that was itself
  paused between calls never blames a rank for it.
- A round deadline catches a rank that still beats but never finishes (``RoundDeadline``): a
  round may take ``max(step_timeout_s, step_timeout_factor x the slowest round so far)``, so the
  bound follows the rounds this model and machine really take instead of a fixed 10 minutes.
"""

from __future__ import annotations

import threading
import time


def beat_interval(heartbeat_timeout_s: float | None) -> float:
    """How often a rank beats: ten beats per timeout, so one late beat is never a failure."""
    return 0.5 if heartbeat_timeout_s is None else min(0.5, heartbeat_timeout_s / 10)


def start_beating(beats, rank: int, interval_s: float) -> None:
    """In a rank: count up ``beats[rank]`` every ``interval_s`` from a daemon thread, for as long
    as the process runs (it ends with the process, which leaves through ``os._exit``)."""
    def beat() -> None:
        while True:
            beats[rank] += 1  # only this thread writes this slot
            time.sleep(interval_s)

    threading.Thread(target=beat, name="tinyserve-heartbeat", daemon=True).start()


class Heartbeats:
    """In the driver: which ranks have not beaten for ``timeout_s`` (``None``: never checked)."""

    def __init__(self, beats, timeout_s: float | None) -> None:
        self.beats, self.timeout_s = beats, timeout_s
        # How long the driver may wait before it looks again (it wakes early for any answer).
        self.poll_s = None if timeout_s is None else min(0.25, timeout_s / 4)
        self.restart()

    def restart(self) -> None:
        """Start measuring silence now (at the start of every call)."""
        now = time.monotonic()
        self.counts = list(self.beats)
        self.moved_at = [now] * len(self.counts)

    def silent(self, ranks: list[int]) -> list[tuple[int, float]]:
        """``(rank, seconds without a beat)`` for each of ``ranks`` silent for over ``timeout_s``."""
        if self.timeout_s is None:
            return []
        now = time.monotonic()
        late = []
        for r in ranks:
            count = self.beats[r]
            if count != self.counts[r]:
                self.counts[r], self.moved_at[r] = count, now
            elif now - self.moved_at[r] > self.timeout_s:
                late.append((r, now - self.moved_at[r]))
        return late


class RoundDeadline:
    """How long one ``execute_model`` round may take: ``max(floor_s, factor x the slowest so far)``.

    The floor covers the first rounds, whose time is not known yet (and that may compile kernels);
    the factor leaves room for a round much larger than any seen (a long prompt after decodes).
    ``floor_s=None`` turns the deadline off, leaving the executor's call timeout."""

    def __init__(self, floor_s: float | None, factor: float) -> None:
        self.floor_s, self.factor = floor_s, factor
        self.slowest_s = 0.0

    def seconds(self, otherwise: float) -> float:
        return otherwise if self.floor_s is None else max(self.floor_s, self.factor * self.slowest_s)

    def record(self, seconds: float) -> None:
        self.slowest_s = max(self.slowest_s, seconds)


def process_state(pid: int) -> str | None:
    """The kernel's one-letter state of a process (``'T'``: stopped), or None where there is no
    ``/proc`` to read it from."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2]  # the name in parentheses may itself hold spaces


def is_stopped(pid: int) -> bool:
    """Stopped by a signal (``T``) or by a debugger (``t``): such a process leaves SIGTERM pending
    until it is continued, so only SIGKILL ends it."""
    return process_state(pid) in ("T", "t")
