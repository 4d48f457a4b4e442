"""Chapter 13's runs: the presets under policy="v1", three_policies, the rate sweep and its figures.

The sweep's numbers are checked against a count made here without ``sim.simulate`` or the
records: ``drive`` runs the Scheduler itself and reads every sequence's output tokens after each
round. Trends are checked only where they must hold (a request produces at most one token per
round, every prompt token and every decode is computed at least once, ...); more load is not
assumed to mean more rounds or a longer wait for every policy, since it need not."""

from __future__ import annotations

import itertools
import time

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from tinyserve import presets, sim  # noqa: E402
from tinyserve.config import CacheConfig, SchedulerConfig  # noqa: E402
from tinyserve.lab import policy_runs  # noqa: E402
from tinyserve.lab.policy_runs import (  # noqa: E402
    RATES,
    poisson_requests,
    rate_sweep,
    run_policy,
    sweep_configs,
    three_policies,
)
from tinyserve.scheduler import Scheduler  # noqa: E402
from tinyserve.sequence import SamplingParams, Sequence, SequenceGroup  # noqa: E402
from tinyserve.viz import figures, policies  # noqa: E402


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def drive(requests, scheduler_config, cache_config):
    """Run the Scheduler round by round without the simulator. Returns one dict per round
    (what was scheduled with its chunk and whether it was a prompt, the queues after the
    round, who finished) and, per request, the rounds in which it had 1 and all output tokens."""
    s = Scheduler(scheduler_config, cache_config)
    pending = sorted(requests, key=lambda r: r.arrival_round)
    fake = itertools.count(10**6)
    groups, first, last, rounds = {}, {}, {}, []
    for rnd in itertools.count(1):
        while pending and pending[0].arrival_round <= rnd:
            q = pending.pop(0)
            prompt = [10**5 + 1000 * len(groups) + j for j in range(q.prompt_len)]  # unlike any other prompt
            seq = Sequence(len(groups), None, prompt, cache_config.block_size)
            groups[q.request_id] = (q, SequenceGroup(q.request_id, [seq], SamplingParams(max_tokens=q.output_len),
                                                     arrival_time=float(rnd)))
            s.add_seq_group(groups[q.request_id][1])
        if not pending and not s.has_unfinished_seqs():
            break
        _, out = s.schedule()
        members = [(m.seq_group.request_id, m.token_chunk_size, m.is_prompt) for m in out.scheduled_seq_groups]
        s.postprocess(out, lambda group, seq: next(fake))
        for rid, (q, g) in groups.items():
            n = len(g.get_seqs()[0].output_token_ids)
            if n >= 1:
                first.setdefault(rid, rnd)
            if n == q.output_len:
                last.setdefault(rid, rnd)
        rounds.append({"members": members, "tokens": out.num_batched_tokens, "preempted": list(out.preempted),
                       "waiting": [g.request_id for g in s.waiting], "running": [g.request_id for g in s.running],
                       "finished": [rid for rid, *_ in members if groups[rid][1].is_finished()]})
    return rounds, first, last


# -- the presets under v1 -------------------------------------------------------------------------


def test_presets_take_policy_v1():
    seed = presets.seed_rounds(policy="v1")
    assert seed.scheduler_config.preemption_mode == "recompute" and not seed.cache_config.enable_prefix_caching
    assert presets.seed_rounds(None, policy="v1").scheduler_config == seed.scheduler_config
    assert presets.seed_rounds(policy="v1", enable_prefix_caching=True).cache_config.enable_prefix_caching
    assert presets.seed_rounds().scheduler_config.preemption_mode == "swap"  # the story's default is kept
    assert presets.seed_rounds(policy="orca").scheduler_config.preemption_mode == "swap"
    assert not presets.seed_rounds().cache_config.enable_prefix_caching
    with pytest.raises(ValueError, match="recompute only"):
        presets.seed_rounds("swap", policy="v1")
    ae = presets.orca_example("v1")
    assert ae.scheduler_config.policy == "v1" and not ae.cache_config.enable_prefix_caching
    # Chapter 13's runs have V1's default, prefix caching, under v1 only.
    for name in ("seed", "orca_example"):
        assert [policy_runs.policy_preset(name, p).cache_config.enable_prefix_caching
                for p in ("vllm", "orca", "v1")] == [False, False, True]


