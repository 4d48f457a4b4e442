"""Checkers for the exercises of chapters 01-03: the KV cache, block tables, the BlockSpaceManager.

Each ``check_*`` takes the reader's function, runs it on random cases (plus the edge cases a
first attempt usually misses), compares with what the package computes, prints a verdict and
returns True or False. The expected answers come from the package itself: the real
``BlockAllocator``, ``Sequence``, ``slot_mapping`` and ``BlockSpaceManager`` run on the same case.
"""

from __future__ import annotations

import random
import reprlib
from collections.abc import Callable

from tinyserve.block import slot_mapping
from tinyserve.block_manager import AllocStatus, BlockSpaceManager
from tinyserve.exercises.verdict import verdict
from tinyserve.sequence import SamplingParams, Sequence, SequenceGroup, SequenceStatus
from tinyserve.viz.kv_cache import MODELS, FirstFitArena, kv_bytes_per_token

_repr = reprlib.Repr()
_repr.maxlist = _repr.maxdict = 8
_repr.maxother = 80


def _fmt_args(args: tuple) -> str:
    return ", ".join(_repr.repr(a) for a in args)


def _check(name: str, fn: Callable, cases: list[tuple[tuple, object]],
           same: Callable[[object, object], bool] = lambda a, b: a == b) -> bool:
    """Call ``fn(*args)`` for each case; a case fails if it raises or returns something else."""
    failures = []
    for args, expected in cases:
        try:
            got = fn(*args)
        except Exception as e:  # the reader's code: report any error as a failed case
            failures.append(f"{name.split()[0]}({_fmt_args(args)}) raised {type(e).__name__}: {e}")
            continue
        if not same(got, expected):
            failures.append(f"({_fmt_args(args)}) -> {_repr.repr(got)}, expected {_repr.repr(expected)}")
    return verdict(name, failures, len(cases))


# -- chapter 01: the KV cache ----------------------------------------------------------------


def check_kv_bytes_per_token(fn: Callable[[int, int, int, int], int], num_cases: int = 100, seed: int = 0) -> bool:
    """``fn(num_layers, num_kv_heads, head_dim, dtype_bytes)``: bytes of K/V cache per token."""
    rng = random.Random(seed)
    cases = [((s.num_layers, s.num_kv_heads, s.head_dim, b), kv_bytes_per_token(s.num_layers, s.num_kv_heads,
                                                                                s.head_dim, b))
             for s in MODELS.values() for b in (2, 4)]
    while len(cases) < num_cases:
        args = (rng.randint(1, 96), rng.randint(1, 64), rng.choice([32, 64, 80, 96, 128, 256]), rng.choice([1, 2, 4]))
        cases.append((args, kv_bytes_per_token(*args)))
    return _check("kv_bytes_per_token", fn, cases)


def check_reserved_waste(fn: Callable[[list[int], int], int], num_cases: int = 100, seed: int = 0) -> bool:
    """``fn(seq_lens, max_model_len)``: slots reserved but holding no token, when every sequence
    reserves ``max_model_len`` contiguous slots."""
    rng = random.Random(seed)
    cases = [(([], 16), 0), (([16], 16), 0)]
    while len(cases) < num_cases:
        max_len = rng.choice([16, 64, 512, 2048])
        lens = [rng.randint(1, max_len) for _ in range(rng.randint(1, 12))]
        cases.append(((lens, max_len), sum(max_len - n for n in lens)))
    return _check("reserved_waste", fn, cases)


def check_paged_waste(fn: Callable[[list[int], int], int], num_cases: int = 150, seed: int = 0) -> bool:
    """``fn(seq_lens, block_size)``: slots allocated but holding no token under paging, when each
    sequence holds just enough blocks (only its last block can be partly empty)."""
    rng = random.Random(seed)
    cases = [(([], 16), 0), (([16], 16), 0), (([1], 16), 15), (([32, 33], 16), 15)]
    while len(cases) < num_cases:
        bs = rng.choice([1, 4, 8, 16, 32])
        # Half the lengths are exact multiples of the block size: a full last block wastes nothing.
        lens = [rng.randint(1, 12) * bs if rng.random() < 0.5 else rng.randint(1, 400)
                for _ in range(rng.randint(1, 10))]
        expected = sum(Sequence(0, None, [0] * n, bs).n_blocks * bs - n for n in lens)
        cases.append(((lens, bs), expected))
    return _check("paged_waste", fn, cases)


