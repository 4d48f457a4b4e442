"""``compat="vllm-0.4"`` against vLLM v0.4.0's own scheduler, round by round (issue 23, section 1).

The oracle is the real thing: ``vllm/core/scheduler.py``'s ``Scheduler`` with
``BlockSpaceManagerV1``, installed by ``make venv`` and loaded without the rest of vLLM
(``v04_oracle.py`` says how, and what the test changes on its copy: frees go in table order, so
that block numbers are reproducible, and the watermark is the workload's). Without it the test
fails and says to run ``make venv``: CI runs ``make test``, which installs it.

Each of ``SEEDS`` draws a workload: block size, GPU and CPU block counts (no swap space too),
watermark, ``max_num_seqs``, ``max_num_batched_tokens >= max_model_len`` (v0.4.0 requires it),
requests arriving over the rounds, some with ``n > 1`` (forked at the prompt as v0.4.0's
``LLMEngine`` forks them), some with prompts over the limit, some samples stopping early (as an
EOS would). In the first ``TIED_FROM`` workloads arrival times are distinct; in the others every
request of a round shares that round's arrival time, as in the simulator, with sequence ids
shuffled and (in half of them) request ids that are not zero-padded, so that ties are decided by
queue order alone (v0.4.0's FCFS sort is stable) and the batch's order by request id as text.
``preemption_mode`` stays None: v0.4.0 has no such setting, and its ``_preempt`` always decides by
the number of sequences (``test_the_seed_rounds_are_v040s`` also passes it the swap mode). Both
schedulers get the same requests, and between rounds the same made-up model
(``v04_oracle.ModelStub``) and the same bookkeeping (v0.4.0's ``_process_sequence_group_outputs``,
taking the batch in v0.4.0's order on both sides, as the order of frees decides the block numbers
a stack hands out next). Every round must decide the same: whether it is a prompt or a decode
round, which requests it schedules, in which order (v0.4.0's ``SchedulerOutputs`` sorts its batch
by LoRA id and request id, and so does compat) and with how many tokens, which it refuses, which
it preempts by recompute or swaps out (read off the queues, as v0.4.0 reports no preemptions) and
swaps in, the swap-in, swap-out and copy maps block for block, the queues afterwards (``waiting``
in order; ``running`` and ``swapped`` as sets: both sort them by arrival before use, but tinyserve
sorts in prompt rounds too, v0.4.0 only in decode rounds), the free GPU and CPU blocks, and every
block table.

Where v0.4.0 does what tinyserve deliberately does not, the workload stops being compared at that
round and is counted under its reason (``SKIPS``); at least ``MIN_COMPARED`` of the workloads
must run to their end. Each reason is checked, not assumed: tinyserve must have taken its own path
in that very round (a refusal up front, a stand-in or a refusal on a full swap space, the
stuck-round safety net), or the round counts as a mismatch. A workload made for each reason
shows v0.4.0 doing what the reason says (``test_skip_*``), and three tests show that the
comparison fails when tinyserve's rules differ from v0.4.0's.

A known difference the workloads stay clear of: v0.4.0 caps a sequence when ``get_len() >
max_model_len``, tinyserve when ``get_len() >= max_model_len``. The test finishes sequences itself
(at ``max_tokens`` or an early stop), and keeps ``prompt + max_tokens`` below ``max_model_len``
for every prompt within the limit.
"""

from __future__ import annotations

import importlib.metadata
import random
from collections import Counter, deque
from dataclasses import dataclass, field, replace

import pytest
from v04_oracle import (
    INSTALL_HINT,
    ModelStub,
    OracleMissing,
    OracleSide,
    Request,
    TinyserveSide,
    WorkloadConfig,
    child_id,
    load,
    locate,
)

from tinyserve import presets, refusals
from tinyserve.block_manager import BlockSpaceManager, V04BlockSpaceManager
from tinyserve.scheduler import Scheduler
from tinyserve.sim import simulate

SEEDS = range(1500)
TIED_FROM = 1000  # the seeds from here on draw workloads whose requests share arrival times
MIN_COMPARED = 0.8
MAX_ROUNDS = 3000  # far more than any workload needs: running out of rounds is a failure

REFUSED_N = "tinyserve refuses n > max_num_seqs up front (v0.4.0 waits for it forever)"
REFUSED_NEVER_FITS = ("tinyserve refuses up front an n > 1 group whose samples may not fit the GPU at once "
                      "(v0.4.0 admits it; swapped out, it could never come back)")