def test_seed_rounds_under_v1_still_preempt():
    """Worked out by hand: round 1 fills the budget with s0 and s1 (5 + 5); in round 2 they decode
    first and take the last two free blocks, so s2 cannot be admitted (it waits, nobody is
    preempted in round 3). In round 7 both need a third block with none free: the newer, s1, is
    preempted by recompute. In round 9 s1 comes back finding its prompt block still cached
    (5 tokens), computes the other 6 and s2 its 3 in the same round."""
    records = three_policies("seed")["v1"]
    assert [r.preempted for r in records if r.preempted] == [["s1"]] and records[6].preempted == ["s1"]
    assert all(r.waiting == ["s2"] for r in records[:6])
    assert records[8].chunk_sizes == {"s1": 6, "s2": 3}
    assert len(records) == 16
    # Without prefix caching s1 computes all it lacks (10 tokens, the budget) and s2 waits a round more.
    p = presets.seed_rounds(policy="v1")
    off = sim.simulate(p.requests, p.scheduler_config, p.cache_config)
    assert off[8].chunk_sizes == {"s1": 10} and len(off) == 17


def test_orca_example_under_v1_needs_no_preemption_and_ignores_prefix_caching():
    runs = three_policies("orca_example")
    assert not any(r.preempted for r in runs["v1"])
    p = presets.orca_example("v1")
    assert sim.simulate(p.requests, p.scheduler_config, p.cache_config) == runs["v1"]


def test_three_policies_are_simulate_runs():
    for name in ("seed", "orca_example"):
        runs = three_policies(name)
        assert list(runs) == ["vllm", "orca", "v1"]
        for policy, records in runs.items():
            p = policy_runs.policy_preset(name, policy)
            assert p.scheduler_config.policy == policy
            assert records == sim.simulate(p.requests, p.scheduler_config, p.cache_config)
        assert policy_runs.budget(name) == policy_runs.policy_preset(name, "v1").scheduler_config.max_num_batched_tokens
    with pytest.raises(ValueError, match="preset_name"):
        three_policies("nope")


# -- the rate sweep --------------------------------------------------------------------------------


def test_poisson_arrivals():
    slow, fast = poisson_requests(0.25, 60), poisson_requests(2.0, 60)
    assert [(q.prompt_len, q.output_len) for q in slow] == [(q.prompt_len, q.output_len) for q in fast]
    assert all(a.arrival_round >= b.arrival_round for a, b in zip(slow, fast))
    assert slow == poisson_requests(0.25, 60) and slow != poisson_requests(0.25, 60, seed=1)
    assert all(4 <= q.prompt_len <= 40 and 2 <= q.output_len <= 24 for q in slow)
    # Many requests: arrivals per round come close to the rate.
    many = poisson_requests(0.5, 2000)
    assert abs(len(many) / many[-1].arrival_round - 0.5) < 0.05
    with pytest.raises(ValueError, match="rate"):
        poisson_requests(0, 10)