def check_first_fit(fn: Callable[[list[tuple[int, int]], int, int], int | None], num_cases: int = 200,
                    seed: int = 0) -> bool:
    """``fn(runs, arena_size, length)``: where a first-fit contiguous allocator places a run of
    ``length`` slots, given the ``(start, length)`` runs already reserved (in any order); None
    if no hole is long enough, even when the free slots add up to enough (external fragmentation)."""
    rng = random.Random(seed)
    cases = [(([], 10, 10), 0), (([], 10, 11), None), (([(0, 4), (6, 4)], 10, 2), 4),
             (([(6, 4), (0, 4)], 10, 3), None), (([(0, 4)], 10, 6), 4)]
    while len(cases) < num_cases:
        size = rng.randint(4, 64)
        arena = FirstFitArena(size)
        for owner in range(rng.randint(0, 10)):
            if not arena.reserve(owner, rng.randint(1, max(1, size // 4))):
                break
        for owner in list(arena.runs):  # free some, to leave holes
            if rng.random() < 0.4:
                arena.release(owner)
        runs = list(arena.runs.values())
        rng.shuffle(runs)
        length = rng.randint(1, max(1, size // 2))
        probe = FirstFitArena(size)
        probe.runs = dict(arena.runs)
        expected = probe.runs["new"][0] if probe.reserve("new", length) else None
        cases.append(((runs, size, length), expected))
    return _check("first_fit", fn, cases)


# -- chapter 02: sequences and block tables ----------------------------------------------------


def check_num_blocks(fn: Callable[[int, int], int], num_cases: int = 200, seed: int = 0) -> bool:
    """``fn(num_tokens, block_size)``: how many blocks a sequence of that many tokens needs."""
    rng = random.Random(seed)
    cases = []
    for n, bs in [(0, 16), (1, 16), (15, 16), (16, 16), (17, 16), (32, 16), (5, 1), (7, 8)]:
        cases.append(((n, bs), Sequence(0, None, [0] * n, bs).n_blocks))
    while len(cases) < num_cases:
        bs = rng.choice([1, 2, 4, 5, 8, 16, 32])
        n = rng.randint(0, 20) * bs if rng.random() < 0.4 else rng.randint(0, 500)
        cases.append(((n, bs), Sequence(0, None, [0] * n, bs).n_blocks))
    return _check("num_blocks", fn, cases)


def check_logical_blocks(fn: Callable[[list[int], int], list[list[int]]], num_cases: int = 100,
                         seed: int = 0) -> bool:
    """``fn(token_ids, block_size)``: the sequence's tokens cut into logical blocks (a list of
    lists, each at most ``block_size`` long), as ``Sequence.logical_token_blocks`` holds them."""
    rng = random.Random(seed)
    cases = []
    for i in range(num_cases):
        bs = rng.choice([1, 2, 3, 4, 8, 16])
        tokens = [rng.randint(0, 49_151) for _ in range(bs * rng.randint(1, 4) if i % 4 == 0 else rng.randint(1, 60))]
        # Build the reference the way the engine does: a prompt, then tokens appended one by one.
        k = rng.randint(1, len(tokens))
        seq = Sequence(0, None, tokens[:k], bs)
        for t in tokens[k:]:
            seq.append_token_id(t)
        cases.append(((tokens, bs), [b.token_ids for b in seq.logical_token_blocks]))
    return _check("logical_blocks", fn, cases, same=lambda a, b: [list(x) for x in a] == b)


def check_slot_mapping(fn: Callable[[list[int], int, int, int], list[int]], num_cases: int = 200,
                       seed: int = 0) -> bool:
    """``fn(block_table, start, end, block_size)``: the cache slots of the tokens at positions
    ``start .. end-1`` (block number times block size plus the offset inside the block)."""
    rng = random.Random(seed)
    cases = []
    while len(cases) < num_cases:
        bs = rng.choice([1, 2, 4, 8, 16])
        num_blocks = rng.randint(1, 8)
        table = rng.sample(range(64), num_blocks)  # physical blocks are scattered, never in order
        end = rng.randint(1, num_blocks * bs)
        # Prefill (from 0), decode (the last token alone) or a chunk in the middle.
        start = rng.choice([0, end - 1, rng.randint(0, end - 1)])
        cases.append(((table, start, end, bs), slot_mapping(table, start, end, bs)))
    return _check("slot_mapping", fn, cases, same=lambda a, b: list(a) == b)


# -- chapter 03: the BlockSpaceManager ---------------------------------------------------------


def _status(x) -> AllocStatus | None:
    if isinstance(x, AllocStatus):
        return x
    if isinstance(x, str) and x.upper() in AllocStatus.__members__:
        return AllocStatus[x.upper()]
    return None


def _group(request_id: str, prompt_len: int, block_size: int, n: int = 1, seq_id: int = 0) -> SequenceGroup:
    params = SamplingParams(n=n, temperature=1.0 if n > 1 else 0.0)
    return SequenceGroup(request_id, [Sequence(seq_id, None, list(range(prompt_len)), block_size)], params, 0.0)


def check_can_allocate(fn: Callable[[int, int, int, float], AllocStatus | str], num_cases: int = 300,
                       seed: int = 0) -> bool:
    """``fn(num_required_blocks, num_free_gpu_blocks, num_total_gpu_blocks, watermark)``: OK, LATER
    or NEVER (an ``AllocStatus`` or its name), as ``BlockSpaceManager.can_allocate`` decides."""
    rng = random.Random(seed)
    cases = []
    while len(cases) < num_cases:
        bs = rng.choice([1, 4, 16])
        total = rng.randint(1, 120)
        watermark = rng.choice([0.0, 0.01, 0.05, 0.1, 0.25])
        bm = BlockSpaceManager(bs, total, 0, watermark)
        used = rng.randint(0, total)
        if used:
            bm.allocate(_group("filler", used * bs, bs, seq_id=1))
        free = total - used
        # Aim at the boundaries half the time: exactly the watermark left, or one block short.
        if rng.random() < 0.5:
            required = max(1, rng.choice([free, total]) - bm.watermark_blocks + rng.choice([-1, 0, 1]))
        else:
            required = rng.randint(1, total + 4)
        group = _group("new", rng.randint((required - 1) * bs + 1, required * bs), bs)
        cases.append(((required, free, total, watermark), bm.can_allocate(group)))
    return _check("can_allocate", fn, cases, same=lambda a, b: _status(a) == b)


def _forked_scenario(rng: random.Random):
    """A manager holding one request with a few samples that have already decoded some tokens,
    plus a neighbour, so free lists and ref counts look like a real run."""
    bs = rng.choice([2, 3, 4, 8])
    bm = BlockSpaceManager(bs, 48, 48, 0.0)
    next_token = iter(range(10_000, 20_000))
    other = _group("other", rng.randint(1, 3 * bs), bs, seq_id=100)
    bm.allocate(other)
    group = _group("req", rng.randint(1, 4 * bs), bs, n=3)
    bm.allocate(group)
    parent = group.get_seqs()[0]
    parent.status = SequenceStatus.RUNNING
    seqs = [parent]
    for i in range(rng.randint(0, 2)):
        child = parent.fork(1 + i)
        group.add(child)
        bm.fork(parent, child)
        seqs.append(child)
    for _ in range(rng.randint(0, 2 * bs)):
        for s in seqs:
            s.append_token_id(next(next_token))
            bm.append_slot(s)
    if rng.random() < 0.3:  # the neighbour frees its blocks: they go to the back of the free list
        bm.free(other.get_seqs()[0])
    return bm, group, seqs, next_token


def check_append_slot(fn: Callable[[list[int], dict[int, int], int, int, list[int]], tuple],
                      num_cases: int = 200, seed: int = 0) -> bool:
    """``fn(block_table, ref_counts, seq_len, block_size, free_list)`` -> ``(new_block_table, cow)``.

    A token was just appended to a sequence (``seq_len`` counts it); make room for it as
    ``append_slot`` does. ``ref_counts`` maps each block of the table to its ref count;
    ``free_list`` is the GPU free list, next block out first. ``cow`` is ``(src, dst)`` when the
    last block was shared and had to be copied, else None.
    """
    rng = random.Random(seed)
    cases = []
    while len(cases) < num_cases:
        bm, _, seqs, tokens = _forked_scenario(rng)
        seq = rng.choice(seqs)
        seq.append_token_id(next(tokens))
        table = bm.block_tables[seq.seq_id]
        args = ([b.block_number for b in table], {b.block_number: b.ref_count for b in table}, seq.get_len(),
                bm.block_size, [b.block_number for b in bm.gpu_allocator.free_blocks])
        cow = bm.append_slot(seq)
        cases.append((args, (bm.get_block_table(seq), cow)))
    return _check("append_slot", fn, cases,
                  same=lambda a, b: isinstance(a, tuple) and len(a) == 2 and list(a[0]) == b[0]
                  and (None if a[1] is None else tuple(a[1])) == b[1])


def check_swap_out_mapping(fn: Callable[[list[list[int]], list[int]], dict[int, int]], num_cases: int = 150,
                           seed: int = 0) -> bool:
    """``fn(block_tables, cpu_free_list)`` -> ``{gpu block: cpu block}``, what ``swap_out``
    returns for a group whose sequences have these GPU block tables (in the group's order).
    A block shared by several samples moves once; CPU blocks come off the free list in order."""
    rng = random.Random(seed)
    cases = []
    while len(cases) < num_cases:
        bm, group, seqs, _ = _forked_scenario(rng)
        for _ in range(rng.randint(0, 3)):  # used CPU blocks make the free list less obvious
            bm.cpu_allocator.free_blocks.rotate(rng.randint(0, 5))
        args = ([bm.get_block_table(s) for s in group.get_seqs(SequenceStatus.RUNNING)],
                [b.block_number for b in bm.cpu_allocator.free_blocks])
        cases.append((args, bm.swap_out(group)))
    return _check("swap_out_mapping", fn, cases, same=lambda a, b: isinstance(a, dict) and dict(a) == b)


def check_can_swap_in(fn: Callable[[int, int, int, int, float], bool], num_cases: int = 200, seed: int = 0) -> bool:
    """``fn(num_group_blocks, num_swapped_seqs, num_free_gpu_blocks, num_total_gpu_blocks, watermark)``:
    can a swapped group come back? It needs its distinct blocks plus one block per sequence (for
    the token each appends next), and must leave the watermark free, unless the GPU is empty:
    then no running sequence needs the reserve."""
    rng = random.Random(seed)
    cases = []
    while len(cases) < num_cases:
        bs = rng.choice([2, 4])
        total = rng.randint(4, 100)
        watermark = rng.choice([0.0, 0.01, 0.05, 0.1, 0.2])
        bm = BlockSpaceManager(bs, total, 128, watermark)
        # Sometimes a group as large as the GPU allows: coming back is then a close call.
        longest = total * bs if rng.random() < 0.3 else 3 * bs
        group = _group("req", rng.randint(1, longest), bs, n=2)
        if bm.can_allocate(group) != AllocStatus.OK:
            continue
        bm.allocate(group)
        parent = group.get_seqs()[0]
        parent.status = SequenceStatus.RUNNING
        seqs = [parent]
        if rng.random() < 0.6:
            child = parent.fork(1)
            group.add(child)
            bm.fork(parent, child)
            seqs.append(child)
        bm.swap_out(group)
        for s in seqs:
            s.status = SequenceStatus.SWAPPED
        num_group_blocks = len({b for s in seqs for b in bm.get_block_table(s)})
        free = bm.get_num_free_gpu_blocks()
        # Half the time leave just about what the group needs: the boundary is where rules differ.
        roll = rng.random()
        if roll < 0.15:
            target = free  # nothing else on the GPU
        elif roll < 0.6:
            target = num_group_blocks + len(seqs) + bm.watermark_blocks + rng.choice([-1, 0, 1])
        else:
            target = rng.randint(0, free)
        if 0 <= target < free:
            bm.allocate(_group("filler", (free - target) * bs, bs, seq_id=50))
        args = (num_group_blocks, len(seqs), bm.get_num_free_gpu_blocks(), total, watermark)
        cases.append((args, bm.can_swap_in(group)))
    return _check("can_swap_in", fn, cases, same=lambda a, b: a is not None and bool(a) == b)
