"""Three stories read off real runs, for the pictures of chapters 03, 05 and 09.

- ``block_life``: one physical block through chapter 03's script (``block_ops.BLOCK_STORY``) on
  a real BlockSpaceManager: free, allocated, shared by a fork, left behind by a copy-on-write,
  swapped to the CPU and back, freed.
- ``queue_transitions``: how often requests moved between ``waiting``, ``running``, ``swapped``
  and out, counted from the scheduler's rounds (``sim.RoundRecord``) of a run.
- ``trace_step``: the calls one ``LLMEngine.step`` makes between its parts (scheduler, block
  manager, worker, cache engine, model, sampler), recorded by wrapping those parts' methods on a
  live engine for one step, in the order they happened.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from tinyserve.lab.block_ops import BLOCK_STORY, BlockOp, play_block_script
from tinyserve.sim import RoundRecord

# -- a block's life ---------------------------------------------------------------------------


@dataclass(frozen=True)
class BlockState:
    """The followed block after one script line: where it is, its number there and its owners."""

    op: str  # the script line that led here ("" for the start)
    state: str  # free | allocated | shared | copied | swapped | back | freed
    device: str  # GPU | CPU
    number: int
    ref_count: int
    meaning: str


def _last_prompt_block(manager, seq):
    return manager.block_tables[seq.seq_id][-1] if seq.seq_id in manager.block_tables else None


def block_life(script: Sequence[str] = BLOCK_STORY) -> list[BlockState]:
    """Follow A's last prompt block (the one with room left, so the one copy-on-write touches)
    through ``script``: after ``fork A.0 A.1`` it is A.1's; the copy goes to A.0."""
    states: list[BlockState] = []
    followed: dict[str, object] = {}

    def observe(manager, seqs, op: BlockOp) -> None:
        owner = seqs.get("A.1") if "A.1" in seqs and seqs["A.1"].seq_id in manager.block_tables else seqs.get("A.0")
        block = _last_prompt_block(manager, owner) if owner is not None else None
        if block is None or (op.line.startswith("free") and followed.get("block") is not None
                             and owner.seq_id not in manager.block_tables):
            block = followed.get("block")
        if block is None:
            return
        followed["block"] = block
        verb = op.line.split()[0]
        if verb == "free" and block.ref_count == 0:
            state = "freed"
        elif verb == "swap_out":
            state = "swapped"
        elif verb == "swap_in":
            state = "back"
        elif verb == "append" and "copy" in op.meaning.lower():
            state = "copied"
        elif block.ref_count > 1:
            state = "shared"
        else:
            state = "allocated"
        states.append(BlockState(op.line, state, block.device.name, block.block_number, block.ref_count, op.meaning))

    play_block_script(list(script), observe=observe)
    # Leave out the lines that left the block where and as it was (B's operations, a token
    # written into it in place, freeing a sample that does not hold it).
    story: list[BlockState] = []
    for s in states:
        last = story[-1] if story else None
        if last is None or (s.device, s.number, s.ref_count) != (last.device, last.number, last.ref_count) \
                or s.state == "freed" != last.state:
            story.append(s)
    first = story[0]
    return [BlockState("", "free", first.device, first.number, 0, "on the free list")] + story


# -- a request's queues -----------------------------------------------------------------------

ARRIVES, FINISHED = "arrives", "finished"
QUEUES = ("waiting", "running", "swapped")


def queue_transitions(records: Sequence[RoundRecord]) -> Counter:
    """``Counter({(from, to): times})`` over a run's rounds: arrivals into ``waiting``, admission
    (waiting -> running), preemption by recompute (running -> waiting) and by swap (running ->
    swapped), swap-in (swapped -> running), finishing (running -> finished) and prompts ignored
    (waiting -> finished)."""
    moves: Counter = Counter()
    where: dict[str, str] = {}
    for r in records:
        now = {rid: q for q in QUEUES for rid in getattr(r, q)}
        for rid in r.finished:
            now[rid] = FINISHED
        for rid in r.ignored:
            now[rid] = FINISHED
        for rid, q in now.items():
            before = where.get(rid, ARRIVES)
            if before == ARRIVES and q != "waiting":
                moves[(ARRIVES, "waiting")] += 1  # arrived and moved on in the same round
                before = "waiting"
            if rid in r.preempted and rid not in r.swapped_out and q == "waiting":
                moves[("running", "waiting")] += 1
                if before == "running":
                    continue
            if before != q:
                moves[(before, q)] += 1
        where.update(now)
    return moves


