"""Checkers for chapter 11, performance.

- ``check_static_efficiency``: the share of computed decode slots that produce a wanted token
  under static batching, against ``lab.batching.static_batching``.
- ``check_kv_utilization``: the share of allocated KV slots holding a token over a whole run,
  against the memory benchmark's ``lab.perf.no_model.kv_utilization`` (the real scheduler).
- ``check_decode_chunks``: a rule of the reader's own for cutting a decode batch into
  sub-batches (longest context first, where the package goes shortest first), against a
  reference here; then the rule cuts every decode batch of the tiny model in the real engine's
  ``torch-batched`` backend, whose tokens must equal the plain torch backend's.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from tinyserve.attention.batched import BatchedTorchBackend
from tinyserve.exercises.engine_runs import run_engine, same_tokens, tiny
from tinyserve.exercises.verdict import checker, run_cases, verdict
from tinyserve.lab.batching import static_batching
from tinyserve.lab.perf.no_model import kv_utilization
from tinyserve.sim import Request


def _close(got, expected) -> bool:
    return abs(got - expected) <= 1e-9


def static_efficiency_reference(output_lens: list[int], batch_size: int) -> float:
    """Useful decode slots over computed ones, read off the static-batching rounds: every member
    of a batch computes in every round of its batch, wanted or not."""
    records = static_batching([Request(f"r{i}", 4, n) for i, n in enumerate(output_lens)], batch_size)
    return sum(len(r.batch) for r in records) / sum(len(r.running) for r in records)


@checker(chapter=11, answer="static_efficiency")
def check_static_efficiency(fn: Callable[[list[int], int], float], num_cases: int = 60, seed: int = 0) -> bool:
    """``fn(output_lens, batch_size)``: under static batching (batches of ``batch_size`` requests
    in order, each running until its longest member is done), the share of computed token slots
    that produce a token some request wants."""
    rng = random.Random(seed)
    cases = [(([5], 1), 1.0), (([4, 4, 4], 2), 1.0), (([1, 9], 2), static_efficiency_reference([1, 9], 2))]
    while len(cases) < num_cases:
        lens = [rng.randint(1, 40) for _ in range(rng.randint(1, 20))]
        bs = rng.randint(1, 8)
        cases.append(((lens, bs), static_efficiency_reference(lens, bs)))
    return run_cases("static_efficiency", lambda lens, bs: fn(list(lens), bs), cases, same=_close)


@checker(chapter=11, answer="kv_utilization")
def check_kv_utilization(fn: Callable[[list[int], list[int], int], float], num_cases: int = 40,
                         seed: int = 1) -> bool:
    """``fn(prompt_lens, output_lens, block_size)``: every request starts in round 1 (its prefill
    computes the prompt and yields its first token) and then decodes one token a round until it
    has ``output_len`` tokens, when it frees its blocks. After each round, a running request holds
    the tokens computed so far in just enough blocks. Return the sum over rounds of tokens held
    over the sum of slots allocated (paged, ``block_size`` tokens a block)."""
    rng = random.Random(seed)
    cases = []
    while len(cases) < num_cases:
        n = rng.randint(1, 8)
        prompts = [rng.randint(1, 100) for _ in range(n)]
        outputs = [rng.randint(2, 60) for _ in range(n)]  # 1-token outputs would hold nothing at all
        bs = rng.choice([1, 4, 8, 16, 32])
        expected = kv_utilization(prompts, outputs, bs, max_num_seqs=8, max_model_len=4096)["paged"]
        cases.append(((prompts, outputs, bs), expected))
    return run_cases("kv_utilization", lambda p, o, bs: fn(list(p), list(o), bs), cases, same=_close)


def longest_first_reference(context_lens: list[int], block_size: int, budget: int) -> list[list[int]]:
    """Rows from the longest context down (ties: lower row first). The first row of a sub-batch
    is its widest, so it fixes the width every later row is padded to."""
    order = sorted(range(len(context_lens)), key=lambda r: (-context_lens[r], r))
    pieces: list[list[int]] = []
    width = 0
    for r in order:
        if pieces and (len(pieces[-1]) + 1) * width <= budget:
            pieces[-1].append(r)
        else:
            pieces.append([r])
            width = -(-context_lens[r] // block_size) * block_size
    return [sorted(piece) for piece in pieces]


@checker(chapter=11, answer="decode_chunks")
def check_decode_chunks(fn: Callable[[list[int], int, int], list[list[int]]], num_cases: int = 60,
                        seed: int = 2) -> bool:
    """``fn(context_lens, block_size, budget)``: cut a decode batch into sub-batches, visiting
    rows from the **longest** context down (ties: lower row first). A row joins the current
    sub-batch unless the sub-batch already has rows and (rows in it, counting the new one) x
    (its width: its first row's context rounded up to whole blocks) would exceed ``budget``
    slots; then it starts a new one. Return each sub-batch's row indices, sorted, in the order
    the sub-batches were made.

    The last case puts ``fn`` into the engine: the tiny model runs with a ``torch-batched``
    backend whose decode batches ``fn`` cuts (24 slots a sub-batch, so they really are cut), and
    its greedy tokens must equal the plain torch backend's (only when the other cases pass)."""
    rng = random.Random(seed)
    cases = [(([3, 9], 4, 16), [[1], [0]]), (([5, 5, 5], 4, 16), [[0, 1], [2]])]
    while len(cases) < num_cases:
        ctx = [rng.randint(1, 400) for _ in range(rng.randint(1, 40))]
        bs = rng.choice([8, 16, 32])
        budget = rng.choice([bs, 256, 1024, 4096, 10**6])
        cases.append(((ctx, bs, budget), longest_first_reference(ctx, bs, budget)))
    if not run_cases("decode_chunks", lambda c, bs, b: [list(x) for x in fn(list(c), bs, b)], cases):
        return False
    cfg = tiny().model.config
    row_values = cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads)
    pieces: list[int] = []

    def split(rows, context_lens, block_size, values, budget):
        # The engine counts values (slots x KV heads x head_dim); the exercise counts slots.
        cut = [[rows[i] for i in piece] for piece in fn([context_lens[r] for r in rows], block_size, budget // values)]
        pieces.append(len(cut))
        return cut

    package = run_engine("torch backend")
    yours = run_engine("your cut", attention_backend=BatchedTorchBackend(gather_budget=24 * row_values, split=split))
    failures = []
    if not same_tokens(yours, package):
        failures.append(f"in the engine: {yours.error or 'other tokens than the torch backend'}")
    elif max(pieces, default=0) < 2:
        failures.append("in the engine: no decode batch was cut in more than one piece")
    return verdict("decode_chunks", failures, num_cases + 1)