SWAP_FULL = ("v0.4.0 raises RuntimeError on a full CPU swap space (tinyserve preempts a recomputable group "
             "in its place, or refuses the one group)")
LIVELOCK = "v0.4.0 repeats an idle round forever on a group that can never run (tinyserve refuses that group)"
LEAK = ("v0.4.0 prefills a sample preempted by recompute beside its finished siblings: their blocks leak "
        "(ref count of all the group's sequences) and its sampler forks the sample again")
SKIPS = (REFUSED_N, REFUSED_NEVER_FITS, SWAP_FULL, LIVELOCK, LEAK)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def make_workload(seed: int) -> tuple[WorkloadConfig, list[Request], ModelStub]:
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 3, 4, 8, 16])
    max_model_len = rng.randint(6, 48)
    max_num_seqs = rng.randint(1, 8)
    # v0.4.0 needs max_num_batched_tokens >= max_model_len; at max_model_len the budget binds.
    budget = max(max_num_seqs, max_model_len + rng.choice([0, 0, rng.randint(1, 2 * max_model_len)]))
    longest = cdiv(max_model_len, block_size)  # blocks of the longest sequence
    num_gpu = rng.randint(max(2, longest // 2), longest + longest // 2 + 2)
    # One workload in four is all parallel sampling with room to swap: only groups of several
    # samples are swapped out, and they must be the newest running when memory runs out.
    sampling = rng.random() < 0.25
    if sampling:
        num_cpu = rng.randint(num_gpu, 3 * num_gpu)
    else:  # no swap space at all in about a third
        num_cpu = 0 if rng.random() < 0.3 else rng.randint(1, 2 * num_gpu)
    # v0.4.0's Scheduler always uses 0.01 (0 blocks below 100); the others make the watermark bite.
    watermark = rng.choice([0.01, 0.01, 0.01, 0.0, 0.05, 0.1, 0.2])
    cfg = WorkloadConfig(block_size, num_gpu, num_cpu, watermark, max_num_seqs, budget, max_model_len)
    arrivals = sorted(rng.choice([0, 0, rng.randint(0, 15)]) for _ in range(rng.randint(1, 16)))
    multi = 1.0 if sampling else rng.choice([0.2, 0.35, 0.7])  # the share of n > 1 requests
    bound = V04BlockSpaceManager(block_size, num_gpu, num_cpu, watermark)
    usable = num_gpu - bound.watermark_blocks
    requests = []
    for index, arrival in enumerate(arrivals):
        if rng.random() < 0.08:  # over the prompt limit: refused by both
            prompt_len, max_tokens = rng.randint(max_model_len + 1, max_model_len + 8), rng.randint(1, 8)
        else:  # prompt + max_tokens < max_model_len: clear of the length-cap difference
            prompt_len = rng.randint(1, max_model_len - 2)
            max_tokens = rng.randint(1, max_model_len - 1 - prompt_len)
        n = 1 if rng.random() >= multi else rng.randint(2, 4)
        if n > max_num_seqs and rng.random() < 0.99:  # tinyserve refuses the others (REFUSED_N)
            n = max_num_seqs
        # Mostly samples that fit the GPU all at once: tinyserve refuses n > 1 groups that may not
        # (REFUSED_NEVER_FITS, by this bound), and every such group ends its workload's comparison.
        shrink = rng.random() < 0.98
        while shrink and n > 1 and bound.worst_case_num_blocks(prompt_len, n, prompt_len + max_tokens) > usable:
            if max_tokens > 1:
                max_tokens -= 1
            else:
                n -= 1
        prompt = tuple(rng.randrange(10, 30_000) for _ in range(prompt_len))
        requests.append(Request(index, prompt, n, max_tokens, arrival))
    stub = ModelStub(seed, rng.choice([0.0, 0.0, 0.05, 0.15]))
    # From TIED_FROM on, every request of a round arrives at that round's time, as in the
    # simulator. Sequence ids are shuffled, and in half of these workloads the request ids are
    # not zero-padded, so that neither the sequence ids nor the text order of the request ids
    # follows the queue's: ties go by queue order alone (v0.4.0's sort is stable), and the batch
    # by request id as text ("r10" before "r9").
    if seed >= TIED_FROM:
        ties = random.Random(-seed)
        padded = ties.random() < 0.5
        requests = [replace(r, index=i, arrival_time=float(r.arrival_round), name=f"r{i:03d}" if padded else f"r{i}")
                    for r, i in zip(requests, ties.sample(range(len(requests)), len(requests)), strict=True)]
    return cfg, requests, stub


@dataclass
class Outcome:
    seed: int | None
    rounds: int = 0
    skipped: str | None = None
    mismatch: str | None = None
    differs: list[str] = field(default_factory=list)  # what the mismatched round disagreed on
    stats: Counter = field(default_factory=Counter)  # what the compared rounds did (v0.4.0's counts)
    preempted: dict[int, list[str]] = field(default_factory=dict)  # by round, from 1, as sim numbers them
    ignored: dict[int, list[str]] = field(default_factory=dict)
    sides: tuple[TinyserveSide, OracleSide] | None = field(default=None, repr=False)  # as the run left them


def moves(before: dict[str, list[str]], after: dict[str, list[str]]) -> dict[str, list[str]]:
    """Preemptions and swap-ins, read off the queues before and after the round."""
    return {
        "recomputed": sorted(r for r in after["waiting"] if r in before["running"]),
        "swapped_out": sorted(set(before["running"]) & set(after["swapped"])),
        "swapped_in": sorted(set(before["swapped"]) & set(after["running"])),
    }


def up_front_refusals(ts: TinyserveSide, oracle_ignored: list[str]) -> list[str]:
    """The reasons tinyserve refused groups this round that v0.4.0 did not, where the refusal is
    one tinyserve makes on purpose and v0.4.0 lacks."""
    reasons = []
    cfg, bm = ts.sched.scheduler_config, ts.sched.block_manager
    for group in ts.out.ignored_seq_groups:
        if group.request_id in oracle_ignored:
            continue
        if group.sampling_params.n > cfg.max_num_seqs:
            reasons.append(REFUSED_N)
        elif group.error == refusals.never_fits(group, bm, cfg):
            reasons.append(REFUSED_NEVER_FITS)
    return reasons


def describe(seed: int, cfg: WorkloadConfig, requests: list[Request], stub: ModelStub) -> str:
    reqs = ", ".join(f"{r.request_id}(seq {r.index}, prompt {len(r.prompt)}, n={r.n}, max_tokens={r.max_tokens}, "
                     f"round {r.arrival_round}, time {r.arrival})" for r in requests)
    return f"seed {seed}: {cfg}, stop_p={stub.stop_p}; requests {reqs}"


def run(seed: int, compat: str = "vllm-0.4") -> Outcome:
    """Play workload ``seed`` on both schedulers, comparing every round (see the module docstring)."""
    return compare(*make_workload(seed), seed=seed, compat=compat)


def compare(cfg: WorkloadConfig, requests: list[Request], stub: ModelStub, seed: int | None = None,
            compat: str = "vllm-0.4", swap: bool = False) -> Outcome:
    """Play one workload on both schedulers, round by round, until both are done, a mismatch, or
    a round where v0.4.0 does what tinyserve deliberately does not (``Outcome.skipped``).
    ``swap``: both preempt by swapping (``preemption_mode="swap"``; see ``OracleSide``)."""
    ts, ov = TinyserveSide(cfg, compat, swap), OracleSide(cfg, swap)
    result = Outcome(seed, sides=(ts, ov))
    pending = sorted(requests, key=lambda r: r.arrival_round)  # stable: the list's order within a round
    arrival = {r.request_id: r.arrival for r in requests}
    order = {r.request_id: (r.arrival, k) for k, r in enumerate(pending)}  # arrival, then order added

    def mismatch(rnd: int, what: str) -> Outcome:
        result.mismatch = f"{describe(seed, cfg, requests, stub)}\n  round {rnd}: {what}"
        return result

    for rnd in range(MAX_ROUNDS):
        while pending and pending[0].arrival_round <= rnd:
            req = pending.pop(0)
            ts.add(req)
            ov.add(req)
        if not (pending or ts.unfinished() or ov.unfinished()):
            result.rounds = rnd
            leftover = {name: (s.state()["free_gpu"], s.state()["free_cpu"], s.state()["tables"])
                        for name, s in (("v0.4.0", ov), ("tinyserve", ts))}
            if any(v != (cfg.num_gpu_blocks, cfg.num_cpu_blocks, {}) for v in leftover.values()):
                return mismatch(rnd, f"blocks still held at the end (free GPU, free CPU, tables): {leftover}")
            return result
        before_t, before_o = ts.queues(), ov.queues()
        oracle_state_before = ov.state()
        t = ts.schedule()
        try:
            o, swap_full = ov.schedule(), None
        except RuntimeError as err:
            if "lack of CPU swap space" not in str(err):
                raise
            o, swap_full = None, err
        refused = up_front_refusals(ts, o.ignored if o else [])
        if refused:
            result.skipped, result.rounds = refused[0], rnd
            return result
        if swap_full is not None:
            gave_up = any("cannot be recomputed and CPU swap space is full" in e for e in t.errors.values())
            if not (ts.stand_ins or gave_up):
                return mismatch(rnd, f"v0.4.0 raised {swap_full!r}, but tinyserve neither preempted a stand-in "
                                     f"nor refused a group: {t}")
            result.skipped, result.rounds = SWAP_FULL, rnd
            return result
        if o.empty and not o.ignored and ov.unfinished() and ov.state() == oracle_state_before:
            if t.scheduled or not any("can never be scheduled: nothing else is running" in e
                                      for e in t.errors.values()):
                return mismatch(rnd, f"v0.4.0 is stuck in an idle round, but tinyserve did not refuse the stuck "
                                     f"group: {t}")
            result.skipped, result.rounds = LIVELOCK, rnd
            return result

        after_t, after_o = ts.queues(), ov.queues()
        seen = {"v0.4.0": {**vars(o), **moves(before_o, after_o), **ov.state()},
                "tinyserve": {**vars(t), **moves(before_t, after_t), **ts.state()}}
        for side in seen.values():
            side.pop("errors")
            if compat != "vllm-0.4":  # only compat keeps v0.4.0's batch order: compare the batch as a set
                side["scheduled"] = sorted(side["scheduled"])
        result.differs = [key for key in seen["v0.4.0"] if seen["v0.4.0"][key] != seen["tinyserve"][key]]
        diff = [f"{key}: v0.4.0 {seen['v0.4.0'][key]!r} != tinyserve {seen['tinyserve'][key]!r}"
                for key in result.differs]
        own = seen["tinyserve"]
        reported = {"preempted": sorted(own["recomputed"] + own["swapped_out"]),
                    "swapped_out": own["swapped_out"], "swapped_in": own["swapped_in"]}
        if ts.reported_moves() != reported:
            diff.append(f"tinyserve's SchedulerOutputs reports {ts.reported_moves()}, its queues say {reported}")
        if diff:
            return mismatch(rnd, "; ".join(diff))
        result.stats.update(rounds=1, **{f"{o.kind} rounds": 1}, ignored=len(o.ignored),
                            recomputed=len(own["recomputed"]), swapped_out=len(own["swapped_out"]),
                            swapped_in=len(own["swapped_in"]), copies=sum(map(len, o.copy.values())),
                            forked=sum(1 for g in ov.out.scheduled_seq_groups
                                       if o.kind == "prompt" and g.seq_group.sampling_params.n > 1),
                            # a decode round whose running groups share an arrival time (the queue
                            # order decides), a batch whose order by request id is not arrival order
                            tied=o.kind == "decode" and len({arrival[r] for r in before_o["running"]})
                            < len(before_o["running"]),
                            reordered=[r for r, _ in o.scheduled] != sorted((r for r, _ in o.scheduled),
                                                                            key=order.__getitem__))
        if own["recomputed"] or own["swapped_out"]:
            result.preempted[rnd + 1] = sorted(own["recomputed"] + own["swapped_out"])
        if o.ignored:
            result.ignored[rnd + 1] = o.ignored
        if ov.readmitted_with_finished_samples():
            result.skipped, result.rounds = LEAK, rnd
            return result
        ts.play(stub)
        ov.play(stub)
    return mismatch(MAX_ROUNDS, f"not finished after {MAX_ROUNDS} rounds")


@pytest.fixture(scope="module")
def oracle():
    try:
        return load()
    except OracleMissing as err:
        missing = str(err)
    pytest.fail(missing, pytrace=False)  # not a skip: make test installs the oracle


def test_compat_decides_as_vllm_040_does_round_by_round(oracle):
    outcomes = [run(seed) for seed in SEEDS]
    mismatches = [o.mismatch for o in outcomes if o.mismatch]
    skipped = Counter(o.skipped for o in outcomes if o.skipped and not o.mismatch)
    compared = [o for o in outcomes if not (o.skipped or o.mismatch)]
    stats = sum((o.stats for o in outcomes if not o.mismatch), Counter())
    summary = (f"{len(compared)} of {len(outcomes)} workloads compared to the end, "
               f"{sum(o.rounds for o in compared)} rounds; skipped: {dict(skipped) or 'none'}; "
               f"{len(mismatches)} mismatched; compared rounds: {dict(stats)}")
    print(summary)
    assert not mismatches, f"{summary}\n" + "\n".join(mismatches[:3])
    assert len(compared) >= MIN_COMPARED * len(outcomes), summary
    # The workloads reach every rule being compared: otherwise agreement would say little.
    for what in ("prompt rounds", "decode rounds", "ignored", "recomputed", "swapped_out", "swapped_in",
                 "copies", "forked", "tied", "reordered"):
        assert stats[what] > 0, f"no compared round had any {what}: {summary}"


@pytest.mark.parametrize("swap", [False, True], ids=["v0.4-rule", "swap"])
def test_the_seed_rounds_are_v040s(oracle, swap):
    # s0/s1/s2 under compat (test_compat.py works their rounds out by hand), all three arriving
    # at once, as in the simulator. v0.4.0 refuses a max_model_len of 20 over a budget of 10; at
    # 10 its prompt limit (the smaller of the two) is the same, and the test ends every sequence
    # itself, at its max_tokens.
    p = presets.seed_rounds("swap" if swap else None, compat="vllm-0.4")
    sc, cc = p.scheduler_config, p.cache_config
    cfg = WorkloadConfig(cc.block_size, cc.num_gpu_blocks, cc.num_cpu_blocks, cc.watermark, sc.max_num_seqs,
                         sc.max_num_batched_tokens, max_model_len=sc.max_num_batched_tokens)
    requests = [Request(k, tuple(range(100 * k, 100 * k + r.prompt_len)), 1, r.output_len, 0, arrival_time=1.0,
                        name=r.request_id) for k, r in enumerate(p.requests)]
    out = compare(cfg, requests, NO_STOPS, swap=swap)
    assert out.mismatch is None and out.skipped is None
    records = simulate(p.requests, sc, cc)
    assert out.preempted == {r.round: sorted(r.preempted) for r in records if r.preempted}
    assert out.ignored == {r.round: r.ignored for r in records if r.ignored}
    assert out.rounds == len(records) and out.stats["swapped_out" if swap else "recomputed"] >= 3


# -- each skip, on a workload made for it: v0.4.0 does what the skip says, tinyserve does not -----


@dataclass(frozen=True)
class ScriptedStub(ModelStub):
    """A model whose samples stop early exactly at ``stops``: (sequence id, output length)."""

    stops: frozenset = frozenset()

    def finish(self, seq_id: int, output_len: int, max_tokens: int) -> str | None:
        if output_len >= max_tokens:
            return "length"
        return "stop" if (seq_id, output_len) in self.stops else None


def req(index: int, prompt_len: int, n: int, max_tokens: int) -> Request:
    return Request(index, tuple(range(10, 10 + prompt_len)), n, max_tokens, arrival_round=0)


# WorkloadConfig fields: block_size, num_gpu_blocks, num_cpu_blocks, watermark, max_num_seqs,
# max_num_batched_tokens, max_model_len.
NO_STOPS = ModelStub(0, 0.0)


def test_skip_refused_n(oracle):
    # n=3 samples, at most 2 sequences a round: tinyserve refuses it; v0.4.0 keeps it waiting.
    out = compare(WorkloadConfig(4, 16, 16, 0.0, 2, 32, 32), [req(0, 4, 3, 4)], NO_STOPS)
    assert out.skipped == REFUSED_N and out.rounds == 0
    ts, ov = out.sides
    assert ov.queues()["waiting"] == ["r000"] and not ov.out.ignored_seq_groups
    assert ts.out.ignored_seq_groups[0].request_id == "r000"


def test_skip_refused_never_fits(oracle):
    # 4 samples of up to 24 tokens in blocks of 2 may need 41 blocks at once; the GPU has 6.
    out = compare(WorkloadConfig(2, 6, 32, 0.0, 8, 32, 32), [req(0, 4, 4, 20)], NO_STOPS)
    assert out.skipped == REFUSED_NEVER_FITS and out.rounds == 0
    ts, ov = out.sides
    assert ov.queues()["running"] == ["r000"]  # v0.4.0 admitted it
    assert "may need" in ts.out.ignored_seq_groups[0].error


def test_skip_livelock(oracle, monkeypatch):
    # The same group with tinyserve's up-front check turned off: v0.4.0 swaps it out once it has
    # grown and can never swap it back; tinyserve's stuck-round safety net refuses it instead.
    monkeypatch.setattr(refusals, "never_fits", lambda *args: None)
    out = compare(WorkloadConfig(2, 6, 32, 0.0, 8, 32, 32), [req(0, 4, 4, 20)], NO_STOPS)
    assert out.skipped == LIVELOCK and out.stats["swapped_out"] == 1
    ts, ov = out.sides
    state = ov.state()
    assert ov.schedule().empty and ov.state() == state  # and the next round is the same again
    assert "can never be scheduled" in ts.out.ignored_seq_groups[0].error


def test_skip_swap_full(oracle):
    # No swap space. r001's two samples need blocks that r000 holds; r001 is the newest, so
    # v0.4.0 swaps it out, and raises. tinyserve preempts r000 (one sequence) in its place.
    out = compare(WorkloadConfig(2, 6, 0, 0.0, 8, 40, 40), [req(0, 6, 1, 8), req(1, 2, 2, 4)], NO_STOPS)
    assert out.skipped == SWAP_FULL
    ts, _ = out.sides
    assert ts.stand_ins == ["r000"] and ts.out.preempted == ["r000"]


def test_skip_leak(oracle):
    # Blocks of one token. r001's second sample stops at once, so r001 has one sequence left and
    # is preempted by recompute when memory runs out; prefilled again, v0.4.0 counts its finished
    # sample among the owners of the new blocks, which then never come free.
    stub = ScriptedStub(0, 0.0, stops=frozenset({(child_id(1, 0), 1)}))
    out = compare(WorkloadConfig(1, 9, 8, 0.0, 8, 40, 40), [req(0, 4, 1, 20), req(1, 2, 2, 4)], stub)
    assert out.skipped == LEAK and out.stats["recomputed"] >= 1
    ts, ov = out.sides
    [group] = [g for g in ov.sched.running if g.request_id == "r001"]
    [seq] = group.get_seqs(ov.o.sequence.SequenceStatus.RUNNING)
    assert group.num_seqs() == 2 and {b.ref_count for b in ov.sched.block_manager.block_tables[seq.seq_id]} == {2}
    assert {b.ref_count for b in ts.sched.block_manager.block_tables[seq.seq_id]} == {1}  # tinyserve's


# -- the comparison can fail --------------------------------------------------------------------


def test_the_comparison_tells_tinyserves_own_rules_from_v040s(oracle):
    # compat="tinyserve" differs from v0.4.0 on purpose (can_append_slot, the watermark, queue
    # order, the free-list order): the same harness must find a mismatch within a few workloads.
    found = next((o.mismatch for o in map(lambda s: run(s, compat="tinyserve"), SEEDS) if o.mismatch), None)
    assert found is not None, "the comparison found no difference between tinyserve's rules and v0.4.0's"


def test_the_comparison_catches_one_v040_rule_missing(oracle, monkeypatch):
    # compat with tinyserve's exact can_append_slot instead of v0.4.0's one-free-block-per-sequence
    # heuristic: some workload must then preempt differently (not only number blocks differently).
    monkeypatch.setattr(V04BlockSpaceManager, "can_append_slot", BlockSpaceManager.can_append_slot)
    decisions = {"kind", "scheduled", "recomputed", "swapped_out", "waiting", "running", "swapped"}
    found = next((o for o in map(run, SEEDS) if set(o.differs) & decisions), None)
    assert found is not None, "no workload noticed can_append_slot's rule"


def test_the_comparison_catches_ties_broken_by_sequence_id(oracle, monkeypatch):
    # compat breaking ties of arrival time by sequence id (as it once did) instead of queue order:
    # some workload with shared arrival times must then decide differently, and none without.
    def sort_with_ids(sched):
        def key(group):
            return group.arrival_time, group.get_seqs()[0].seq_id
        sched.running, sched.swapped = deque(sorted(sched.running, key=key)), deque(sorted(sched.swapped, key=key))

    monkeypatch.setattr(Scheduler, "_sort_by_arrival", sort_with_ids)
    assert all(run(seed).mismatch is None for seed in range(50))
    decisions = {"scheduled", "recomputed", "swapped_out", "swapped_in", "waiting", "running", "swapped"}
    found = next((o for o in map(run, range(TIED_FROM, len(SEEDS))) if set(o.differs) & decisions), None)
    assert found is not None, "no workload with shared arrival times noticed how ties are broken"


def test_a_missing_oracle_fails_and_says_to_run_make_venv(monkeypatch):
    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    with pytest.raises(OracleMissing, match="run `make venv`") as info:
        locate()
    assert str(info.value) == INSTALL_HINT
