"""The simulator and the book's two presets, round by round, and hypothesis over random workloads.

``replay`` re-derives, from the round records alone, how many tokens each request has produced:
a batch member's chunk adds to its computed tokens, and reaching the end of its tokens samples one.
Recompute-preemption drops the computed tokens, swap keeps them. That independent count is what
"every request finishes with exactly its output length" is checked against.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tinyserve import presets
from tinyserve.config import CacheConfig, SchedulerConfig
from tinyserve.scheduler import Scheduler
from tinyserve.sim import Request, RoundRecord, format_rounds, simulate


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def replay(records: list[RoundRecord], requests: list[Request], sc: SchedulerConfig, cc: CacheConfig,
           ) -> dict[str, int]:
    """Check every round against the budgets and the token accounting; return the round in which
    each request finished (ignored requests are absent)."""
    req = {r.request_id: r for r in requests}
    computed = dict.fromkeys(req, 0)
    length = {rid: r.prompt_len for rid, r in req.items()}
    produced = dict.fromkeys(req, 0)
    # Whether the newest token was just sampled, so has no slot yet (a (re)prefill allocates
    # blocks for every token it is given, the newest included).
    fresh = dict.fromkeys(req, False)
    finished_in: dict[str, int] = {}
    ignored: set[str] = set()
    assert [rec.round for rec in records] == list(range(1, len(records) + 1))
    for rec in records:
        assert len(rec.batch) == len(set(rec.batch)), f"round {rec.round}: a request twice in the batch"
        assert rec.batch_size <= sc.max_num_seqs, f"round {rec.round}: {rec.batch_size} sequences"
        assert rec.num_batched_tokens <= sc.max_num_batched_tokens, (
            f"round {rec.round}: {rec.num_batched_tokens} tokens > {sc.max_num_batched_tokens}")
        assert rec.num_batched_tokens == sum(rec.chunk_sizes.values())
        assert len(rec.running) <= sc.max_num_seqs
        for rid in rec.batch:
            assert req[rid].arrival_round <= rec.round, f"{rid} ran before it arrived"
        for rid in rec.preempted:
            assert rid not in rec.batch, f"round {rec.round}: {rid} preempted and scheduled"
            if rid not in rec.swapped_out:
                computed[rid] = 0  # recompute: its K/V is gone
                fresh[rid] = False
        kinds = set()
        for rid in rec.batch:
            chunk = rec.chunk_sizes[rid]
            decode = produced[rid] > 0 and computed[rid] == length[rid] - 1
            kinds.add("decode" if decode else "prefill")
            if decode:
                assert chunk == 1, f"round {rec.round}: {rid} decodes {chunk} tokens"
            else:
                assert 0 < chunk <= length[rid] - computed[rid]
                if not sc.enable_chunked_prefill and produced[rid] == 0:
                    assert chunk == length[rid], f"round {rec.round}: {rid}'s prompt was split without chunking"
            computed[rid] += chunk
            if computed[rid] == length[rid]:
                produced[rid] += 1
                length[rid] += 1
                fresh[rid] = True
        expected_phase = "idle" if not kinds else kinds.pop() if len(kinds) == 1 else "mixed"
        assert rec.phase == expected_phase, f"round {rec.round}: phase {rec.phase}, members are {expected_phase}"
        for rid in rec.finished:
            assert rid not in finished_in, f"{rid} finished twice"
            assert produced[rid] == req[rid].output_len, (
                f"{rid} finished in round {rec.round} with {produced[rid]} tokens, not {req[rid].output_len}")
            finished_in[rid] = rec.round
        for rid in rec.batch:
            if rid not in rec.finished:
                assert produced[rid] < req[rid].output_len, f"{rid} produced its last token and went on"
        for rid in rec.ignored:
            assert produced[rid] == 0 and rid not in ignored
            ignored.add(rid)
        # The block tables in the record cover each running request's tokens, and no more.
        for rid in rec.running:
            blocks = rec.block_tables[rid]
            needed = length[rid] - 1 if fresh[rid] else length[rid]
            assert len(blocks) == cdiv(needed, cc.block_size), f"round {rec.round}: {rid} holds {blocks}"
        gpu_held = [b for t in rec.block_tables.values() for b in t]
        assert len(gpu_held) == len(set(gpu_held)), f"round {rec.round}: two requests share a GPU block"
        assert rec.free_gpu_blocks + len(gpu_held) == rec.num_gpu_blocks == cc.num_gpu_blocks
        cpu_held = [b for t in rec.cpu_block_tables.values() for b in t]
        assert rec.free_cpu_blocks + len(set(cpu_held)) == rec.num_cpu_blocks
        assert set(rec.cpu_block_tables) == set(rec.swapped)
    assert set(finished_in) | ignored == set(req), f"unfinished: {set(req) - set(finished_in) - ignored}"
    assert not set(finished_in) & ignored
    return finished_in


def first_admissions(records: list[RoundRecord]) -> list[str]:
    order: list[str] = []
    for rec in records:
        order += [rid for rid in rec.batch if rid not in order]
    return order


def run_preset(p: presets.Preset) -> list[RoundRecord]:
    return simulate(p.requests, p.scheduler_config, p.cache_config)


# -- the s0/s1/s2 walkthrough -------------------------------------------------------------------


def test_seed_preset_shape():
    p = presets.seed_rounds()
    assert [r.request_id for r in p.requests] == ["s0", "s1", "s2"]
    assert [r.prompt_len for r in p.requests] == [5, 5, 3]
    assert p.prompts == {"s0": "Hello, my name is", "s1": "The future of AI is", "s2": "The life is"}
    assert p.scheduler_config.preemption_mode == "swap" and p.scheduler_config.policy == "vllm"
    assert all(r.output_len == p.max_tokens for r in p.requests)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_seed_rounds_round_by_round(mode):
    p = presets.seed_rounds(mode)
    records = run_preset(p)
    r1, r2, r3 = records[:3]
    assert (r1.round, r1.phase, r1.batch, r1.waiting, r1.running) == (1, "prefill", ["s0", "s1"], ["s2"], ["s0", "s1"])
    assert (r2.round, r2.phase, r2.batch, r2.preempted) == (2, "prefill", ["s2"], [])
    assert r2.running == ["s0", "s1", "s2"] and r2.waiting == []
    assert (r3.round, r3.phase, r3.batch, r3.preempted, r3.running) == (3, "decode", ["s0", "s1"], ["s2"],
                                                                         ["s0", "s1"])
    if mode == "swap":
        assert (r3.swapped, r3.swapped_out, r3.waiting) == (["s2"], ["s2"], [])
        assert set(r3.cpu_block_tables) == {"s2"}
    else:
        assert (r3.waiting, r3.swapped, r3.swapped_out) == (["s2"], [], [])
        assert r3.cpu_block_tables == {}
    assert r3.free_gpu_blocks == 0
    finished = replay(records, p.requests, p.scheduler_config, p.cache_config)
    assert set(finished) == {"s0", "s1", "s2"}
    assert records[-1].free_gpu_blocks == 4 and records[-1].free_cpu_blocks == 4


def test_seed_rounds_under_none_recomputes_single_sequences():
    records = run_preset(presets.seed_rounds(None))
    assert records[2].preempted == ["s2"] and records[2].waiting == ["s2"] and records[2].swapped == []


def test_swapped_queue_and_running_queue_stay_in_arrival_order():
    """The newest running group is the one preempted, so the swapped queue must hand groups back
    oldest first; otherwise the next preemption would pick an older request."""
    p = presets.seed_rounds("swap")
    arrival = {r.request_id: i for i, r in enumerate(p.requests)}
    for rec in run_preset(p):
        assert rec.swapped == sorted(rec.swapped, key=arrival.get), f"round {rec.round}: {rec.swapped}"
        assert rec.running == sorted(rec.running, key=arrival.get), f"round {rec.round}: {rec.running}"


# -- the A–E workload -------------------------------------------------------------------------------


def test_orca_example_under_orca():
    p = presets.orca_example()
    assert [(r.request_id, r.output_len, r.arrival_round) for r in p.requests] == [
        ("A", 10, 1), ("B", 15, 1), ("C", 5, 1), ("D", 8, 2), ("E", 12, 3)]
    records = run_preset(p)
    sizes = [r.batch_size for r in records]
    assert sizes[:3] == [3, 4, 5]
    assert all(a >= b for a, b in zip(sizes[2:], sizes[3:])), sizes
    assert [r.phase for r in records[:3]] == ["prefill", "mixed", "mixed"]
    finished = replay(records, p.requests, p.scheduler_config, p.cache_config)
    # With no preemption, a request produces one token every round from its arrival on.
    assert finished == {r.request_id: r.arrival_round + r.output_len - 1 for r in p.requests}
    assert finished["C"] == 5
    assert not any(r.preempted for r in records)


def test_orca_example_under_vllm_has_prefill_only_rounds_for_d_and_e():
    p = presets.orca_example("vllm")
    records = run_preset(p)
    assert [(r.phase, r.batch) for r in records[:4]] == [
        ("prefill", ["A", "B", "C"]), ("prefill", ["D"]), ("prefill", ["E"]), ("decode", ["A", "B", "C", "D", "E"])]
    finished = replay(records, p.requests, p.scheduler_config, p.cache_config)
    # A, B, C lose rounds 2 and 3 to the prefills; D loses round 3.
    assert finished == {"A": 12, "B": 17, "C": 7, "D": 10, "E": 14}


# -- the simulator itself -------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs", [{"prompt_len": 0}, {"output_len": 0}, {"arrival_round": 0}])
def test_request_validation(kwargs):
    args = {"request_id": "x", "prompt_len": 1, "output_len": 1} | kwargs
    with pytest.raises(ValueError, match="'x'"):
        Request(**args)


def test_duplicate_request_ids_are_refused():
    p = presets.seed_rounds()
    with pytest.raises(ValueError, match="unique"):
        simulate([Request("a", 1, 1), Request("a", 2, 2)], p.scheduler_config, p.cache_config)


def test_idle_rounds_before_a_late_arrival_are_not_a_hang():
    sc = SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=2, max_model_len=8)
    cc = CacheConfig(block_size=2, num_gpu_blocks=4, num_cpu_blocks=4, watermark=0.0)
    records = simulate([Request("late", 2, 2, arrival_round=3)], sc, cc)
    assert [r.phase for r in records] == ["idle", "idle", "prefill", "decode"]
    assert records[-1].finished == ["late"]


def test_a_request_that_outgrows_the_whole_cache_is_reported_not_looped_on():
    # 1 + 5 tokens cannot live in 2 blocks of 1 (the engine refuses such a max_model_len, the
    # simulator does not): swapped out, it can never come back. The round that would idle
    # forever finishes it as ignored instead.
    sc = SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=2, max_model_len=8, preemption_mode="swap")
    cc = CacheConfig(block_size=1, num_gpu_blocks=2, num_cpu_blocks=4, watermark=0.0)
    records = simulate([Request("big", 1, 5)], sc, cc)
    assert any(r.swapped_out == ["big"] for r in records)
    assert records[-1].ignored == ["big"] and not (records[-1].swapped or records[-1].running)
    assert records[-1].free_gpu_blocks == 2 and records[-1].free_cpu_blocks == 4


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_a_request_that_grew_into_the_watermark_still_finishes(mode):
    # A's prompt leaves exactly the 2-block watermark; its decodes take it. Preempted, it must be
    # let back once B is done, not stranded in `swapped` nor dropped as "can never fit".
    sc = SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=2, max_model_len=10, preemption_mode=mode)
    cc = CacheConfig(block_size=1, num_gpu_blocks=10, num_cpu_blocks=10, watermark=0.2)
    reqs = [Request("B", 1, 9), Request("A", 7, 3)]
    records = simulate(reqs, sc, cc)
    assert records[2].preempted == ["A"]
    assert replay(records, reqs, sc, cc) == {"B": 9, "A": 10}


def test_ignored_requests_leave_the_others_to_finish():
    sc = SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=2, max_model_len=6)
    cc = CacheConfig(block_size=2, num_gpu_blocks=2, num_cpu_blocks=2, watermark=0.0)
    reqs = [Request("long", 7, 2), Request("ok", 2, 3), Request("never", 5, 1)]
    records = simulate(reqs, sc, cc)
    assert records[0].ignored == ["long", "never"] and records[0].batch == ["ok"]
    assert replay(records, reqs, sc, cc) == {"ok": 3}


def test_format_rounds_prints_one_line_per_round():
    records = run_preset(presets.seed_rounds("swap"))
    text = format_rounds(records).splitlines()
    assert len(text) == len(records) + 1
    assert text[0].split()[:3] == ["round", "phase", "batch"]
    assert text[1].split()[:3] == ["1", "prefill", "s0,s1"]
    assert text[3].split()[:4] == ["3", "decode", "s0,s1", "s2"]


# -- hypothesis over random workloads ---------------------------------------------------------------


@st.composite
def workloads(draw):
    block_size = draw(st.integers(1, 4))
    num_gpu = draw(st.integers(2, 12))
    watermark = draw(st.sampled_from([0.0, 0.1, 0.2, 0.3]))
    max_num_seqs = draw(st.integers(1, 6))
    max_tokens = draw(st.integers(max_num_seqs, 20))
    max_model_len = draw(st.integers(2, 24))
    chunked = draw(st.booleans())
    sc = SchedulerConfig(max_num_batched_tokens=max_tokens, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                         policy=draw(st.sampled_from(["vllm", "orca"])),
                         preemption_mode=draw(st.sampled_from(["swap", "recompute", None])),
                         enable_chunked_prefill=chunked)
    usable = num_gpu - int(watermark * num_gpu)  # blocks a prompt may take at admission
    requests = []
    cpu_needed = 0
    for i in range(draw(st.integers(1, 8))):
        # Mostly prompts that fit, some over the limit (ignored).
        prompt = draw(st.integers(1, sc.prompt_limit) | st.integers(1, sc.prompt_limit + 3))
        output = draw(st.integers(1, 16))
        fits = prompt <= sc.prompt_limit and cdiv(prompt, block_size) <= usable
        if fits:
            # An admitted request must be able to finish: every token but the last needs a slot,
            # plus the one slot a swapped group reserves to come back, on an empty GPU (the
            # watermark does not apply there). The engine makes sure of it by capping a request
            # at max_model_len and refusing a cache that cannot hold max_model_len.
            room = min(max_model_len - prompt, (num_gpu - 1) * block_size - prompt + 1)
            if room < 1:
                prompt, room = min(prompt, max_model_len - 1, (num_gpu - 1) * block_size), 1
            output = min(output, room)
            cpu_needed += cdiv(prompt + output - 1, block_size)
        requests.append(Request(f"r{i}", prompt, output, draw(st.integers(1, 4))))
    # Swap space for every admitted request at once, so the CPU pool cannot run out.
    cc = CacheConfig(block_size=block_size, num_gpu_blocks=num_gpu, num_cpu_blocks=cpu_needed, watermark=watermark)
    return sc, cc, requests


@settings(max_examples=1200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads_finish_within_budgets_and_leak_nothing(workload):
    sc, cc, requests = workload
    sched = Scheduler(sc, cc)
    records = simulate(requests, sc, cc, scheduler=sched)
    finished = replay(records, requests, sc, cc)

    usable = cc.num_gpu_blocks - int(cc.watermark * cc.num_gpu_blocks)
    for r in requests:
        can_run = r.prompt_len <= sc.prompt_limit and cdiv(r.prompt_len, cc.block_size) <= usable
        assert (r.request_id in finished) == can_run, f"{r} finished={r.request_id in finished}"

    if not sc.enable_chunked_prefill and sc.policy == "vllm":
        assert all(rec.phase != "mixed" for rec in records)

    # First come, first served: requests are first admitted in arrival order.
    arrival = sorted((r.arrival_round, i) for i, r in enumerate(requests) if r.request_id in finished)
    assert first_admissions(records) == [requests[i].request_id for _, i in arrival]

    # The newest running group is the one preempted: running and swapped keep arrival order.
    rank = {requests[i].request_id: k for k, (_, i) in enumerate(arrival)}
    for rec in records:
        assert rec.running == sorted(rec.running, key=rank.get), f"round {rec.round}: running {rec.running}"
        assert rec.swapped == sorted(rec.swapped, key=rank.get), f"round {rec.round}: swapped {rec.swapped}"

    bm = sched.block_manager
    assert bm.block_tables == {}
    assert bm.get_num_free_gpu_blocks() == cc.num_gpu_blocks
    assert bm.get_num_free_cpu_blocks() == cc.num_cpu_blocks
    assert all(b.ref_count == 0 for b in bm.gpu_allocator.blocks + bm.cpu_allocator.blocks)
    assert not (sched.waiting or sched.running or sched.swapped)
