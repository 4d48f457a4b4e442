"""Requests that can never run are refused, and no input makes the engine spin (issue 12).

Scheduler-level scenarios first (samples that can never fit at once, n over max_num_seqs, the
safety net for an idle round that can never change, full CPU swap space), then a hypothesis
search of random workloads on tiny caches, then the same defects through ``LLM.generate`` on the
tiny model: the bad request is finished as ignored with a reason, and every other request gets
the tokens it gets in a run without it.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scheduler_play import assert_all_free, play_round

from tinyserve import LLM, SamplingParams
from tinyserve.block_manager import AllocStatus, BlockSpaceManager
from tinyserve.config import CacheConfig, SchedulerConfig
from tinyserve.scheduler import Scheduler
from tinyserve.sequence import Sequence, SequenceGroup, SequenceStatus

_ids = itertools.count()
_tokens = itertools.count(1000)


def make_scheduler(*, gpu: int, cpu: int = 8, block_size: int = 4, max_num_seqs: int = 8, max_model_len: int = 64,
                   watermark: float = 0.0, mode: str | None = None, policy: str = "vllm", chunked: bool = False,
                   prefix: bool = False, budget: int | None = 64) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                        policy=policy, preemption_mode=mode, enable_chunked_prefill=chunked),
        CacheConfig(block_size=block_size, num_gpu_blocks=gpu, num_cpu_blocks=cpu, watermark=watermark,
                    enable_prefix_caching=prefix),
    )


def add(sched: Scheduler, rid: str, prompt: int | list[int], n: int = 1, max_tokens: int = 16) -> SequenceGroup:
    tokens = prompt if isinstance(prompt, list) else [next(_tokens) for _ in range(prompt)]
    seq = Sequence(next(_ids), None, tokens, sched.cache_config.block_size)
    params = SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens)
    group = SequenceGroup(rid, [seq], params, arrival_time=0.0)
    sched.add_seq_group(group)
    return group


def run_to_end(sched: Scheduler, max_rounds: int = 2000) -> list:
    outs = []
    while sched.has_unfinished_seqs():
        outs.append(play_round(sched)[1])
        assert len(outs) < max_rounds, "the scheduler made no progress"
    return outs


def ignored(outs) -> list[str]:
    return [g.request_id for out in outs for g in out.ignored_seq_groups]


# -- samples that can never fit at once ---------------------------------------------------------

def test_the_hang_of_issue_12_is_refused_up_front():
    # n=3, max_tokens=100 on 16 blocks of 16: each sample grows to ~110 tokens (7 blocks).
    sched = make_scheduler(gpu=16, block_size=16, max_model_len=256, budget=256)
    big = add(sched, "big", 9, n=3, max_tokens=100)
    small = add(sched, "small", 9, max_tokens=20)
    outs = run_to_end(sched)
    assert ignored(outs) == ["big"] and outs[0].ignored_seq_groups == [big]
    assert all(s.status.finish_reason == "ignored" and s.get_output_len() == 0 for s in big.get_seqs())
    for words in ("n=3", "max_tokens=100", "16 blocks of 16 tokens", "KV blocks"):
        assert words in big.error
    assert small.get_seqs()[0].get_output_len() == 20
    assert_all_free(sched)


@pytest.mark.parametrize("watermark_blocks", [0, 2])
def test_a_group_whose_worst_case_just_fits_runs_and_one_block_less_is_refused(watermark_blocks):
    need = make_scheduler(gpu=100).block_manager.worst_case_num_blocks(6, 3, 6 + 10)
    for gpu, admitted in ((need + watermark_blocks, True), (need + watermark_blocks - 1, False)):
        sched = make_scheduler(gpu=gpu, watermark=watermark_blocks / gpu + 1e-9, mode="swap")
        assert sched.block_manager.watermark_blocks == watermark_blocks
        g = add(sched, "g", 6, n=3, max_tokens=10)
        outs = run_to_end(sched)
        assert (ignored(outs) == []) == admitted, gpu
        if admitted:
            assert [s.get_output_len() for s in g.get_seqs()] == [10, 10, 10]
        assert_all_free(sched)


def test_a_single_sequence_needs_only_its_prompt_to_fit():
    # A grows to max_model_len, all 10 blocks of the cache, and B to 33 tokens: they take turns,
    # preempted by recompute. Neither is refused, since max_model_len fits the cache.
    sched = make_scheduler(gpu=10, max_model_len=40, mode="recompute")
    a = add(sched, "a", 3, max_tokens=100)
    b = add(sched, "b", 3, max_tokens=30)
    outs = run_to_end(sched)
    assert ignored(outs) == []
    assert a.get_seqs()[0].get_len() == 40 and b.get_seqs()[0].get_output_len() == 30
    assert_all_free(sched)


# -- n over max_num_seqs -------------------------------------------------------------------------

@pytest.mark.parametrize("policy", ["vllm", "orca"])
def test_n_over_max_num_seqs_is_ignored_and_the_queue_moves_on(policy):
    sched = make_scheduler(gpu=64, max_num_seqs=2, policy=policy)
    wide = add(sched, "wide", 4, n=3, max_tokens=4)
    later = add(sched, "later", 4, n=2, max_tokens=4)
    outs = run_to_end(sched)
    assert ignored(outs) == ["wide"]
    assert "n=3" in wide.error and "max_num_seqs=2" in wide.error
    assert wide.get_seqs()[0].status.finish_reason == "ignored"
    assert [s.get_output_len() for s in later.get_seqs()] == [4, 4]
    assert_all_free(sched)


# -- the safety net ------------------------------------------------------------------------------

class Optimist(BlockSpaceManager):
    """A block manager that thinks any group of samples fits: admission lets everything in."""

    def worst_case_num_blocks(self, prompt_len: int, num_seqs: int, max_len: int) -> int:
        return 0


class Stuck(BlockSpaceManager):
    """A broken block manager that never has room for a new prompt."""

    def can_allocate(self, seq_group: SequenceGroup) -> AllocStatus:
        return AllocStatus.LATER


def with_block_manager(cls: type, **kwargs) -> Scheduler:
    """``make_scheduler(**kwargs)``, but with a block manager of class ``cls`` (the hook)."""
    cc = make_scheduler(**kwargs).cache_config
    bm = cls(cc.block_size, cc.num_gpu_blocks, cc.num_cpu_blocks, watermark=cc.watermark)
    return Scheduler(make_scheduler(**kwargs).scheduler_config, cc, block_manager=bm)


def test_the_safety_net_finishes_a_swapped_group_that_can_never_come_back():
    # Without the admission check the issue's hang comes back: the group is swapped out and
    # cannot return even to an empty GPU. The round that would idle forever finishes it instead.
    sched = with_block_manager(Optimist, gpu=8, mode="swap", max_num_seqs=4)
    other = add(sched, "other", 4, max_tokens=6)
    big = add(sched, "big", 4, n=3, max_tokens=30)
    outs = run_to_end(sched, max_rounds=200)
    assert ignored(outs) == ["big"]
    assert "can never be scheduled" in big.error and "swap space" in big.error
    assert any(out.swapped_out == ["big"] for out in outs)
    assert all(s.status.finish_reason == "ignored" for s in big.get_seqs())
    assert all(0 < s.get_output_len() < 30 for s in big.get_seqs())  # it ran for a while
    assert other.get_seqs()[0].get_output_len() == 6
    assert all(not out.is_empty() or out.ignored_seq_groups or out.preempted for out in outs)
    assert_all_free(sched)


def test_the_safety_net_finishes_a_waiting_group_a_broken_block_manager_never_admits():
    sched = with_block_manager(Stuck, gpu=8)
    stuck = add(sched, "stuck", 4)
    _, out = sched.schedule()
    assert out.ignored_seq_groups == [stuck] and not sched.has_unfinished_seqs()
    assert "can never be scheduled" in stuck.error and "waiting" in stuck.error
    _, out = sched.schedule()
    assert out.is_empty() and not out.ignored_seq_groups  # nothing left: an idle round is fine


# -- no CPU swap space -----------------------------------------------------------------------------

@pytest.mark.parametrize("cpu", [0, 1])
@pytest.mark.parametrize("mode", [None, "swap", "recompute"])
def test_a_full_swap_space_fails_no_one_else(mode, cpu):
    # Five requests on 12 blocks of 4: constant preemption, almost no swap space.
    sched = make_scheduler(gpu=12, cpu=cpu, mode=mode, max_num_seqs=8)
    groups = [add(sched, f"r{i}", 5 + i, n=1 + i % 2, max_tokens=7) for i in range(5)]
    outs = run_to_end(sched)
    assert any(out.preempted for out in outs)
    for g in groups:
        if g.error is None:
            assert all(s.get_output_len() == 7 for s in g.get_seqs()), g.request_id
        else:  # only a group of several samples may be given up, and only for swap space
            assert g.sampling_params.n > 1 and "CPU swap space is full" in g.error
    assert all(g.error is None for g in groups if g.sampling_params.n == 1)
    assert_all_free(sched)


def test_samples_that_cannot_be_swapped_make_a_single_sample_request_leave_instead():
    """Issue 21: with no swap space and three long single-sample requests running, a request for
    two samples was given up (and its client told it could never fit) when the cache filled,
    though alone it runs. A group that can be recomputed leaves in its place."""
    sched = make_scheduler(gpu=40, cpu=0, max_num_seqs=8)
    singles = [add(sched, f"s{i}", 8, max_tokens=40) for i in range(3)]
    pair = add(sched, "pair", 4, n=2, max_tokens=30)
    outs = run_to_end(sched)
    assert ignored(outs) == [] and pair.error is None
    assert any(out.preempted for out in outs) and "pair" not in {r for out in outs for r in out.preempted}
    assert all(s.get_output_len() == 30 for s in pair.get_seqs()) and len(pair.get_seqs()) == 2
    assert all(g.get_seqs()[0].get_output_len() == 40 for g in singles)
    assert_all_free(sched)


def test_a_recomputable_group_already_given_its_slot_leaves_for_the_newest_that_cannot():
    """The pair is the newest running group, so it asks for its blocks last, after the older
    groups got their slots in this round: one of those gives its place back and is recomputed."""
    sched = make_scheduler(gpu=10, cpu=0, max_num_seqs=8, block_size=4)
    older = [add(sched, f"s{i}", 5, max_tokens=9) for i in range(2)]  # 5 + 9 tokens: 4 blocks each
    pair = add(sched, "pair", 4, n=2, max_tokens=8)  # 1 prompt block, then 2 blocks per sample
    outs = run_to_end(sched)
    assert pair.error is None and all(s.get_output_len() == 8 for s in pair.get_seqs())
    assert all(g.get_seqs()[0].get_output_len() == 9 for g in older)
    assert any(set(out.preempted) & {"s0", "s1"} for out in outs)
    assert_all_free(sched)


def test_when_only_multi_sample_groups_run_one_is_given_up_as_retryable():
    sched = make_scheduler(gpu=12, cpu=0, max_num_seqs=8, block_size=4)
    pairs = [add(sched, f"p{i}", 4, n=2, max_tokens=16) for i in range(2)]
    outs = run_to_end(sched)
    assert ignored(outs) == ["p1"]
    assert pairs[1].retryable and "CPU swap space is full" in pairs[1].error
    assert pairs[0].error is None and all(s.get_output_len() == 16 for s in pairs[0].get_seqs())
    assert_all_free(sched)


# -- random workloads ----------------------------------------------------------------------------

@st.composite
def workloads(draw):
    block_size = draw(st.integers(1, 4))
    max_model_len = draw(st.integers(4, 24))
    # check_capacity (in the engine) guarantees max_model_len fits the cache.
    least = -(-max_model_len // block_size)
    gpu = draw(st.integers(least, max(least, 16)))
    chunked = draw(st.booleans())
    budget = draw(st.integers(4, 24)) if chunked else max(max_model_len, 8)
    config = dict(gpu=gpu, cpu=draw(st.integers(0, 8)), block_size=block_size, max_model_len=max_model_len,
                  max_num_seqs=draw(st.integers(1, 4)), watermark=draw(st.sampled_from([0.0, 0.1, 0.3])),
                  mode=draw(st.sampled_from([None, "swap", "recompute"])),
                  policy=draw(st.sampled_from(["vllm", "orca"])),
                  chunked=chunked, prefix=draw(st.booleans()), budget=budget)
    common = [next(_tokens) for _ in range(8)]  # a shared head, for prefix caching
    requests = []
    for i in range(draw(st.integers(1, 6))):
        prompt_len = draw(st.integers(1, 12))
        head = draw(st.integers(0, min(prompt_len, 8)))
        prompt = common[:head] + [next(_tokens) for _ in range(prompt_len - head)]
        requests.append(dict(rid=f"r{i}", prompt=prompt, n=draw(st.integers(1, 3)), max_tokens=draw(st.integers(1, 16)),
                             arrival=draw(st.integers(0, 6)), abort=draw(st.none() | st.integers(0, 30))))
    return config, requests


@settings(max_examples=300, deadline=None)
@given(workloads())
def test_random_workloads_never_idle_never_hang_never_leak(workload):
    config, requests = workload
    sched = make_scheduler(**config)
    cfg, bm = sched.scheduler_config, sched.block_manager
    groups: dict[str, SequenceGroup] = {}
    for round_no in range(1000):
        for r in requests:
            if r["arrival"] == round_no:
                groups[r["rid"]] = add(sched, r["rid"], r["prompt"], n=r["n"], max_tokens=r["max_tokens"])
            if r["abort"] == round_no and r["rid"] in groups:
                sched.abort_seq_group(r["rid"])
        if round_no > max(r["arrival"] for r in requests) and not sched.has_unfinished_seqs():
            break
        had_work = sched.has_unfinished_seqs()
        recomputable = {g.request_id for g in sched.running if len(g.get_unfinished_seqs()) == 1}
        _, out = play_round(sched)
        # Never a round that does nothing while work is left (the spin of issue 12).
        assert not had_work or not out.is_empty() or out.ignored_seq_groups or out.preempted
        # A group is given up for memory only once every group that could be recomputed in its
        # place has been (issue 21), and then it is the server's fault: retryable.
        for g in out.ignored_seq_groups:
            if "CPU swap space is full" in (g.error or ""):
                assert g.retryable and recomputable <= set(out.preempted), (g.request_id, recomputable, out.preempted)
    else:
        raise AssertionError("the workload did not finish within 1000 rounds")
    assert_all_free(sched)
    for r in requests:
        g = groups[r["rid"]]
        assert g.is_finished()
        seqs = g.get_seqs()
        prompt_len = len(r["prompt"])
        worst = bm.worst_case_num_blocks(prompt_len, r["n"], min(prompt_len + r["max_tokens"], cfg.max_model_len))
        refused = (prompt_len > cfg.prompt_limit or r["n"] > cfg.max_num_seqs
                   or -(-prompt_len // bm.block_size) + bm.watermark_blocks > bm.num_total_gpu_blocks
                   or (r["n"] > 1 and worst + bm.watermark_blocks > bm.num_total_gpu_blocks))
        if any(s.status == SequenceStatus.FINISHED_ABORTED for s in seqs):
            continue
        if refused:  # refused up front, before running
            assert g.error and all(s.status.finish_reason == "ignored" and s.get_output_len() == 0 for s in seqs)
            continue
        # The safety net never fired; only a group of several samples may be given up, for swap space.
        assert g.error is None or (r["n"] > 1 and "CPU swap space is full" in g.error), g.error
        if g.error is None:
            assert len(seqs) == r["n"]
            assert all(s.get_output_len() == r["max_tokens"] or s.get_len() >= cfg.max_model_len for s in seqs)


# -- the same defects through LLM.generate on the tiny model ---------------------------------------

PROMPTS = ["Hello, my name is", "The future of AI is", "The life is", "List three colors:"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PAIR = SamplingParams(n=2, temperature=1.0, max_tokens=12, seed=9, ignore_eos=True)


@pytest.fixture(scope="module")
def roomy(tiny_model_dir):
    """Outputs of an unconstrained run: the greedy prompts, then a seeded pair of samples."""
    llm = LLM(model=str(tiny_model_dir), device="cpu", num_gpu_blocks=256, num_cpu_blocks=64, max_model_len=256)
    outs = llm.generate([*PROMPTS, PROMPTS[1]], [GREEDY] * len(PROMPTS) + [PAIR])
    return [o.outputs[0].token_ids for o in outs[:-1]], [c.token_ids for c in outs[-1].outputs]


@pytest.fixture(scope="module")
def roomy_greedy(roomy):
    return roomy[0]


def test_generate_returns_when_a_request_can_never_fit(tiny_model_dir, roomy_greedy):
    llm = LLM(model=str(tiny_model_dir), device="cpu", num_gpu_blocks=16, num_cpu_blocks=16, max_model_len=256)
    bad = SamplingParams(n=3, temperature=1.0, max_tokens=100, seed=5, ignore_eos=True)
    outs = llm.generate(PROMPTS[:1] + PROMPTS, [bad] + [GREEDY] * len(PROMPTS))
    assert outs[0].finished and [c.finish_reason for c in outs[0].outputs] == ["ignored"]
    assert "n=3" in outs[0].error and "max_tokens=100" in outs[0].error
    assert [o.outputs[0].token_ids for o in outs[1:]] == roomy_greedy
    assert_engine_clean(llm)


def test_generate_returns_when_n_is_over_max_num_seqs(tiny_model_dir, roomy_greedy):
    llm = LLM(model=str(tiny_model_dir), device="cpu", num_gpu_blocks=64, num_cpu_blocks=16, max_model_len=256,
              max_num_seqs=2)
    wide = SamplingParams(n=3, temperature=1.0, max_tokens=4, seed=5)
    outs = llm.generate([PROMPTS[0], *PROMPTS], [wide] + [GREEDY] * len(PROMPTS))
    assert outs[0].outputs[0].finish_reason == "ignored" and "max_num_seqs=2" in outs[0].error
    assert [o.outputs[0].token_ids for o in outs[1:]] == roomy_greedy
    assert_engine_clean(llm)


@pytest.mark.parametrize("cpu", [0, 1, 64])
@pytest.mark.parametrize("mode", [None, "swap", "recompute"])
def test_a_tiny_swap_space_fails_no_other_request(tiny_model_dir, roomy, mode, cpu):
    # 8 blocks of 8 tokens for four greedy prompts growing to ~20 tokens and a seeded pair of
    # samples: constant preemption with no, almost no, or plenty of swap space.
    llm = LLM(model=str(tiny_model_dir), device="cpu", block_size=8, num_gpu_blocks=8, num_cpu_blocks=cpu,
              max_model_len=64, watermark=0.0, preemption_mode=mode)
    outs = llm.generate([*PROMPTS, PROMPTS[1]], [GREEDY] * len(PROMPTS) + [PAIR])
    assert [o.outputs[0].token_ids for o in outs[:-1]] == roomy[0]
    pair = outs[-1]
    assert pair.finished
    if pair.error is None:
        assert [c.token_ids for c in pair.outputs] == roomy[1]
    else:  # given up on when it had to be preempted; the samples so far are the right ones
        assert cpu < 64 and "CPU swap space is full" in pair.error
        assert any(c.finish_reason == "ignored" for c in pair.outputs)
        assert all(c.token_ids == r[: len(c.token_ids)] for c, r in zip(pair.outputs, roomy[1]))
    assert_engine_clean(llm)


def assert_engine_clean(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    assert_all_free(engine.scheduler)
    assert not engine._groups and not engine._generators
