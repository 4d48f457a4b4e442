"""Automatic prefix caching: same tokens, less compute, and a cache that never lies.

Engine tests run a tiny random Llama with and without ``enable_prefix_caching`` and compare the
greedy tokens; the compute saved is read from ``engine.history`` (every token a request brings
to a round is a token the model computed). Hypothesis workloads drive the real scheduler through
the simulator with a *shadow cache*: it replays every round's swaps, copies and K/V writes
position by position, so it knows which tokens each physical block really holds, and checks
that whatever a sequence attends to is its own past and that every named block holds the
prefix its name says.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tinyserve import sim
from tinyserve.block import Device
from tinyserve.config import CacheConfig, ModelConfig, SchedulerConfig
from tinyserve.engine import LLMEngine
from tinyserve.prefix_cache import CachedBlockAllocator, hash_block_tokens, prefix_hashes
from tinyserve.scheduler import Scheduler
from tinyserve.sequence import SamplingParams, SequenceStatus
from tinyserve.worker import Worker

BS = 8
MAX_TOKENS = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def make_engine(loaded, *, prefix: bool, block_size: int = BS, num_gpu_blocks: int = 256,
                num_cpu_blocks: int = 32, chunked: bool = False, budget: int | None = None,
                policy: str = "vllm", preemption_mode: str | None = None, max_model_len: int = 256) -> LLMEngine:
    mc = ModelConfig(model=str(loaded.path), device="cpu", dtype="float32")
    return LLMEngine(
        mc,
        CacheConfig(block_size=block_size, num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=num_cpu_blocks,
                    watermark=0.0, enable_prefix_caching=prefix),
        SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=16, max_model_len=max_model_len,
                        policy=policy, preemption_mode=preemption_mode, enable_chunked_prefill=chunked),
        executor=Worker(mc, attention_backend="torch", loaded=loaded), record_history=True,
    )


def run_waves(engine: LLMEngine, waves: list[dict[str, list[int]]], params=GREEDY) -> dict[str, list[int]]:
    """Run each wave of {request id: prompt token ids} to completion before adding the next."""
    results: dict[str, list[int]] = {}
    for wave in waves:
        for rid, ids in wave.items():
            engine.add_request(rid, None, params, prompt_token_ids=ids)
        for _ in range(500):
            if not engine.has_unfinished_requests():
                break
            for out in engine.step():
                if out.finished:
                    results[out.request_id] = out.outputs[0].token_ids
        assert not engine.has_unfinished_requests(), "the engine made no progress"
    return results


def computed_tokens(engine: LLMEngine) -> dict[str, int]:
    """Tokens the model computed for each request, over the whole run, from the round records."""
    total: dict[str, int] = {}
    for rec in engine.history:
        for rid, n in rec.chunk_sizes.items():
            total[rid] = total.get(rid, 0) + n
    return total


def assert_no_leaks(engine: LLMEngine) -> None:
    bm = engine.scheduler.block_manager
    assert not bm.block_tables
    assert bm.get_num_free_gpu_blocks() == bm.num_total_gpu_blocks  # free list + evictor
    assert bm.get_num_free_cpu_blocks() == bm.num_total_cpu_blocks
    assert all(b.ref_count == 0 for b in bm.gpu_allocator.blocks + bm.cpu_allocator.blocks)


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 256) for _ in range(n)]  # any byte-level vocabulary has these


SYSTEM = tokens(0, 5 * BS + 3)  # a "system prompt" of 43 tokens: 5 full blocks and a partial one


def shared_prefix_waves() -> list[dict[str, list[int]]]:
    q = {i: tokens(i, 7 + i) for i in range(1, 5)}
    exact = tokens(9, 4 * BS)  # exactly 4 blocks long: the whole prompt can be cached
    first = {"a": SYSTEM + q[1], "a_twin": SYSTEM + q[1], "b": SYSTEM + q[2], "exact": exact}
    second = {"c": SYSTEM + q[3], "d": SYSTEM + q[4], "a_again": SYSTEM + q[1], "exact_again": list(exact)}
    return [first, second]


def expected_computed(waves: list[dict[str, list[int]]], block_size: int) -> dict[str, int]:
    """An independent model of the savings: a prompt skips the full blocks it shares with a
    prompt of an earlier wave (the same wave's blocks are not computed yet when it is admitted),
    but always computes its last token; a request then decodes MAX_TOKENS - 1 more tokens."""
    seen: list[list[int]] = []
    expected = {}
    for wave in waves:
        for rid, ids in wave.items():
            lcp = max((next((i for i, (x, y) in enumerate(zip(ids, s)) if x != y), min(len(ids), len(s)))
                       for s in seen), default=0)
            cached = min(lcp // block_size * block_size, len(ids) - 1)
            expected[rid] = len(ids) - cached + MAX_TOKENS - 1
        seen += list(wave.values())
    return expected


# -- the engine: same tokens, fewer computed ---------------------------------------------------

@pytest.fixture(scope="module")
def reference(tiny_loaded):
    waves = shared_prefix_waves()
    return run_waves(make_engine(tiny_loaded, prefix=False), waves)


def test_prefix_caching_gives_the_same_greedy_tokens_and_computes_less(tiny_loaded, reference):
    waves = shared_prefix_waves()
    engine = make_engine(tiny_loaded, prefix=True)
    assert run_waves(engine, waves) == reference
    assert computed_tokens(engine) == expected_computed(waves, BS)
    # Without caching every prompt token is computed.
    plain = make_engine(tiny_loaded, prefix=False)
    run_waves(plain, waves)
    assert computed_tokens(plain) == {rid: len(ids) + MAX_TOKENS - 1 for w in waves for rid, ids in w.items()}
    assert_no_leaks(engine)


def test_a_fully_cached_prompt_still_computes_its_last_token(tiny_loaded, reference):
    waves = shared_prefix_waves()
    engine = make_engine(tiny_loaded, prefix=True)
    run_waves(engine, waves)
    first_round_of = {}
    for rec in engine.history:
        for rid, n in rec.chunk_sizes.items():
            first_round_of.setdefault(rid, n)
    assert first_round_of["exact_again"] == 1  # 32 cached tokens, the 32nd recomputed for its logits
    # a's 51 tokens fill 6 blocks: the repeat computes only the 3 in its partial last block.
    assert first_round_of["a_again"] == len(waves[1]["a_again"]) - 6 * BS == 3
    # c shares only the system prompt's 5 full blocks.
    assert first_round_of["c"] == len(waves[1]["c"]) - 5 * BS
    assert reference["exact_again"] == reference["exact"]


def test_identical_prompts_in_one_round_share_their_full_blocks(tiny_loaded, reference):
    engine = make_engine(tiny_loaded, prefix=True)
    waves = shared_prefix_waves()
    for rid, ids in waves[0].items():
        engine.add_request(rid, None, GREEDY, prompt_token_ids=ids)
    engine.step()
    rec = engine.history[0]
    assert {"a", "a_twin"} <= set(rec.batch)
    full = len(waves[0]["a"]) // BS
    assert rec.block_tables["a"][:full] == rec.block_tables["a_twin"][:full]
    assert rec.block_tables["a"][full] != rec.block_tables["a_twin"][full]  # the partial block is private
    # Both were computed in full: neither block was computed when the other was admitted.
    assert rec.chunk_sizes["a"] == rec.chunk_sizes["a_twin"] == len(waves[0]["a"])
    # The system prompt's 5 blocks are shared by a, a_twin and b.
    assert rec.block_tables["b"][:5] == rec.block_tables["a"][:5]
    bm = engine.scheduler.block_manager
    assert [bm.gpu_allocator.blocks[b].ref_count for b in rec.block_tables["a"][:5]] == [3] * 5
    while engine.has_unfinished_requests():
        engine.step()
    assert_no_leaks(engine)


def test_blocks_filled_by_decoding_are_cached_too(tiny_loaded):
    prompt = tokens(20, 2 * BS + 4)  # 20 tokens
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    engine = make_engine(tiny_loaded, prefix=True)
    first = run_waves(engine, [{"p": prompt}], params)["p"]
    # Continue the conversation: the new prompt is everything p saw. p's 40 tokens had K/V for
    # all but its last one, so blocks 0-3 (tokens 0-31) are named, two of them filled by decoding.
    follow = prompt + first + tokens(21, 3)
    got = run_waves(engine, [{"q": follow}], params)["q"]
    assert computed_tokens(engine)["q"] == len(follow) - 4 * BS + 19
    assert got == run_waves(make_engine(tiny_loaded, prefix=False), [{"q": follow}], params)["q"]
    assert_no_leaks(engine)


@pytest.mark.parametrize("policy,chunked,mode",
                         [(p, c, m) for p, c in [("vllm", False), ("orca", False), ("vllm", True)]
                          for m in ("recompute", "swap")] + [("v1", True, "recompute")])
def test_a_small_cache_evicts_and_preempts_without_changing_tokens(tiny_loaded, reference, policy, chunked, mode):
    # 22 blocks of 8: enough for three of these requests at once, so the second wave preempts,
    # and cached blocks are evicted to make room.
    engine = make_engine(tiny_loaded, prefix=True, num_gpu_blocks=22, policy=policy, chunked=chunked,
                         budget=24 if chunked else None, preemption_mode=mode, max_model_len=64)
    waves = shared_prefix_waves()
    waves[1].update({f"x{i}": tokens(100 + i, 30) for i in range(3)})  # strangers that evict
    got = run_waves(engine, waves)
    assert {k: got[k] for k in reference} == reference
    assert engine.scheduler.block_manager.gpu_allocator.num_evictions > 0
    assert_no_leaks(engine)


def test_an_aborted_request_leaves_its_computed_blocks_reusable(tiny_loaded):
    engine = make_engine(tiny_loaded, prefix=True)
    prompt = SYSTEM + tokens(30, 4)  # 47 tokens: 5 full blocks and 7 in a partial one
    engine.add_request("gone", None, GREEDY, prompt_token_ids=prompt)
    engine.step()
    engine.abort_request("gone")
    assert_no_leaks(engine)
    engine.add_request("next", None, GREEDY, prompt_token_ids=prompt)
    engine.step()
    assert engine.history[-1].chunk_sizes["next"] == len(prompt) - 5 * BS


# -- the allocator ------------------------------------------------------------------------------

def test_chained_hashes_name_prefixes_not_blocks():
    a = prefix_hashes([1, 2, 3, 4, 5, 6, 7], 2)
    assert len(a) == 3  # the partial last block has no name
    assert a == prefix_hashes([1, 2, 3, 4, 5, 6, 99], 2)
    # The same block after a different prefix is another block.
    assert prefix_hashes([9, 9, 3, 4], 2)[1] != a[1]
    assert a[1] == hash_block_tokens(hash_block_tokens(None, (1, 2)), (3, 4))


def test_freed_blocks_stay_findable_until_evicted_least_recently_used_first():
    alloc = CachedBlockAllocator(Device.GPU, 4, 3)
    blocks = [alloc.allocate(h) for h in (11, 22, 33)]
    for b in blocks:
        b.computed = True
    for b in (blocks[1], blocks[0], blocks[2]):  # freed in this order: 22 is the oldest
        alloc.free(b)
    assert alloc.get_num_free_blocks() == 3 and alloc.lookup(22) is blocks[1]
    assert alloc.allocate(33) is blocks[2] and blocks[2].ref_count == 1  # a hit leaves the evictor
    fresh = alloc.allocate()  # no free block left: evict the least recently freed, 22
    assert fresh is blocks[1] and alloc.lookup(22) is None and fresh.block_hash is None
    assert alloc.lookup(11) is blocks[0] and alloc.num_evictions == 1


def test_a_freed_block_that_was_never_computed_forgets_its_name():
    alloc = CachedBlockAllocator(Device.GPU, 4, 2)
    b = alloc.allocate(5)
    alloc.free(b)  # its owner left before the K/V was written
    assert alloc.lookup(5) is None and b.block_hash is None
    assert alloc.allocate(5) is not None and alloc.num_evictions == 0


# -- hypothesis: a shadow cache over the simulator ---------------------------------------------

class ShadowScheduler(Scheduler):
    """The real scheduler, plus a model of what every physical block holds.

    Each slot records the token sequence up to and including the token whose K/V sits there,
    so "this slot holds the K/V of position p of my sequence" is a tuple comparison.
    """

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig) -> None:
        super().__init__(scheduler_config, cache_config)
        bs = cache_config.block_size
        self.gpu = [[None] * bs for _ in range(cache_config.num_gpu_blocks)]
        self.cpu = [[None] * bs for _ in range(cache_config.num_cpu_blocks)]
        self.rounds = 0

    def check_names(self) -> None:
        bm = self.block_manager
        alloc = bm.gpu_allocator
        bs = bm.block_size
        for h, block in alloc.cached.items():
            assert block.block_hash == h
        for block in alloc.blocks:
            if block.block_hash is not None:
                assert alloc.cached.get(block.block_hash) is block
                if block.computed:  # reusable: its content must be the prefix its name says
                    content = self.gpu[block.block_number]
                    assert None not in content, f"block {block.block_number} is named and computed but not full"
                    prefix = content[-1]
                    assert prefix_hashes(list(prefix), bs)[-1] == block.block_hash, \
                        f"block {block.block_number}'s name does not match its content"
                    assert content == [prefix[:len(prefix) - bs + i + 1] for i in range(bs)]
            if block.ref_count == 0:  # free exactly once: on the free list or in the evictor
                assert (block.block_number in alloc.evictor) != (block in alloc.free_blocks)
            else:
                assert block.block_number not in alloc.evictor
        for group in self.running:
            for seq in group.get_seqs(SequenceStatus.RUNNING):
                names = prefix_hashes(seq.get_token_ids(), bs)
                for i, block in enumerate(bm.block_tables[seq.seq_id]):
                    if block.block_hash is not None:
                        assert i < len(names) and block.block_hash == names[i], \
                            f"{group.request_id}'s block {i} is named for another prefix"

    def schedule(self):
        self.check_names()
        metas, out = super().schedule()
        self.rounds += 1
        bs = self.block_manager.block_size
        # The worker's order: swap out, swap in, copy, then the model writes the new K/V.
        for src, dst in out.blocks_to_swap_out.items():
            self.cpu[dst] = list(self.gpu[src])
        for src, dst in out.blocks_to_swap_in.items():
            self.gpu[dst] = list(self.cpu[src])
        for src, dsts in out.blocks_to_copy.items():
            for dst in dsts:
                self.gpu[dst] = list(self.gpu[src])
        for meta in metas:
            for seq_id, seq in meta.seq_data.items():
                table, ids = meta.block_tables[seq_id], seq.get_token_ids()
                for p in range(seq.num_computed_tokens, seq.num_computed_tokens + meta.token_chunk_size):
                    self.gpu[table[p // bs]][p % bs] = tuple(ids[: p + 1])
        # Attention then reads every position up to the last new one: each must be its own past.
        for meta in metas:
            for seq_id, seq in meta.seq_data.items():
                table, ids = meta.block_tables[seq_id], seq.get_token_ids()
                for p in range(seq.num_computed_tokens + meta.token_chunk_size):
                    assert self.gpu[table[p // bs]][p % bs] == tuple(ids[: p + 1]), \
                        f"round {self.rounds}: {meta.request_id} would attend to a wrong K/V at position {p}"
        return metas, out


@st.composite
def shared_prefix_workloads(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    vocab = draw(st.sampled_from([3, 50]))  # a tiny vocabulary makes accidental sharing likely
    prefixes = [draw(st.lists(st.integers(0, vocab), max_size=40)) for _ in range(3)]
    requests = []
    for i in range(draw(st.integers(1, 8))):
        if requests and draw(st.booleans()) and draw(st.booleans()):
            ids = list(draw(st.sampled_from(requests)).prompt_token_ids)  # a repeated prompt
        else:
            ids = draw(st.sampled_from(prefixes)) + draw(st.lists(st.integers(0, vocab), max_size=12))
        ids = ids or [0]
        requests.append(sim.Request(f"r{i}", len(ids), draw(st.integers(1, 20)), draw(st.integers(1, 6)), ids))
    longest = max(r.prompt_len + r.output_len for r in requests)
    chunked = draw(st.booleans())
    # From a cache that holds only the longest request (constant preemption and eviction) up.
    num_gpu_blocks = draw(st.integers(-(-longest // block_size), 3 * -(-longest // block_size)))
    sc = SchedulerConfig(max_num_batched_tokens=draw(st.integers(8, 64)) if chunked else max(longest, 8),
                         max_num_seqs=draw(st.integers(1, 8)), max_model_len=longest,
                         policy=(policy := draw(st.sampled_from(["vllm", "orca", "v1"]))),
                         preemption_mode=draw(st.sampled_from(["recompute", None] if policy == "v1"
                                                              else ["swap", "recompute", None])),
                         enable_chunked_prefill=chunked)
    cc = CacheConfig(block_size=block_size, num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=2 * num_gpu_blocks,
                     watermark=0.0, enable_prefix_caching=True)
    return requests, sc, cc


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shared_prefix_workloads())
def test_random_workloads_never_read_a_stale_block_and_leak_nothing(workload):
    requests, sc, cc = workload
    scheduler = ShadowScheduler(sc, cc)
    records = sim.simulate(requests, sc, cc, scheduler=scheduler)
    scheduler.check_names()
    assert {rid for r in records for rid in r.finished + r.ignored} == {r.request_id for r in requests}
    assert all(r.num_batched_tokens <= sc.max_num_batched_tokens for r in records)
    bm = scheduler.block_manager
    assert not bm.block_tables
    assert bm.get_num_free_gpu_blocks() == cc.num_gpu_blocks
    assert bm.get_num_free_cpu_blocks() == cc.num_cpu_blocks
    assert all(b.ref_count == 0 for b in bm.gpu_allocator.blocks + bm.cpu_allocator.blocks)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_the_shadow_cache_follows_evictions_and_preemptions(mode):
    # Eight requests over two prefixes in a pool of 18 blocks, where each needs 11: the hypothesis
    # test above covers such workloads at random; this one makes sure they really happen.
    rng = random.Random(7)
    prefixes = [[rng.randrange(5) for _ in range(24)] for _ in range(2)]
    requests = [sim.Request(f"r{i}", 30, 12, 1 + i // 2, prefixes[i // 4] + [rng.randrange(5) for _ in range(6)])
                for i in range(8)]
    sc = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=42, preemption_mode=mode)
    cc = CacheConfig(block_size=4, num_gpu_blocks=18, num_cpu_blocks=40, watermark=0.0, enable_prefix_caching=True)
    scheduler = ShadowScheduler(sc, cc)
    records = sim.simulate(requests, sc, cc, scheduler=scheduler)
    scheduler.check_names()
    assert scheduler.block_manager.gpu_allocator.num_evictions > 0
    assert any(r.preempted for r in records)
    first_chunks = [next(r.chunk_sizes[q.request_id] for r in records if q.request_id in r.chunk_sizes)
                    for q in requests]
    assert min(first_chunks) < 30  # some prompts found their head in the cache
    assert scheduler.block_manager.get_num_free_gpu_blocks() == cc.num_gpu_blocks


def test_the_simulator_shares_a_common_prefix_and_saves_its_prefill():
    system = list(range(100, 132))  # 32 tokens: 2 blocks of 16
    requests = [sim.Request(f"u{i}", 40, 4, 1 + 2 * i, system + [i] * 8) for i in range(4)]
    sc = SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=8, max_model_len=64)
    runs = {}
    for prefix in (False, True):
        cc = CacheConfig(block_size=16, num_gpu_blocks=64, num_cpu_blocks=0, watermark=0.0,
                         enable_prefix_caching=prefix)
        runs[prefix] = sim.simulate(requests, sc, cc)
    first: dict[bool, dict[str, int]] = {p: {} for p in runs}  # each request's prefill chunk
    for p, recs in runs.items():
        for rec in recs:
            for rid, n in rec.chunk_sizes.items():
                first[p].setdefault(rid, n)
    assert first[False] == dict.fromkeys(first[False], 40)
    assert first[True] == {"u0": 40, "u1": 8, "u2": 8, "u3": 8}
    # u1 holds the system prompt's two blocks, shared with u0.
    rec = next(r for r in runs[True] if "u1" in r.block_tables and "u0" in r.block_tables)
    assert rec.block_tables["u1"][:2] == rec.block_tables["u0"][:2]


def test_a_request_given_prompt_token_ids_must_agree_with_its_length():
    with pytest.raises(ValueError, match="prompt_token_ids"):
        sim.Request("x", 3, 1, 1, [1, 2])


# -- the chapter's drawing and checker ----------------------------------------------------------

def test_the_prefix_sharing_figure_draws_the_shared_blocks_and_the_savings():
    import matplotlib

    matplotlib.use("Agg")
    from tinyserve.viz import beyond

    requests = beyond.system_prompt_requests()  # a 28-token system prompt, blocks of 8
    records = beyond.prefix_sharing_run(True)
    computed = beyond.prefill_tokens(records, {r.request_id: r.output_len for r in requests})
    assert computed == {r.request_id: r.prompt_len - (0 if i == 0 else 24) for i, r in enumerate(requests)}
    plain = beyond.prefix_sharing_run(False)
    assert beyond.prefill_tokens(plain, {r.request_id: r.output_len for r in requests}) == \
        {r.request_id: r.prompt_len for r in requests}
    fig = beyond.fig_prefix_sharing()
    labels = [t.get_gid() for ax in fig.axes for t in ax.texts if (t.get_gid() or "").startswith("block:")]
    blocks = {}
    for gid in labels:
        _, rid, index, number = gid.split(":")
        blocks.setdefault(rid, {})[int(index)] = int(number)
    first3 = {rid: [b[i] for i in range(3)] for rid, b in blocks.items()}
    assert len(first3) == 4 and len({tuple(v) for v in first3.values()}) == 1  # the same 3 physical blocks
    assert len({b[3] for b in blocks.values()}) == 4  # the straddling block is private
    assert "72 saved" in fig.axes[1].get_title()


def test_two_requests_sharing_a_cached_block_are_swapped_out_in_one_round():
    """Found by the random test above: r5 and r0 share cached block 0 and are swapped out in the
    same round. A round's copy list has one destination per source block, so the second swap-out
    must share the first one's CPU copy; it used to get a CPU block of its own that nothing wrote,
    and r0 attended to garbage after swapping back in."""
    R = sim.Request
    requests = [R("r0", 1, 2, 6, [0]), R("r1", 1, 1, 1, [0]), R("r2", 1, 1, 1, [0]), R("r3", 1, 1, 1, [0]),
                R("r4", 1, 5, 1, [0]), R("r5", 2, 5, 1, [0, 0])]
    sc = SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=3, max_model_len=7, policy="vllm",
                         preemption_mode="swap")
    cc = CacheConfig(block_size=1, num_gpu_blocks=9, num_cpu_blocks=18, watermark=0.0, enable_prefix_caching=True)
    scheduler = ShadowScheduler(sc, cc)
    records = sim.simulate(requests, sc, cc, scheduler=scheduler)  # the shadow cache asserts every read
    assert any(len(r.swapped_out) == 2 for r in records), "the case needs two swap-outs in one round"
    assert {rid for r in records for rid in r.finished} == {r.request_id for r in requests}
    bm = scheduler.block_manager
    assert bm.get_num_free_cpu_blocks() == cc.num_cpu_blocks and not bm._cpu_by_hash and not bm._cpu_hash
