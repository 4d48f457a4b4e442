"""``compat="vllm-0.4"``: vLLM v0.4.0's runtime rules, pinned next to tinyserve's own.

Each rule is tested where it lives (the allocator's order, the block manager's questions, the
scheduler's queue order and preemption), then the s0/s1/s2 rounds under both rule sets, worked
out by hand from the rules (the derivations are in the comments), then hypothesis over random
workloads, and greedy outputs through the real engine.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scheduler_play import assert_all_free, play_round

from tinyserve import presets
from tinyserve.block import BlockAllocator, Device, OutOfBlocksError
from tinyserve.block_manager import AllocStatus, BlockSpaceManager, StackBlockAllocator, V04BlockSpaceManager
from tinyserve.config import CacheConfig, SchedulerConfig
from tinyserve.llm import LLM
from tinyserve.scheduler import Scheduler
from tinyserve.sequence import SamplingParams, Sequence, SequenceGroup, SequenceStatus
from tinyserve.sim import Request, simulate

V04 = "vllm-0.4"
_ids = itertools.count()
_tokens = itertools.count(1000)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def group(rid: str, prompt_len: int, block_size: int, generated: int = 0, n: int = 1,
          arrival: float = 0.0, max_tokens: int = 16) -> SequenceGroup:
    """A waiting group; ``generated`` tokens already sampled make it look preempted by recompute."""
    seq = Sequence(next(_ids), None, [next(_tokens) for _ in range(prompt_len)], block_size)
    for _ in range(generated):
        seq.append_token_id(next(_tokens))
    return SequenceGroup(rid, [seq], SamplingParams(n=n, max_tokens=max_tokens), arrival_time=arrival)


def running(bm: BlockSpaceManager, g: SequenceGroup) -> SequenceGroup:
    bm.allocate(g)
    for s in g.get_seqs():
        s.status = SequenceStatus.RUNNING
    return g


def make_scheduler(compat: str, mode: str | None = None, block_size: int = 4, gpu: int = 16, cpu: int = 16,
                   watermark: float = 0.0) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64,
                                     preemption_mode=mode, compat=compat),
                     CacheConfig(block_size=block_size, num_gpu_blocks=gpu, num_cpu_blocks=cpu, watermark=watermark))


def step(sched: Scheduler):
    """Schedule one round and play the engine without a model (a prompt's first sample forks)."""
    return play_round(sched)[1]


def ids(queue) -> list[str]:
    return [g.request_id for g in queue]


# -- configuration -------------------------------------------------------------------------------


def test_compat_defaults_to_tinyserve_and_names_the_field_when_wrong():
    assert SchedulerConfig().compat == "tinyserve"
    with pytest.raises(ValueError, match="compat"):
        SchedulerConfig(compat="vllm-0.5")


@pytest.mark.parametrize("kwargs", [{"policy": "orca"}, {"enable_chunked_prefill": True}])
def test_compat_refuses_what_v040_does_not_have(kwargs):
    with pytest.raises(ValueError, match="compat='vllm-0.4'"):
        SchedulerConfig(compat=V04, **kwargs)


def test_compat_refuses_prefix_caching():
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        Scheduler(SchedulerConfig(compat=V04),
                  CacheConfig(num_gpu_blocks=8, num_cpu_blocks=8, enable_prefix_caching=True))


def test_the_block_manager_follows_the_setting():
    assert type(make_scheduler("tinyserve").block_manager) is BlockSpaceManager
    assert type(make_scheduler(V04).block_manager) is V04BlockSpaceManager
    assert presets.seed_rounds(compat=V04).scheduler_config.compat == V04
    assert presets.seed_rounds().scheduler_config.compat == "tinyserve"


# -- the free list: a queue in tinyserve, a stack in v0.4 ---------------------------------------


def test_fifo_is_the_default_order():
    alloc = BlockAllocator(Device.GPU, 4, 4)
    a, b, c = (alloc.allocate() for _ in range(3))
    assert [a.block_number, b.block_number, c.block_number] == [0, 1, 2]
    alloc.free(b)
    alloc.free(a)
    # Free now: 3 (never used), then 1 and 0 in the order they came back.
    assert [alloc.allocate().block_number for _ in range(3)] == [3, 1, 0]


def test_the_stack_allocator_hands_out_the_block_freed_last():
    alloc = StackBlockAllocator(Device.GPU, 4, 4)
    a, b, c = (alloc.allocate() for _ in range(3))
    assert [a.block_number, b.block_number, c.block_number] == [3, 2, 1]  # v0.4 pops from the end
    alloc.free(b)
    alloc.free(a)
    assert [alloc.allocate().block_number for _ in range(3)] == [3, 2, 0]
    with pytest.raises(OutOfBlocksError, match="GPU"):
        alloc.allocate()


def test_both_pools_of_the_v04_manager_are_stacks():
    assert type(BlockSpaceManager(4, 4, 4).gpu_allocator) is BlockAllocator
    bm = V04BlockSpaceManager(4, 4, 4)
    assert type(bm.gpu_allocator) is type(bm.cpu_allocator) is StackBlockAllocator
    assert [bm.cpu_allocator.allocate().block_number for _ in range(2)] == [3, 2]


# -- can_append_slot -----------------------------------------------------------------------------


def test_v04_wants_a_free_block_even_when_the_next_token_needs_none():
    # A: 3 prompt tokens + 1 sampled = 4 tokens, its newest goes into slot 4 of its one block.
    # B fills the other block, so no block is free.
    for cls, expected in ((BlockSpaceManager, True), (V04BlockSpaceManager, False)):
        bm = cls(block_size=4, num_gpu_blocks=2, num_cpu_blocks=0, watermark=0.0)
        a = running(bm, group("A", 3, 4))
        running(bm, group("B", 4, 4))
        a.get_seqs()[0].append_token_id(next(_tokens))
        assert bm.get_num_free_gpu_blocks() == 0
        assert bm.can_append_slot(a) is expected, cls.__name__
        if expected:
            assert bm.append_slot(a.get_seqs()[0]) is None and bm.get_block_table(a.get_seqs()[0]) == [0]


def test_v04_wants_one_free_block_per_running_sequence():
    bm = V04BlockSpaceManager(block_size=4, num_gpu_blocks=4, num_cpu_blocks=0, watermark=0.0)
    g = running(bm, group("A", 4, 4))
    parent = g.get_seqs()[0]
    child = parent.fork(next(_ids))
    g.add(child)
    bm.fork(parent, child)
    assert bm.get_num_free_gpu_blocks() == 3 and bm.can_append_slot(g)
    bm.gpu_allocator.allocate()
    bm.gpu_allocator.allocate()
    assert bm.get_num_free_gpu_blocks() == 1 and not bm.can_append_slot(g)  # 2 sequences, 1 block


# -- the watermark -------------------------------------------------------------------------------


def test_v04_keeps_the_watermark_for_a_recomputed_sequence():
    # 10 blocks of 2 tokens, watermark 0.2 = 2 blocks. A sequence preempted by recompute that now
    # holds 17 tokens needs 9 blocks: tinyserve lets it use the whole cache, v0.4 says NEVER.
    grown = group("A", 5, 2, generated=12)
    assert BlockSpaceManager(2, 10, 0, watermark=0.2).can_allocate(grown) == AllocStatus.OK
    assert V04BlockSpaceManager(2, 10, 0, watermark=0.2).can_allocate(grown) == AllocStatus.NEVER
    fresh = group("B", 17, 2)  # a new prompt of the same size is NEVER under both
    assert BlockSpaceManager(2, 10, 0, watermark=0.2).can_allocate(fresh) == AllocStatus.NEVER
    assert V04BlockSpaceManager(2, 10, 0, watermark=0.2).can_allocate(fresh) == AllocStatus.NEVER


def test_v04_keeps_the_watermark_on_an_empty_gpu_when_swapping_in():
    # A swapped group of 8 blocks needs 8 + 1 on the way back; 10 - 9 = 1 is under the
    # watermark of 2. tinyserve waives the watermark on an empty GPU, v0.4 does not.
    for cls, expected in ((BlockSpaceManager, True), (V04BlockSpaceManager, False)):
        bm = cls(block_size=2, num_gpu_blocks=10, num_cpu_blocks=10, watermark=0.2)
        g = running(bm, group("A", 16, 2))
        bm.swap_out(g)
        for s in g.get_seqs():
            s.status = SequenceStatus.SWAPPED
        assert bm.get_num_free_gpu_blocks() == 10
        assert bm.can_swap_in(g) is expected, cls.__name__


def test_both_keep_the_watermark_on_a_gpu_in_use():
    for cls in (BlockSpaceManager, V04BlockSpaceManager):
        bm = cls(block_size=2, num_gpu_blocks=10, num_cpu_blocks=0, watermark=0.2)
        running(bm, group("A", 2, 2))  # 9 free
        assert bm.can_allocate(group("B", 14, 2)) == AllocStatus.OK  # 7 blocks: 9 - 7 = 2
        assert bm.can_allocate(group("C", 16, 2)) == AllocStatus.LATER  # 8 blocks: 9 - 8 = 1 < 2


def test_a_recomputed_request_that_outgrew_the_watermark_is_dropped_only_under_v04():
    for compat in ("tinyserve", V04):
        sched = make_scheduler(compat, block_size=2, gpu=10, cpu=0, watermark=0.2)
        g = group("A", 5, 2, generated=12)
        sched.add_seq_group(g)
        out = step(sched)
        if compat == V04:
            assert out.ignored_seq_groups == [g] and "needs more KV blocks" in g.error
            assert sched.block_manager.get_num_free_gpu_blocks() == 10
        else:
            assert out.request_ids == ["A"] and out.phase == "prefill"


# -- queue order and preemption ------------------------------------------------------------------


def test_v04_sorts_running_by_arrival_before_choosing_a_victim():
    # Three 4-token prompts in three 4-token blocks; each next token needs a new block and one
    # is free. running is put out of arrival order (as a recompute and swap mix can leave it):
    # v0.4 re-sorts and preempts the newest arrival, C; tinyserve preempts the last in the queue.
    for compat, victim in (("tinyserve", "B"), (V04, "C")):
        sched = make_scheduler(compat, mode="swap", block_size=4, gpu=4)
        a, b, c = (group(rid, 4, 4, arrival=t) for rid, t in (("A", 1.0), ("B", 2.0), ("C", 3.0)))
        for g in (a, b, c):
            sched.add_seq_group(g)
        step(sched)
        sched.running = type(sched.running)([a, c, b])
        out = step(sched)
        assert out.preempted == [victim] and out.swapped_out == [victim], compat


def test_v04_breaks_arrival_ties_by_queue_order():
    # v0.4's FCFS sort is stable: among equal arrival times the queue's order stands, so B, last
    # in the queue, is the victim (not C, added last and with the highest sequence id).
    sched = make_scheduler(V04, mode="swap", block_size=4, gpu=4)
    a, b, c = (group(rid, 4, 4, arrival=7.0) for rid in "ABC")
    for g in (a, b, c):
        sched.add_seq_group(g)
    step(sched)
    sched.running = type(sched.running)([c, a, b])
    out = step(sched)
    assert out.preempted == ["B"] and ids(sched.running) == ["C", "A"]


def test_v04_swaps_in_the_oldest_first_whatever_the_queue_order():
    # 3 blocks, three 4-token prompts. In the first decode A takes the block C gives up, and B,
    # with nobody newer left to preempt, swaps itself out. Once A is done, swapped is put out of
    # order; v0.4 re-sorts it and brings B back first, tinyserve takes the front, C.
    for compat, first in (("tinyserve", "C"), (V04, "B")):
        sched = make_scheduler(compat, mode="swap", block_size=4, gpu=3)
        a, b, c = (group(rid, 4, 4, arrival=t) for rid, t in (("A", 1.0), ("B", 2.0), ("C", 3.0)))
        for g in (a, b, c):
            sched.add_seq_group(g)
        step(sched)
        out = step(sched)
        # v0.4 appends each victim to swapped (and sorts it before use); tinyserve puts it in front.
        swapped = ["C", "B"] if compat == V04 else ["B", "C"]
        assert out.preempted == ["C", "B"] and ids(sched.running) == ["A"] and ids(sched.swapped) == swapped
        for seq in a.get_seqs():
            seq.status = SequenceStatus.FINISHED_LENGTH_CAPPED
            sched.free_seq(seq)
        sched.free_finished_seq_groups()
        sched.swapped = type(sched.swapped)([c, b])
        out = step(sched)  # one comes back (1 block + 1 for its next token); 1 block is left
        assert out.swapped_in == [first], compat


def _forked_pair(sched: Scheduler, rid: str, prompt_len: int) -> SequenceGroup:
    """An n=2 group, small enough to fit (see test_never_fits.py)."""
    g = group(rid, prompt_len, sched.cache_config.block_size, n=2, max_tokens=2)
    sched.add_seq_group(g)
    return g


@pytest.mark.parametrize("mode", [None, "recompute", "swap"])
def test_v04_never_recomputes_a_group_of_several_sequences(mode):
    # A (n=1, older) and B (n=2, newest) each hold one 2-token block; B's samples need two
    # more blocks, one is left. B must go, and only by swap: v0.4's _preempt_by_recompute
    # asserts a single sequence, whatever preemption_mode asks for.
    sched = make_scheduler(V04, mode=mode, block_size=2, gpu=4, cpu=4)
    sched.add_seq_group(group("A", 2, 2))
    _forked_pair(sched, "B", 2)
    step(sched)
    out = step(sched)
    assert out.preempted == ["B"] and out.swapped_out == ["B"] and ids(sched.swapped) == ["B"]
    assert not sched.waiting


@pytest.mark.parametrize(("mode", "swapped"), [(None, False), ("recompute", False), ("swap", True)])
def test_v04_preempts_a_single_sequence_as_asked(mode, swapped):
    sched = make_scheduler(V04, mode=mode, block_size=4, gpu=2, cpu=4)
    for rid in "AB":
        sched.add_seq_group(group(rid, 4, 4))
    step(sched)
    out = step(sched)  # both need a second block, none is free: B, the newest, goes
    assert out.preempted == ["B"]
    assert (out.swapped_out == ["B"]) is swapped and (ids(sched.waiting) == ["B"]) is not swapped


# -- s0, s1, s2 under both rule sets ---------------------------------------------------------------
#
# The preset: prompts of 5, 5 and 3 tokens, 8 tokens to generate each (the prefill samples the
# first), blocks of 5 tokens, 4 GPU and 4 CPU blocks, no watermark, 10 tokens per round.
# Rounds 1-3 are the story under both rules: s0+s1 prefill, s2 prefill, then s0 takes the last
# free block for its 6th token and s1 needs one too, so s2 (newest) is preempted.
# Round 4: s0 and s1 hold 7 tokens in 2 blocks each, room for 10: nobody needs a block.
#   tinyserve: nobody is preempted. s0 needs its third block at 11 tokens, in round 8, and s1
#     (newest running) goes; s0 finishes in 9, s1 then comes back and finishes 2 decodes later,
#     and s2 after it.
#   v0.4: no block is free, so s0's can_append_slot fails and s1 is preempted in round 4.
#     - swap: v0.4 appends a victim to swapped and sorts it stably by arrival; all three arrive
#       together, so s2 stays ahead of s1 and comes back first (1 block + 1), in round 5. In 8
#       s0 needs its third block with none free, and s2 (newest running) is swapped out again,
#       behind s1. s0 finishes in 9; s1 (2 blocks + 1) comes back in 10 and finishes in 15, and
#       s2 after it, in 19. (test_v04_oracle.py's test_the_seed_rounds_are_v040s plays both
#       modes on vLLM v0.4.0's own scheduler, made to swap for this one.)
#     - recompute (v0.4's default): every decode round of s0 finds no block free and preempts
#       s1, and the next round prefills s1 again into the two freed blocks (one more token each
#       time): preempted in 4, 6, 8, 10 and 12 (where s0 takes its third block). In 13 s1 holds
#       11 tokens, more than the 10-token budget: v0.4's admission drops it, and s2 is prefilled
#       again instead, to be preempted by s0's last decode in 14. s2 then runs alone: its
#       re-prefill in 15 and 5 decodes, to 20.

SEED_EXPECTED = {
    ("tinyserve", "swap"): ({3: ["s2"], 8: ["s1"]}, {"s0": 9, "s1": 11, "s2": 18}, {}),
    (V04, "swap"): ({3: ["s2"], 4: ["s1"], 8: ["s2"]}, {"s0": 9, "s1": 15, "s2": 19}, {}),
    (V04, None): ({3: ["s2"], 4: ["s1"], 6: ["s1"], 8: ["s1"], 10: ["s1"], 12: ["s1"], 14: ["s2"]},
                  {"s0": 14, "s2": 20}, {13: ["s1"]}),
}


@pytest.mark.parametrize(("compat", "mode"), list(SEED_EXPECTED))
def test_seed_rounds_under_both_rule_sets(compat, mode):
    p = presets.seed_rounds(mode, compat=compat)
    records = simulate(p.requests, p.scheduler_config, p.cache_config)
    preempted = {r.round: r.preempted for r in records if r.preempted}
    finished = {rid: r.round for r in records for rid in r.finished}
    ignored = {r.round: r.ignored for r in records if r.ignored}
    assert (preempted, finished, ignored) == SEED_EXPECTED[compat, mode]
    assert [r.batch for r in records[:3]] == [["s0", "s1"], ["s2"], ["s0", "s1"]]
    assert records[-1].free_gpu_blocks == 4 and records[-1].free_cpu_blocks == 4


def test_seed_block_numbers_come_off_a_stack_under_v04():
    tables = {}
    for compat in ("tinyserve", V04):
        p = presets.seed_rounds("swap", compat=compat)
        r = simulate(p.requests, p.scheduler_config, p.cache_config)
        tables[compat] = (r[1].block_tables, r[2].block_tables, r[2].cpu_block_tables)
    assert tables["tinyserve"] == ({"s0": [0], "s1": [1], "s2": [2]}, {"s0": [0, 3], "s1": [1, 2]}, {"s2": [0]})
    # Free [0, 1, 2, 3] popped from the end: 3, 2, 1; then 0. s2's block 1 goes back on the
    # stack and comes straight off it again for s1; the CPU stack hands out its block 3.
    assert tables[V04] == ({"s0": [3], "s1": [2], "s2": [1]}, {"s0": [3, 0], "s1": [2, 1]}, {"s2": [3]})


# -- hypothesis: random workloads under v0.4's rules ---------------------------------------------


@st.composite
def v04_workloads(draw):
    block_size = draw(st.integers(1, 4))
    num_gpu = draw(st.integers(3, 12))
    watermark = draw(st.sampled_from([0.0, 0.1, 0.2, 0.3]))
    max_num_seqs = draw(st.integers(1, 6))
    budget = draw(st.integers(max_num_seqs, 20))
    sc = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                         max_model_len=draw(st.integers(2, 24)),
                         preemption_mode=draw(st.sampled_from(["swap", "recompute", None])), compat=V04)
    usable = num_gpu - int(watermark * num_gpu)
    requests, sure = [], set()
    for i in range(draw(st.integers(1, 8))):
        prompt = draw(st.integers(1, sc.prompt_limit + 2))
        output = draw(st.integers(1, 12))
        if prompt <= sc.prompt_limit:
            output = min(output, max(1, sc.max_model_len - prompt))  # the engine caps at max_model_len
        # Sure to finish under v0.4's rules: its longest form (all but its last token) is within
        # the prompt limit (or a prefill after a recompute drops it), and with the one block v0.4
        # wants free for it, fits the cache less the watermark, which v0.4 never waives.
        longest = prompt + output - 1
        if longest <= sc.prompt_limit and cdiv(longest, block_size) + 1 <= usable:
            sure.add(f"r{i}")
        requests.append(Request(f"r{i}", prompt, output, draw(st.integers(1, 4))))
    cc = CacheConfig(block_size=block_size, num_gpu_blocks=num_gpu, watermark=watermark,
                     num_cpu_blocks=draw(st.integers(0, 3 * num_gpu)))
    return sc, cc, requests, sure


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(v04_workloads())
def test_v04_random_workloads_terminate_and_leak_nothing(workload):
    sc, cc, requests, sure = workload
    sched = Scheduler(sc, cc)
    records = simulate(requests, sc, cc, scheduler=sched)  # raises on a hang
    outcome: dict[str, str] = {}
    for rec in records:
        assert rec.num_batched_tokens <= sc.max_num_batched_tokens and rec.batch_size <= sc.max_num_seqs
        held = [b for t in rec.block_tables.values() for b in t]
        assert len(held) == len(set(held)), f"round {rec.round}: two requests share a GPU block"
        assert rec.free_gpu_blocks + len(held) == cc.num_gpu_blocks
        assert not set(rec.batch) & set(outcome), f"round {rec.round}: a finished request ran"
        outcome |= dict.fromkeys(rec.finished, "finished") | dict.fromkeys(rec.ignored, "ignored")
    assert set(outcome) == {r.request_id for r in requests}  # every request finished or was refused
    assert all(outcome[rid] == "finished" for rid in sure), f"dropped though it fits: {outcome}"
    assert_all_free(sched)
    assert not (sched.waiting or sched.running or sched.swapped)


# -- the engine: greedy outputs do not depend on the rules ---------------------------------------

PROMPTS = ["Hello, my name is", "The future of AI is", "The life is", "List three colors: red, green, blue."]
GREEDY = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)


@pytest.fixture(scope="module")
def roomy_outputs(tiny_model_dir):
    llm = LLM(model=str(tiny_model_dir), device="cpu", num_gpu_blocks=256, num_cpu_blocks=0, max_model_len=40)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("mode", [None, "swap"])
def test_llm_under_v04_rules_generates_what_an_unconstrained_run_does(tiny_model_dir, roomy_outputs, mode):
    llm = LLM(model=str(tiny_model_dir), device="cpu", block_size=4, num_gpu_blocks=10, num_cpu_blocks=16,
              max_model_len=40, watermark=0.0, preemption_mode=mode, compat=V04)
    assert type(llm.engine.scheduler.block_manager) is V04BlockSpaceManager
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == roomy_outputs
    assert llm.engine.num_preemptions_total > 0  # the tiny cache did force preemptions
    bm = llm.engine.scheduler.block_manager
    assert bm.get_num_free_gpu_blocks() == 10 and bm.get_num_free_cpu_blocks() == 16
