"""Reading ``RoundRecord``s: who did what in each round, and what it cost.

``sim.simulate`` and the engine's history both report rounds as RoundRecords; these functions
turn them into the facts the chapters quote and the drawings paint (a request's state in every
round, when it finished, how many slots sat idle, how many tokens recompute prefilled again).
"""

from __future__ import annotations

from collections.abc import Sequence

from tinyserve.sim import Request, RoundRecord


def request_order(records: Sequence[RoundRecord]) -> list[str]:
    """Request ids in the order they first appear (batch first, then the queues)."""
    seen: dict[str, None] = {}
    for r in records:
        for rid in [*r.batch, *r.running, *r.waiting, *r.swapped, *r.preempted, *r.ignored, *r.finished]:
            seen.setdefault(rid, None)
    return list(seen)


def member_kind(record: RoundRecord, request_id: str, previous: RoundRecord | None) -> str:
    """Whether a batch member prefilled or decoded in this round.

    The scheduler's own word (``record.prefills``) where the record has it. A record made by
    hand: a pure round says so in its phase; in a mixed round, a member prefills if it brought
    more than one new token, or if it was not running before and did not come back from swap."""
    if record.prefills is not None:
        return "prefill" if request_id in record.prefills else "decode"
    if record.phase in ("prefill", "decode"):
        return record.phase
    if record.chunk_sizes.get(request_id, 1) > 1:
        return "prefill"
    was_running = previous is not None and request_id in previous.running
    return "decode" if was_running or request_id in record.swapped_in else "prefill"


def request_states(records: Sequence[RoundRecord]) -> list[dict[str, str]]:
    """For each round, the state (a key of STATES) of every request present in it."""
    out = []
    previous = None
    for r in records:
        states: dict[str, str] = {}
        for rid in r.waiting:
            states[rid] = "waiting"
        for rid in r.swapped:
            states[rid] = "swapped"
        for rid in r.running:
            states[rid] = "idle"
        for rid in r.batch:
            states[rid] = member_kind(r, rid, previous)
        for rid in r.preempted:
            states[rid] = "preempted"
        for rid in r.ignored:
            states[rid] = "ignored"
        out.append(states)
        previous = r
    return out


def finish_rounds(records: Sequence[RoundRecord]) -> dict[str, int]:
    """The round in which each request produced its last token."""
    return {rid: r.round for r in records for rid in r.finished}


def idle_slots(records: Sequence[RoundRecord]) -> int:
    """Slot-rounds held by a running request that computed nothing (static padding, or a decode
    paused by a prefill-only round)."""
    return sum(len(set(r.running) - set(r.batch)) for r in records)


def recomputed_tokens(records: Sequence[RoundRecord], requests: Sequence[Request]) -> int:
    """Tokens prefilled beyond each prompt's first prefill: the work recompute-preemption redoes."""
    states = request_states(records)
    prefilled = sum(r.chunk_sizes.get(rid, 0) for r, st in zip(records, states)
                    for rid, s in st.items() if s == "prefill")
    return prefilled - sum(q.prompt_len for q in requests)


def _fmt(ids: list[str]) -> str:
    return ", ".join(ids) if ids else "-"


def round_caption(record: RoundRecord) -> str:
    """One line on what happened in the round (used under the drawing and by the stepper)."""
    parts = [f"batch [{_fmt(record.batch)}] ({record.num_batched_tokens} tokens)"]
    if record.preempted:
        parts.append(f"preempted {_fmt(record.preempted)}")
    if record.swapped_out:
        parts.append(f"swapped out {_fmt(record.swapped_out)}")
    if record.swapped_in:
        parts.append(f"swapped in {_fmt(record.swapped_in)}")
    if record.finished:
        parts.append(f"finished {_fmt(record.finished)}")
    if record.ignored:
        parts.append(f"ignored {_fmt(record.ignored)}")
    return " · ".join(parts)
