"""Deliberately wrong answers for every exercise checker: checker name -> list of wrong answers.

tests/test_exercises.py runs each checker on each entry and expects a failure. Each entry is a
plausible mistake a reader makes (an off-by-one, the wrong end of a queue, a forgotten
watermark), commented with what is wrong. One ``MISTAKES.update({...})`` block per chapter, so a
chapter's entries sit together; answers that need more than a lambda are defined just above
their block.
"""

from __future__ import annotations

import functools
import heapq
import runpy
from pathlib import Path

from tinyserve.block import BlockAllocator, Device, OutOfBlocksError, PhysicalTokenBlock
from tinyserve.block_manager import BlockSpaceManager
from tinyserve.sequence import SequenceStatus

MISTAKES: dict[str, list] = {}

# -- chapter 00: the overview ------------------------------------------------------------------


def _play(prompt_lens, output_lens, token_budget, skip=False, block_size=1, num_gpu_blocks=0, free_late=False):
    """The rounds, with two classic slips: skipping a prompt that does not fit to take a later
    one (``skip``), and returning a finished request's blocks a round late (``free_late``)."""
    waiting, running, cached, made, rounds, done = list(range(len(prompt_lens))), [], {}, {}, [], []
    while waiting or running:
        admitted, budget = [], token_budget
        for i in list(waiting):
            if prompt_lens[i] <= budget:
                budget -= prompt_lens[i]
                admitted.append(i)
                waiting.remove(i)
            elif not skip:
                break
        if admitted:
            phase, tokens = "prefill", sum(prompt_lens[i] for i in admitted)
            for i in admitted:
                cached[i], made[i] = prompt_lens[i], 1
            running += admitted
        else:
            phase, tokens = "decode", len(running)
            for i in running:
                cached[i] += 1
                made[i] += 1
        holding = running + (done if free_late else [])
        done = [i for i in running if made[i] >= output_lens[i]]
        running = [i for i in running if made[i] < output_lens[i]]
        free = num_gpu_blocks - sum(-(-cached[i] // block_size) for i in (holding if free_late else running))
        rounds.append((phase, tokens, free))
    return rounds


MISTAKES.update({
    "check_round_phases": [
        lambda p, o, b: [ph for ph, _, _ in _play(p, o, b, skip=True)],          # skips a prompt that does not fit
        lambda p, o, b: ["prefill"] + ["decode"] * (max(o) - 1),                  # assumes everyone fits in round 1
    ],
    "check_tokens_per_round": [
        lambda p, o, b: [t for _, t, _ in _play(p, o, b, skip=True)],
        lambda p, o, b: [t if ph == "prefill" else t + 1 for ph, t, _ in _play(p, o, b)],  # counts one too many
    ],
    "check_free_blocks": [
        lambda p, o, b, bs, g: [f for _, _, f in _play(p, o, b, block_size=bs, num_gpu_blocks=g, free_late=True)],
        lambda p, o, b, bs, g: [g - sum(-(-(n + 1) // bs) for n in p) for _ in _play(p, o, b)],  # never grows
    ],
})

# -- chapter 01: the KV cache ------------------------------------------------------------------


def _first_fit(runs, arena_size, length):
    pos = 0
    for start, n in sorted(runs) + [(arena_size, 0)]:
        if start - pos >= length:
            return pos
        pos = start + n
    return None


def _best_fit_rightmost(runs, arena_size, length):
    holes, pos = [], 0
    for start, n in sorted(runs) + [(arena_size, 0)]:
        if start - pos >= length:
            holes.append((start - pos, -pos))
        pos = start + n
    return -min(holes)[1] if holes else None


def _worst_fit(runs, arena_size, length):
    holes, pos = [], 0
    for start, n in sorted(runs) + [(arena_size, 0)]:
        if start - pos >= length:
            holes.append((-(start - pos), pos))
        pos = start + n
    return min(holes)[1] if holes else None


MISTAKES.update({
    "check_window_kv_bytes": [
        lambda n, L, H, D, b, w_layers, w: (L * n - w_layers * min(n, w)) * 2 * H * D * b,   # windows swapped
        lambda n, L, H, D, b, w_layers, w: ((L - w_layers) * n + w_layers * w) * 2 * H * D * b,  # window always full
        lambda n, L, H, D, b, w_layers, w: ((L - w_layers) * n + w_layers * min(n, w)) * H * D * b,  # forgot the V
    ],
    "check_reserved_waste": [
        lambda lens, M: M * len(lens) - sum(lens) + len(lens),   # off by one per sequence
        lambda lens, M: sum(M - n for n in lens if n < M // 2),  # forgot the long ones
    ],
    "check_paged_waste": [
        lambda lens, bs: sum(bs - n % bs for n in lens),   # a full last block "wastes" bs
        lambda lens, bs: sum(n % bs for n in lens),        # counted the used part
    ],
    "check_best_fit": [_first_fit, _best_fit_rightmost, _worst_fit],
})

# -- chapter 02: sequences and block tables ----------------------------------------------------


def _slot_owner(block_tables, seq_lens, slot, block_size, check_len=True, times_bs=True):
    for name, table in block_tables.items():
        for i, block in enumerate(table):
            start = block * block_size if times_bs else block
            if start <= slot < start + block_size:
                pos = i * block_size + slot - start
                return (name, pos) if pos < seq_lens[name] or not check_len else None
    return None


class _HeapAllocator:
    """Lowest number first, with switches for the slips a first version makes."""

    def __init__(self, device, block_size, num_blocks, *, owners=True, raises=True, checks_double=True):
        self.device, self.block_size, self.num_blocks = device, block_size, num_blocks
        self.owners, self.raises, self.checks_double = owners, raises, checks_double
        self.blocks = [PhysicalTokenBlock(device, i, block_size) for i in range(num_blocks)]
        self.free_numbers = list(range(num_blocks))

    def allocate(self):
        if not self.free_numbers:
            if self.raises:
                raise OutOfBlocksError("empty")
            return None
        block = self.blocks[heapq.heappop(self.free_numbers)]
        block.ref_count = 1
        return block

    def free(self, block):
        if block.ref_count == 0:
            if self.checks_double:
                raise ValueError("double free")
            heapq.heappush(self.free_numbers, block.block_number)
            return
        block.ref_count = block.ref_count - 1 if self.owners else 0
        if block.ref_count == 0:
            heapq.heappush(self.free_numbers, block.block_number)

    def get_num_free_blocks(self):
        return len(self.free_numbers)


class _HighestFirstAllocator(_HeapAllocator):
    def allocate(self):
        if not self.free_numbers:
            raise OutOfBlocksError("empty")
        number = max(self.free_numbers)
        self.free_numbers.remove(number)
        heapq.heapify(self.free_numbers)
        block = self.blocks[number]
        block.ref_count = 1
        return block


MISTAKES.update({
    "check_num_blocks": [
        lambda n, bs: n // bs + 1,                         # one too many at exact multiples
        lambda n, bs: n // bs,                             # drops the partial block
        lambda n, bs: max(1, (n + bs - 1) // bs),          # an empty sequence needs no block
    ],
    "check_slot_owner": [
        lambda t, n, s, bs: _slot_owner(t, n, s, bs, check_len=False),   # the empty tail "holds" tokens
        lambda t, n, s, bs: _slot_owner(t, n, s, bs, times_bs=False),    # forgot * block_size
        lambda t, n, s, bs: next(((k, s % bs) for k, tb in t.items() if s // bs in tb), None),  # offset only
    ],
    "check_allocator": [
        BlockAllocator,                                          # the chapter's own: oldest free first
        _HighestFirstAllocator,
        functools.partial(_HeapAllocator, owners=False),        # frees a shared block at its first owner's free
        functools.partial(_HeapAllocator, raises=False),        # returns None on an empty pool
        functools.partial(_HeapAllocator, checks_double=False),  # a double free goes unnoticed
    ],
})

# -- chapter 03: the BlockSpaceManager ---------------------------------------------------------


MISTAKES.update({
    "check_group_blocks": [
        lambda p, n, t, bs: -(-p // bs) + n * (-(-(p + t) // bs) - -(-p // bs)),  # no copy-on-write
        lambda p, n, t, bs: n * -(-(p + t) // bs),                                  # nothing shared
        lambda p, n, t, bs: p // bs + n * (-(-(p + t + 1) // bs) - p // bs) if t else -(-p // bs),  # off by one
    ],
})

# -- chapter 04: iteration-level scheduling ----------------------------------------------------


def _orca_batches(requests, prefill_makes_token=True, skip_empty=False):
    left = {r.request_id: r.output_len + (0 if prefill_makes_token else 1) for r in requests}
    sizes = []
    while any(left.values()):
        now = len(sizes) + 1
        batch = [r.request_id for r in requests if r.arrival_round <= now and left[r.request_id] > 0]
        for rid in batch:
            left[rid] -= 1
        sizes.append(len(batch))
    return [n for n in sizes if n] if skip_empty else sizes


def _finish(requests, policy, one_prefill_at_a_time=False, vllm_like_orca=False):
    left = {r.request_id: r.output_len for r in requests}
    started, done, now = [], {}, 0
    while len(done) < len(requests):
        now += 1
        new = [r.request_id for r in requests if r.arrival_round <= now and r.request_id not in started]
        if policy == "vllm" and new and not vllm_like_orca:
            batch = new[:1] if one_prefill_at_a_time else new
        else:
            batch = [rid for rid in started if rid not in done] + new
        for rid in batch:
            if rid not in started:
                started.append(rid)
            left[rid] -= 1
            if left[rid] == 0:
                done[rid] = now
    return done


class _Reservation:
    """Orca's rule with a switch for each slip."""

    def __init__(self, against_free=False, release=True, in_tokens=False, prompt_only=False):
        self.reserved = {}
        self.against_free, self.release = against_free, release
        self.in_tokens, self.prompt_only = in_tokens, prompt_only

    def __call__(self, group, budget, block_manager):
        bs = block_manager.block_size
        tokens = group.get_seqs()[0].get_prompt_len() + (0 if self.prompt_only else group.sampling_params.max_tokens)
        need = tokens if self.in_tokens else -(-tokens // bs)
        held = sum(b for rid, (g, b) in self.reserved.items()
                   if rid != group.request_id and not (self.release and g.is_finished()))
        if self.against_free:  # the blocks running requests hold are counted twice
            ok = held + need <= block_manager.get_num_free_gpu_blocks()
        else:
            ok = held + need <= block_manager.num_total_gpu_blocks * (bs if self.in_tokens else 1)
        if ok:
            self.reserved[group.request_id] = (group, need)
        return ok


MISTAKES.update({
    "check_orca_batches": [
        lambda reqs: _orca_batches(reqs, skip_empty=True),           # drops rounds before the first arrival
        lambda reqs: _orca_batches(reqs, prefill_makes_token=False),  # the prefill makes no token
    ],
    "check_finish_rounds": [
        lambda reqs, p: _finish(reqs, p, vllm_like_orca=True),        # vLLM mixing phases
        lambda reqs, p: _finish(reqs, p, one_prefill_at_a_time=True),
    ],
    "check_orca_reservation": [
        lambda: (lambda group, budget, block_manager: True),          # no reservation at all
        lambda: _Reservation(against_free=True),
        lambda: _Reservation(release=False),                          # reservations are never given back
        lambda: _Reservation(in_tokens=True),                         # reserves slots, not whole blocks
        lambda: _Reservation(prompt_only=True),
    ],
})

# -- chapter 05: the vLLM scheduler ------------------------------------------------------------


def _admission(waiting, token_budget, max_num_seqs, num_free_blocks, block_size, skip=False, blocks=True,
               seqs=True, ignore_long=True, ignore_big=True):
    out, budget, free = [], token_budget, num_free_blocks
    for rid, n in waiting:
        need = -(-n // block_size)
        if (ignore_long and n > token_budget) or (ignore_big and blocks and need > num_free_blocks):
            continue                                                    # can never run: ignored
        fits = n <= budget and (not seqs or len(out) < max_num_seqs) and (not blocks or need <= free)
        if not fits:
            if skip:
                continue
            break
        out.append(rid)
        budget -= n
        free -= need
    return out


def _preempted(running, needs_block, num_free_blocks, oldest_first=False, self_first=False, no_free=False):
    remaining, out, free = list(running), [], num_free_blocks
    while remaining:
        g = remaining.pop(0)
        if not needs_block[g]:
            continue
        if self_first and free == 0:
            out.append(g)
            free += 0 if no_free else 1
            continue
        while free == 0:
            if remaining:
                out.append(remaining.pop(0) if oldest_first else remaining.pop())
                free += 0 if no_free else 1
            else:
                out.append(g)
                break
        else:
            free -= 1
    return out


def _tokens(group):
    return sum(seq.get_len() for seq in group.get_seqs(SequenceStatus.RUNNING))


class _SwapWithHeadroom(BlockSpaceManager):
    """The cautious rule with a switch for each slip."""

    count_cpu = False      # counts every sequence with a block table, swapped ones too
    no_reserve = False     # drops the manager's reserve
    count_shared_twice = False

    def can_swap_in(self, seq_group):
        swapped = seq_group.get_seqs(SequenceStatus.SWAPPED)
        tables = [self.block_tables[s.seq_id] for s in swapped]
        blocks = sum(len(t) for t in tables) if self.count_shared_twice else len({id(b) for t in tables for b in t})
        others = len(self.block_tables) if self.count_cpu else \
            sum(1 for t in self.block_tables.values() if t[0].device == Device.GPU)
        reserve = 0 if self.no_reserve else self._reserve()
        return self.get_num_free_gpu_blocks() - (blocks + len(swapped) + others) >= reserve


class _CountsSwappedToo(_SwapWithHeadroom):
    count_cpu = True


class _NoReserve(_SwapWithHeadroom):
    no_reserve = True


class _SharedTwice(_SwapWithHeadroom):
    count_shared_twice = True


MISTAKES.update({
    "check_admission": [
        lambda *a: _admission(*a, skip=True),       # skips a prompt that does not fit to take a later one
        lambda *a: _admission(*a, blocks=False),    # forgets the cache
        lambda *a: _admission(*a, seqs=False),      # forgets max_num_seqs
        lambda *a: _admission(*a, ignore_long=False, ignore_big=False),  # stops at a never-fitting prompt
        lambda *a: _admission(*a, ignore_big=False),  # ignores a too-long prompt, waits for one bigger than the cache
    ],
    "check_preempted": [
        lambda *a: _preempted(*a, oldest_first=True),
        lambda *a: _preempted(*a, self_first=True),
        lambda *a: _preempted(*a, no_free=True),    # a preempted request's block is not freed
    ],
    "check_victim_policy": [
        lambda running: running[-1],                                    # the package's own: the newest
        lambda running: max(running, key=_tokens),                      # the oldest of equals
        lambda running: max(reversed(running), key=lambda g: g.get_seqs()[0].get_output_len()),  # most output
        lambda running: max(reversed(running[1:] or running), key=_tokens),  # never the one that needs the block
    ],
    "check_cautious_swap_in": [BlockSpaceManager, _CountsSwappedToo, _NoReserve, _SharedTwice],
})

# -- chapters 06-12 follow -----------------------------------------------------------------------

import json  # noqa: E402

import torch  # noqa: E402

# -- chapter 06: the CacheEngine ---------------------------------------------------------------


def _block_bytes(bs, layers, heads, head_dim, b):
    return 2 * layers * bs * heads * head_dim * b


def _split_x_unravel(offset, bs, heads, head_dim, x, token_outside=False):
    """Reads the offset in the wrong shape: the plain layout, or split-x with the token outside
    the channel pieces."""
    if token_outside:  # [blocks, heads, block_size, head_dim / x, x]
        rest, within = divmod(offset, x)
        rest, piece = divmod(rest, head_dim // x)
        rest, token = divmod(rest, bs)
        block, head = divmod(rest, heads)
        return block, token, head, piece * x + within
    rest, d = divmod(offset, head_dim)  # [blocks, block_size, heads, head_dim]
    rest, head = divmod(rest, heads)
    block, token = divmod(rest, bs)
    return block, token, head, d


MISTAKES.update({
    "check_max_seqs_in_budget": [
        # Counts tokens, not blocks: a sequence's partly filled last block costs nothing.
        lambda m, n, bs, L, H, D, b: m // (n * _block_bytes(1, L, H, D, b)),
        # Rounds the pool to whole blocks but shares the last block of one sequence with the next.
        lambda m, n, bs, L, H, D, b: (m // _block_bytes(bs, L, H, D, b)) * bs // n,
        lambda m, n, bs, L, H, D, b: (m // (_block_bytes(bs, L, H, D, b) // 2)) // -(-n // bs),  # forgot V
    ],
    "check_split_x_position": [
        _split_x_unravel,
        functools.partial(_split_x_unravel, token_outside=True),
    ],
})

# -- chapter 07: a Llama model on a paged cache -----------------------------------------------------


def _rotary_pairs(x, positions, theta, halves=False):
    """Rotate channel pairs: (2i, 2i+1), or Llama's (i, i + head_dim/2) when ``halves``."""
    d = x.shape[-1]
    first = torch.arange(d // 2) if halves else torch.arange(0, d, 2)
    second = first + d // 2 if halves else first + 1
    angles = positions.double()[:, None] * theta ** (-2 * torch.arange(d // 2, dtype=torch.float64) / d)
    cos, sin = angles.cos()[:, None, :].float(), angles.sin()[:, None, :].float()
    out = x.clone()
    out[..., first] = x[..., first] * cos - x[..., second] * sin
    out[..., second] = x[..., second] * cos + x[..., first] * sin
    return out


MISTAKES.update({
    "check_rotary_interleaved": [
        functools.partial(_rotary_pairs, halves=True),              # Llama's pairing, not GPT-J's
        lambda x, p, th: _rotary_pairs(x, p + 1, th),               # positions counted from 1
        lambda x, p, th: _rotary_pairs(x, p, 10_000.0),             # ignored theta
    ],
})

# -- chapter 08: the Triton paged-attention kernel ---------------------------------------------------
# The decode kernel's wrong answers are in tests/mistakes_ch08.py.

# -- chapter 09: the worker and the engine ------------------------------------------------------------


def _apply_round_in_order(gpu, cpu, swap_out, swap_in, copy, writes, order):
    gpu, cpu = list(gpu), list(cpu)
    for op in order:
        if op == "out":
            for g, c in swap_out.items():
                cpu[c] = gpu[g]
        elif op == "in":
            for c, g in swap_in.items():
                gpu[g] = cpu[c]
        elif op == "copy":
            for src, dsts in copy.items():
                for d in dsts:
                    gpu[d] = gpu[src]
        else:
            for b, value in writes.items():
                gpu[b] = value
    return gpu, cpu


MISTAKES.update({
    "check_worker_order": [functools.partial(_apply_round_in_order, order=order) for order in (
        ("model", "out", "in", "copy"),   # the model writes into a block before it is saved
        ("in", "out", "copy", "model"),   # a swap-in overwrites a block before it is saved
        ("out", "copy", "in", "model"),   # copies a block before its swapped-in contents arrive
    )] + [lambda *round_: 1 / 0],         # crashes: every case fails, and the checker still answers
})

# -- chapter 10: tensor parallelism -----------------------------------------------------------------


def _shapes_by_hand(cfg, k, kv_unsplit=False):
    q = cfg.num_attention_heads * cfg.head_dim // k
    kv = cfg.num_key_value_heads * cfg.head_dim // (1 if kv_unsplit else k)
    inter = cfg.intermediate_size // k
    return {"qkv_proj": (q + 2 * kv, cfg.hidden_size), "o_proj": (cfg.hidden_size, q),
            "gate_up_proj": (2 * inter, cfg.hidden_size), "down_proj": (cfg.hidden_size, inter)}


def _bytes_by_hand(cfg, k, b, split_embeddings=False):
    per_layer = sum(o * i for o, i in _shapes_by_hand(cfg, k).values()) + 2 * cfg.hidden_size
    embed = cfg.vocab_size * cfg.hidden_size // (k if split_embeddings else 1)
    head = 0 if cfg.tie_word_embeddings else embed
    return (cfg.num_hidden_layers * per_layer + embed + head + cfg.hidden_size) * b


def _plan_gathering_after_column(kinds):  # gathers every column-parallel output, even into a row layer
    return ["all-reduce" if k == "row" else "all-gather" if k == "column" else "none" for k in kinds]


MISTAKES.update({
    "check_shard_shapes": [functools.partial(_shapes_by_hand, kv_unsplit=True)],  # KV heads not split
    "check_weight_bytes_per_rank": [functools.partial(_bytes_by_hand, split_embeddings=True)],  # embedding cut
    "check_communication": [
        _plan_gathering_after_column,
        lambda kinds: ["all-reduce" if k == "row" else "none" for k in kinds],  # never a reduce-scatter
    ],
})

# -- chapter 11: performance ------------------------------------------------------------------------


def _kv_utilization(prompt_lens, output_lens, block_size, count_finishing_round=False):
    held = slots = 0
    for t in range(1, max(output_lens) + 1):
        for p, o in zip(prompt_lens, output_lens):
            if t < o or (count_finishing_round and t == o):
                n = p + t - 1
                held += n
                slots += -(-n // block_size) * block_size
    return held / slots


def _decode_chunks_shortest_first(context_lens, block_size, budget):  # the package's order, not the exercise's
    chunks = [[]]
    for r in sorted(range(len(context_lens)), key=lambda r: context_lens[r]):
        width = -(-context_lens[r] // block_size) * block_size
        if chunks[-1] and (len(chunks[-1]) + 1) * width > budget:
            chunks.append([])
        chunks[-1].append(r)
    return [sorted(c) for c in chunks]


def _decode_chunks_newest_width(context_lens, block_size, budget):  # pads to the row being added, the narrowest
    chunks = [[]]
    for r in sorted(range(len(context_lens)), key=lambda r: -context_lens[r]):
        width = -(-context_lens[r] // block_size) * block_size
        if chunks[-1] and (len(chunks[-1]) + 1) * width > budget:
            chunks.append([])
        chunks[-1].append(r)
    return [sorted(c) for c in chunks]


MISTAKES.update({
    "check_static_efficiency": [
        # Charges every batch as if it were full.
        lambda lens, bs: sum(lens) / sum(bs * max(lens[i:i + bs]) for i in range(0, len(lens), bs)),
    ],
    "check_kv_utilization": [
        functools.partial(_kv_utilization, count_finishing_round=True),  # holds blocks in the round it finishes
        lambda p, o, bs: 1.0,
    ],
    "check_decode_chunks": [_decode_chunks_shortest_first, _decode_chunks_newest_width,
                            lambda c, bs, b: [list(range(len(c)))]],
})

# -- chapter 12: prefix caching, chunked prefill, serving -----------------------------------------------


def _cached_whole_prompt(prompt, earlier, bs):  # forgets that the last token is always computed
    best = 0
    for other in earlier:
        for start in range(0, len(prompt) - len(prompt) % bs, bs):
            if prompt[start:start + bs] != other[start:start + bs]:
                break
            best = max(best, start + bs)
    return best


def _shares_partial_blocks(prompt, earlier, bs):
    lcp = max((next((i for i, (x, y) in enumerate(zip(prompt, o)) if x != y), min(len(prompt), len(o)))
               for o in earlier), default=0)
    return min(lcp, len(prompt) - 1)


def _prefill_chunks(prompt_len, decode_left, budget):
    chunks, done, k = [], 0, 0
    while done < prompt_len:
        chunks.append(min(prompt_len - done, budget - sum(left > k for left in decode_left)))
        done += chunks[-1]
        k += 1
    return chunks


def _stream_events(body):
    return [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]


def _stream_first_choice_only(body):
    text = ""
    for event in _stream_events(body):
        for c in event["choices"]:
            if c["index"] == 0:
                text += (c["delta"].get("content") if "delta" in c else c["text"]) or ""
    return {0: text}


def _stream_last_chunk_only(body):
    return {c["index"]: c.get("text", c.get("delta", {}).get("content")) for e in _stream_events(body)
            for c in e["choices"]}


MISTAKES.update({
    "check_cached_tokens": [
        _cached_whole_prompt,
        _shares_partial_blocks,
    ],
    "check_prefill_chunks": [
        lambda p, d, b: [min(b, p - i) for i in range(0, p, b)],         # forgets that decodes go first
        lambda p, d, b: _prefill_chunks(p, [x + 1 for x in d], b),        # off by one round
    ],
    "check_stream_text": [_stream_first_choice_only, _stream_last_chunk_only],
})


# Each chapter's core-component exercise (issue 22) keeps its wrong answers in a file of its own,
# tests/mistakes_chNN.py, which defines MISTAKES the same way; they are merged in here.
for _path in sorted(Path(__file__).parent.glob("mistakes_ch[0-9][0-9].py")):
    for _name, _wrong in runpy.run_path(str(_path))["MISTAKES"].items():
        MISTAKES.setdefault(_name, []).extend(_wrong)