# -- one step of the engine -------------------------------------------------------------------

@dataclass(frozen=True)
class Call:
    """One call between the engine's parts: who called whom, which method, how deep."""

    caller: str
    callee: str
    method: str
    depth: int
    count: int = 1  # consecutive identical calls, merged


def _parts(engine) -> dict[str, tuple[object, tuple[str, ...]]]:
    """The lifelines and the methods on each that the trace wraps."""
    worker = engine.executor
    return {
        "LLMEngine": (engine, ("step",)),
        "Scheduler": (engine.scheduler, ("schedule", "update_num_computed_tokens", "check_stop", "fork_seq",
                                         "free_finished_seq_groups", "free_seq")),
        "BlockSpaceManager": (engine.scheduler.block_manager,
                              ("can_allocate", "allocate", "can_append_slot", "append_slot", "can_swap_in",
                               "swap_in", "can_swap_out", "swap_out", "free")),
        "Worker": (worker, ("execute_model", "prepare_inputs", "run")),
        "CacheEngine": (worker.cache_engine, ("swap_out", "swap_in", "copy")),
        "Model": (worker.model, ("forward", "compute_logits")),
        "Sampler": (engine.sampler, ("__call__",)),
    }


def trace_step(engine) -> list[Call]:
    """Run ``engine.step()`` once with its parts' methods wrapped; return the calls in order.
    The wrappers are instance attributes, removed afterwards (``Model.forward`` is reached
    through ``__call__``, so the model is traced through a wrapper of its ``forward``; the
    sampler, called as an object, through a stand-in attribute on the engine)."""
    calls: list[Call] = []
    stack: list[str] = ["LLMEngine"]
    patched: list[tuple[object, str, bool]] = []

    def wrap(line: str, fn, method: str):
        @functools.wraps(fn)
        def traced(*args, **kwargs):
            calls.append(Call(stack[-1], line, method, len(stack)))
            stack.append(line)
            try:
                return fn(*args, **kwargs)
            finally:
                stack.pop()
        return traced

    parts = _parts(engine)
    try:
        for line, (obj, methods) in parts.items():
            if line == "LLMEngine":
                continue
            for method in methods:
                if line == "Sampler":
                    patched.append((engine, "sampler", True))
                    engine.sampler = wrap(line, engine.sampler, "__call__")
                    continue
                had = method in vars(obj)
                patched.append((obj, method, had))
                setattr(obj, method, wrap(line, getattr(obj, method), method))
        engine.step()
    finally:
        for obj, method, had in reversed(patched):
            if obj is engine and method == "sampler":
                engine.sampler = engine.sampler.__wrapped__
            elif had:
                setattr(obj, method, getattr(obj, method).__wrapped__)
            else:
                delattr(obj, method)
    return merge_repeats(calls)


def merge_repeats(calls: list[Call]) -> list[Call]:
    merged: list[Call] = []
    for c in calls:
        last = merged[-1] if merged else None
        if last is not None and (last.caller, last.callee, last.method, last.depth) == (c.caller, c.callee,
                                                                                        c.method, c.depth):
            merged[-1] = Call(c.caller, c.callee, c.method, c.depth, last.count + 1)
        else:
            merged.append(c)
    return merged


LIFELINES = ("LLMEngine", "Scheduler", "BlockSpaceManager", "Worker", "CacheEngine", "Model", "Sampler")


def story_step_calls(loaded=None) -> tuple[list[Call], int]:
    """The calls of the first step of the s0/s1/s2 walkthrough (swap) that swaps a request out,
    on ``loaded`` (default the tiny random Llama, given the story's 5, 5 and 3 prompt tokens),
    and that round's number. The walkthrough runs once to find the round, then again up to it."""
    from tinyserve import presets
    from tinyserve.lab.tracing import seed_llm_engine
    from tinyserve.models.tiny import tiny_model

    loaded = loaded or tiny_model()
    ids = {rid: [10 + i] * n for i, (rid, n) in enumerate(presets.SEED_PROMPT_LENS.items())}
    engine = seed_llm_engine(loaded, "swap", prompt_token_ids=ids)
    while engine.has_unfinished_requests():
        engine.step()
    target = next(r.round for r in engine.history if r.swapped_out)
    engine = seed_llm_engine(loaded, "swap", prompt_token_ids=ids)
    for _ in range(target - 1):
        engine.step()
    return trace_step(engine), target