@pytest.mark.parametrize("rate", [0.2, 0.75, 2.0])
@pytest.mark.parametrize("policy", ["vllm", "orca", "v1"])
def test_sweep_numbers_match_an_independent_count(policy, rate):
    requests = poisson_requests(rate, 30, seed=3)
    records, m = run_policy(requests, policy)
    rounds, first, last = drive(requests, *sweep_configs(policy))
    assert m["rounds"] == len(rounds) == len(records)
    total = sum(r["tokens"] for r in rounds)
    assert m["tokens_per_round"] == pytest.approx(total / len(rounds))
    assert m["tokens_per_busy_round"] == pytest.approx(total / sum(1 for r in rounds if r["members"]))
    ttft = [first[q.request_id] - q.arrival_round + 1 for q in requests]
    assert m["ttft_mean"] == pytest.approx(np.mean(ttft))
    assert m["ttft_p90"] == pytest.approx(np.percentile(ttft, 90))
    tpot = [(last[q.request_id] - first[q.request_id]) / (q.output_len - 1) for q in requests if q.output_len > 1]
    assert m["tpot_mean"] == pytest.approx(np.mean(tpot))
    assert m["preemptions"] == sum(len(r["preempted"]) for r in rounds)
    # What must hold whatever the policy: a token per round at most, every prompt token and
    # every decode computed at least once (exactly once without preemption), nobody before it arrives.
    assert min(ttft) >= 1 and min(tpot) >= 1
    assert total >= sum(q.prompt_len + q.output_len - 1 for q in requests)
    if m["preemptions"] == 0:
        assert total == sum(q.prompt_len + q.output_len - 1 for q in requests)
    assert m["rounds"] >= max(q.arrival_round + q.output_len - 1 for q in requests)
    # The simulator's records tell the same rounds.
    assert [r.batch for r in records] == [[rid for rid, *_ in r["members"]] for r in rounds]


def test_rate_sweep_rows_and_speed():
    start = time.perf_counter()
    rows = rate_sweep(RATES)
    elapsed = time.perf_counter() - start
    assert elapsed < 10, f"the default sweep took {elapsed:.1f} s (the chapter's budget is 5 s; ~1.5 s measured)"
    assert [(r["rate"], r["policy"]) for r in rows] == [(rate, p) for rate in RATES for p in ("vllm", "orca", "v1")]
    assert rows == rate_sweep(RATES)  # seeded
    for r in rows:
        assert r["ttft_p90"] >= 1 and r["ttft_mean"] >= 1 and r["tpot_mean"] >= 1 and r["num_requests"] == 40
    # At the lightest load every request is prefilled in the round it arrives under orca and v1.
    light = [r for r in rows if r["rate"] == RATES[0]]
    assert all(r["ttft_p90"] == 1.0 for r in light if r["policy"] != "vllm")
    only = rate_sweep([1.0], policies=("v1",), num_requests=5, num_gpu_blocks=64)
    assert len(only) == 1 and only[0]["policy"] == "v1" and only[0]["num_requests"] == 5


def test_sweep_refuses_requests_that_cannot_run():
    # 4 blocks of 4 tokens cannot hold a 40-token prompt: the sweep says so instead of measuring.
    with pytest.raises(RuntimeError, match="did not produce all their tokens"):
        rate_sweep([1.0], policies=("vllm",), num_requests=5, num_gpu_blocks=4, max_num_seqs=4)


def test_v1_sweep_config_is_v1s_defaults():
    sc, cc = sweep_configs("v1")
    assert sc.enable_chunked_prefill and sc.preemption_mode == "recompute" and cc.enable_prefix_caching
    sc, cc = sweep_configs("vllm")
    assert not sc.enable_chunked_prefill and not cc.enable_prefix_caching
    assert isinstance(sc, SchedulerConfig) and isinstance(cc, CacheConfig)


# -- the figures ----------------------------------------------------------------------------------


def test_chapter_13_figures_draw(tmp_path):
    drawn = {}
    for name in ("13_policy_rounds", "13_rate_sweep"):
        assert figures.REGISTRY[name].startswith("policies:")
        drawn[name] = figures.draw(name)
        assert figures.save(drawn[name], name, tmp_path).stat().st_size > 10_000
    titles = [ax.get_title(loc="left") for ax in drawn["13_policy_rounds"].axes]
    runs = three_policies("seed")
    assert len(titles) == 3
    for title, (policy, run) in zip(titles, runs.items()):
        assert title.startswith(policies.POLICY_LABELS[policy]) and f"{len(run)} rounds" in title
    ttft, tokens = drawn["13_rate_sweep"].axes
    assert len(ttft.lines) == 6 and len(tokens.lines) == 3  # mean and p90 per policy; tokens per policy
    rows = rate_sweep(RATES)
    assert list(tokens.lines[2].get_ydata()) == [r["tokens_per_round"] for r in rows if r["policy"] == "v1"]
    assert list(tokens.lines[2].get_xdata()) == list(RATES)
