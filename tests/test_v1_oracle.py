"""``policy="v1"`` against vLLM 0.9.2's own V1 scheduler, step by step.

The oracle is the real thing: ``vllm/v1/core/sched/scheduler.py``'s ``Scheduler`` with its
``KVCacheManager`` and ``BlockPool``, loaded without the rest of vLLM on a stand-in config
(``v1_oracle.py`` says how, and why V1 gets one block more: its null block). ``make v1-oracle``
builds the env that has it (``.venv-v1oracle``) and runs this file there; in the project's
``.venv`` (vLLM v0.4.0, for ``test_v04_oracle.py``) the module skips, saying so.

Each of ``SEEDS`` draws a workload: block size, a number of GPU blocks small enough to force
preemptions (but never below what one request of ``max_model_len`` tokens needs, which V1's engine
checks at start-up), ``max_num_seqs``, ``max_num_batched_tokens``, chunked prefill (mostly on, V1's
default), ``long_prefill_token_threshold`` (0 or small), prefix caching on in half of them with
prompts that share heads (and some that repeat one whole), tinyserve's watermark (which v1 must
ignore), requests arriving over the steps, some ending early on EOS (some of those with
``ignore_eos``), some reaching ``max_model_len`` before ``max_tokens``. Both schedulers get the same
requests and, between steps, the same made-up model (``v1_oracle.ModelStub``): one token for each
request whose computed tokens reach its length. Every step must decide the same: which requests
run, in which order and with how many tokens (V1's ``SchedulerOutput.num_scheduled_tokens``),
which are preempted, which are refused (V1 refuses none), the free blocks after scheduling and
the blocks each running request holds, the ``waiting`` and ``running`` queues in order, and after
the step has run, which requests finished and why, and every unfinished request's computed tokens
and length; at the end every block must be free on both sides. A mismatch is reported with the
workload shrunk (``shrink``) to fewer and shorter requests that still mismatch on the same things.

Four differences are named simplifications (``v1_round.py``'s docstring). The workloads come in
two strata. In the named-free one (``make_workload(seed, named_free=True)``: prefix caching off,
chunked prefill on, no EOS on a request's last allowed token) none can occur, and every step of
every workload must be alike. In the full one a mismatching step is put to one classifier per
named difference, each of which recognizes it by its condition (see "the named simplifications"
below); a step none recognizes fails the test, and so does a share of workloads alike at every
step below ``MATCHED_SHARE``, or a classifier that never fired. The mutant tests check that a
broken prefix cache is not taken for a named difference.

``FIXED`` keeps the workloads of the differences fixed so far (they must agree at every step),
``NAMED_CASES`` one workload per named difference (its classifier must tell it) but the eviction
order's, whose old reproducer is fixed now (its classifier must fire in the random workloads);
``test_v1_never_finishes_a_prompt_of_max_model_len_tokens_in_chunks`` shows why the workloads keep
every prompt shorter than ``max_model_len``.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field, replace

import pytest
from v1_oracle import (
    INSTALL_HINT,
    Lookup,
    ModelStub,
    OracleMissing,
    OracleSide,
    Request,
    TinyserveSide,
    WorkloadConfig,
    load,
)

try:
    load()
except OracleMissing as err:
    pytest.skip(f"{err} (make test's .venv has vLLM v0.4.0 for test_v04_oracle.py)", allow_module_level=True)

SEEDS = range(1000)
MAX_STEPS = 2000  # far more than any workload needs: running out of steps is a failure
STUB = ModelStub()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def make_workload(seed: int, named_free: bool = False) -> tuple[WorkloadConfig, list[Request]]:
    """The workload of ``seed``; ``named_free``: of the stratum where no named difference can
    occur (prefix caching off: no hits, so classes 4 and 7 cannot; chunked prefill on: nothing is
    skipped, class 2; EOS never on the token that caps a request's length, class 1)."""
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4, 8, 16])
    max_model_len = rng.randint(8, 64)
    longest = cdiv(max_model_len, block_size)  # blocks of a request of max_model_len tokens
    num_gpu = rng.randint(longest, 3 * longest)
    max_num_seqs = rng.randint(1, 8)
    chunked = rng.random() < 0.85 or named_free
    if chunked:
        budget = rng.randint(max_num_seqs, max(max_num_seqs, 2 * max_model_len))
    else:  # V1's SchedulerConfig requires max_num_batched_tokens >= max_model_len without chunking
        budget = max(max_num_seqs, max_model_len + rng.choice([0, rng.randint(0, max_model_len)]))
    threshold = rng.choice([0, 0, rng.randint(1, 8)])
    prefix = rng.random() < 0.5 and not named_free
    cfg = WorkloadConfig(block_size, num_gpu, max_num_seqs, budget, max_model_len, threshold, prefix, chunked,
                         watermark=rng.choice([0.0, 0.01, 0.1]))
    heads = [tuple(rng.randrange(10, 30_000) for _ in range(rng.randint(1, max_model_len - 1)))
             for _ in range(rng.randint(1, 3))]
    arrivals = sorted(rng.choice([0, 0, rng.randint(0, 15)]) for _ in range(rng.randint(1, 16)))
    requests: list[Request] = []
    for index, arrival in enumerate(arrivals):
        prompt_len = rng.randint(1, max_model_len - 1)
        if requests and rng.random() < 0.1:  # the same prompt again
            prompt = rng.choice(requests).prompt
        else:
            head = rng.choice(heads)[:prompt_len] if rng.random() < 0.6 else ()
            prompt = head + tuple(rng.randrange(10, 30_000) for _ in range(prompt_len - len(head)))
        # Up to 2 tokens past max_model_len: both cap a request when it reaches max_model_len tokens.
        max_tokens = rng.randint(1, max_model_len - len(prompt) + 2)
        stop_at = rng.randint(1, max_tokens) if rng.random() < 0.2 else None
        ignore_eos = stop_at is not None and rng.random() < 0.3
        cap = min(max_tokens, max_model_len - len(prompt))  # the output length that caps it
        if named_free and stop_at is not None and stop_at >= cap:
            stop_at = cap - 1 or None
        requests.append(Request(index, prompt, max_tokens, arrival, stop_at, ignore_eos))
    return cfg, requests


# -- the named simplifications, told by their condition ------------------------------------------
# v1_round.py's docstring names four ways in which policy="v1" decides otherwise than V1 0.9.2 on
# purpose. A random workload reaches them, so a step that mismatches is put to four classifiers
# first; each recognizes one of them by its condition, and nothing else. A step that none of them
# recognizes is a failure. After a named difference in the state (classes 2, 4, 7) the two sides
# no longer hold the same state, so that workload is compared no further; after a different
# finish reason (class 1) they do, and the comparison goes on.

EOS_LAST = "eos-on-the-last-allowed-token"
SKIPPED_REVERSED = "skipped-prompts-reversed"
SAME_STEP_HIT = "same-step-prefix-hit"
EVICTION_ORDER = "eviction-order"
NAMED = (EOS_LAST, SKIPPED_REVERSED, SAME_STEP_HIT, EVICTION_ORDER)


def eos_on_last_allowed_token(requests: dict[str, Request], ov: OracleSide, seen: dict[str, dict],
                              differs: list[str]) -> bool:
    """Class 1: all that differs after the step is the finish reason of requests that sampled EOS
    (not ignored) as the token that also capped their length (max_tokens or max_model_len): V1
    says "length", tinyserve "stop"."""
    if differs != ["finished"]:
        return False
    v1, ts = seen["V1"]["finished"], seen["tinyserve"]["finished"]
    if v1.keys() != ts.keys():
        return False
    for rid in (r for r in v1 if v1[r] != ts[r]):
        req, out = requests[rid], ov.requests[rid].num_output_tokens
        capped = out >= req.max_tokens or len(req.prompt) + out >= ov.cfg.max_model_len
        if not (v1[rid] == "length" and ts[rid] == "stop" and req.stop_at == out and not req.ignore_eos and capped):
            return False
    return True


def skipped_prompts_reversed(cfg: WorkloadConfig, before: dict[str, list[str]], seen: dict[str, dict],
                             differs: list[str]) -> bool:
    """Class 2: chunked prefill off, and all that differs after scheduling is the order of the
    head of ``waiting``: k >= 2 requests that were waiting, were not scheduled (skipped: their
    prompt did not fit the budget left), and that V1 put back in reverse order."""
    if cfg.enable_chunked_prefill or differs != ["waiting"]:
        return False
    v1, ts = seen["V1"]["waiting"], seen["tinyserve"]["waiting"]
    scheduled = dict(seen["V1"]["scheduled"])
    for k in range(2, len(ts) + 1):
        head = ts[:k]
        if (v1[:k] == head[::-1] and v1[k:] == ts[k:]
                and all(r in before["waiting"] and r not in scheduled for r in head)):
            return True
    return False


def differing_lookup(before: dict[str, list[str]], decided: dict[str, dict], ov: OracleSide,
                     ts: TinyserveSide) -> tuple[Lookup, Lookup] | None:
    """The step's first prefix-cache lookup (V1's, tinyserve's) where the two hit a different
    number of tokens for the same request, if every lookup before it agreed and the step's
    running requests, which come before any lookup, were decided alike."""
    v1, tiny = decided["V1"], decided["tinyserve"]

    def running(decision: dict) -> list[tuple[str, int]]:
        return [e for e in decision["scheduled"] if e[0] in before["running"]]

    if running(v1) != running(tiny) or v1["preempted"] != tiny["preempted"]:
        return None
    for a, b in zip(ov.lookups, ts.lookups):
        if a.request_id != b.request_id:
            return None
        if a.hit != b.hit:
            return a, b
    return None


def state(lookup: Lookup, block: int) -> tuple[str, bool]:
    if block < len(lookup.states):
        return lookup.states[block], lookup.evicted[block]
    return "absent", False


def same_step_prefix_hit(block_size: int, lookups: tuple[Lookup, Lookup] | None) -> bool:
    """Class 4: in the first lookup that differs V1 hits more, and the first block tinyserve
    misses is one that V1 named this step and tinyserve holds named but not yet computed: a
    block allocated this step for another request's tokens."""
    if lookups is None or lookups[0].hit <= lookups[1].hit:
        return False
    block = lookups[1].hit // block_size
    return state(lookups[0], block)[0] == "fresh" and state(lookups[1], block)[0] == "pending"


def eviction_order(block_size: int, lookups: tuple[Lookup, Lookup] | None) -> bool:
    """Class 7: in the first lookup that differs (either side hitting more), the first block the
    side that hits less misses is one that side evicted earlier, and the other still holds it
    computed: the two evict different blocks, so different prefixes survive."""
    if lookups is None:
        return False
    fewer, more = sorted(lookups, key=lambda lookup: lookup.hit)
    block = fewer.hit // block_size
    return state(fewer, block) in (("absent", True), ("pending", True)) and state(more, block)[0] == "cached"


@dataclass
class Outcome:
    steps: int = 0
    mismatch: str | None = None  # a difference no classifier recognized (or the end not reached)
    differs: list[str] = field(default_factory=list)  # what the mismatched step disagreed on
    stats: Counter = field(default_factory=Counter)  # what the compared steps did (V1's counts)
    named: Counter = field(default_factory=Counter)  # steps with each named difference
    stopped: str | None = None  # the named difference after which the workload was compared no further

    @property
    def matched(self) -> bool:
        """Every step alike, to the end."""
        return self.mismatch is None and not self.named


def describe(cfg: WorkloadConfig, requests: list[Request]) -> str:
    reqs = ", ".join(f"{r.request_id}(prompt {list(r.prompt)}, max_tokens={r.max_tokens}, step {r.arrival_step}"
                     + (f", EOS at {r.stop_at}{' ignored' if r.ignore_eos else ''}" if r.stop_at else "") + ")"
                     for r in requests)
    return f"{cfg}; requests {reqs}"


def compare(cfg: WorkloadConfig, requests: list[Request], classify: bool = True) -> Outcome:
    """Play one workload on both schedulers, step by step, until both are done, a named difference
    that leaves them in different states, or a mismatch (``classify=False``: every difference
    is a mismatch)."""
    ts, ov = TinyserveSide(cfg), OracleSide(cfg)
    result = Outcome()
    pending = sorted(requests, key=lambda r: r.arrival_step)  # stable: the list's order within a step
    by_id = {r.request_id: r for r in requests}

    def check(step: int, when: str, seen: dict[str, dict], named: str | None = None) -> bool:
        differs = [key for key in seen["V1"] if seen["V1"][key] != seen["tinyserve"][key]]
        if not differs:
            return True
        if named is not None:
            result.named[named] += 1
            result.stopped = None if named == EOS_LAST else named
            return named == EOS_LAST
        result.differs = differs
        diff = "; ".join(f"{key}: V1 {seen['V1'][key]!r} != tinyserve {seen['tinyserve'][key]!r}" for key in differs)
        result.mismatch = f"{describe(cfg, requests)}\n  step {step} ({when}): {diff}"
        return False

    def name(before: dict[str, list[str]], decided: dict[str, dict], seen: dict[str, dict], when: str) -> str | None:
        """The named difference this step shows, if it shows one."""
        if not classify:
            return None
        differs = [key for key in seen["V1"] if seen["V1"][key] != seen["tinyserve"][key]]
        if not differs:
            return None
        if when == "ran" and eos_on_last_allowed_token(by_id, ov, seen, differs):
            return EOS_LAST
        if when == "scheduled" and skipped_prompts_reversed(cfg, before, seen, differs):
            return SKIPPED_REVERSED
        lookups = differing_lookup(before, decided, ov, ts)
        if same_step_prefix_hit(cfg.block_size, lookups):
            return SAME_STEP_HIT
        return EVICTION_ORDER if eviction_order(cfg.block_size, lookups) else None

    for step in range(MAX_STEPS):
        while pending and pending[0].arrival_step <= step:
            req = pending.pop(0)
            ts.add(req)
            ov.add(req)
        if not (pending or ts.unfinished() or ov.unfinished()):
            result.steps = step
            check(step, "the end", {s.name: {"free_blocks": s.free_blocks()} for s in (ov, ts)})
            if not result.differs and ov.free_blocks() != cfg.num_gpu_blocks:
                result.mismatch = f"{describe(cfg, requests)}\n  blocks still held at the end: {ov.free_blocks()} free"
            return result
        before = ov.queues()
        decided = {s.name: vars(s.schedule()) for s in (ov, ts)}
        for side in (ov, ts):
            decided[side.name].update(free_blocks=side.free_blocks(), blocks=side.blocks(), **side.queues())
        if not check(step, "scheduled", decided, name(before, decided, decided, "scheduled")):
            result.steps = step
            return result
        o = decided["V1"]
        scheduled = dict(o["scheduled"])
        admitted = [r for r in scheduled if r not in before["running"]]
        req = ov.requests  # V1 advanced num_computed_tokens when it scheduled them
        result.stats.update(
            steps=1, preempted=len(o["preempted"]),
            # a running request left out for lack of budget
            left_out=sum(r not in scheduled and r not in o["preempted"] for r in before["running"]),
            waiting_left=bool(o["waiting"]) and not o["preempted"],
            chunks=sum(n > 1 for r, n in scheduled.items() if r in before["running"]),
            partial=sum(req[r].num_computed_tokens < req[r].num_tokens for r in scheduled),
            resumed=sum(req[r].num_output_tokens > 0 for r in admitted),
            prefix_hits=sum(req[r].num_computed_tokens > scheduled[r] for r in admitted),
            evictions=ov.evictions - result.stats["evictions"])
        finished = {s.name: s.play(STUB) for s in (ov, ts)}
        ran = {s.name: {"finished": finished[s.name], "computed": s.computed(), "free_blocks": s.free_blocks(),
                        **s.queues()} for s in (ov, ts)}
        if not check(step, "ran", ran, name(before, decided, ran, "ran")):
            result.steps = step
            return result
        result.stats.update(stops=sum(v == "stop" for v in finished["V1"].values()),
                            length_caps=sum(req[r].num_tokens >= cfg.max_model_len for r in finished["V1"]))
    result.mismatch = f"{describe(cfg, requests)}\n  not finished after {MAX_STEPS} steps"
    return result


def run(seed: int, named_free: bool = False) -> Outcome:
    return compare(*make_workload(seed, named_free), classify=not named_free)


def shrink(cfg: WorkloadConfig, requests: list[Request], classify: bool = True) -> tuple[WorkloadConfig, list[Request]]:
    """A smaller workload that mismatches on the same thing first, unrecognized (for the failure
    message): requests dropped, arrivals moved earlier, prompts and outputs cut, greedily."""
    first = compare(cfg, requests, classify).differs

    def fails(reqs: list[Request]) -> bool:
        return bool(reqs) and (out := compare(cfg, reqs, classify)).mismatch is not None and out.differs == first

    changed = True
    while changed:
        changed = False
        for i in range(len(requests)):
            r = requests[i]
            candidates = [None, replace(r, arrival_step=0), replace(r, arrival_step=r.arrival_step - 1),
                          replace(r, stop_at=None, ignore_eos=False), replace(r, max_tokens=r.max_tokens - 1),
                          replace(r, prompt=r.prompt[:-1]), replace(r, prompt=r.prompt[: len(r.prompt) // 2])]
            for c in candidates:
                if c is not None and (c.arrival_step < 0 or c.max_tokens < 1 or not c.prompt or c == r):
                    continue
                trial = requests[:i] + ([c] if c is not None else []) + requests[i + 1:]
                if fails(trial):
                    requests, changed = trial, True
                    break
            if changed:
                break
    return cfg, requests


# The share of the full stratum's workloads alike at every step, to the end. Observed: 628 of
# 1000, none mismatching (before FIXED's last two cases were fixed, 583 alike and 19 mismatched),
# and the rest each showing a named difference: an EOS on the capping token in 165 workloads
# (compared on), a same-step hit in 140, skipped prompts reversed in 37 and an eviction of a
# never-cached block where V1 evicts a cached one in 44 (each compared no further). In the
# named-free stratum every workload is alike.
MATCHED_SHARE = 0.55
# What the compared steps must have had (V1's counts). Not "left_out" (a running request left out
# for lack of budget): with one sample a request and no speculative decoding V1 cannot leave one
# out. Chunked prefill cuts a running prompt to the budget left, and only the request admitted
# last can have taken all of it; without chunked prefill every running request was admitted with a
# whole chunk, and none brings more later.
COVERED = ("preempted", "waiting_left", "chunks", "partial", "resumed", "stops", "length_caps")


def summarize(outcomes: dict[int, Outcome]) -> tuple[str, dict[int, Outcome], int, Counter, Counter]:
    mismatched = {seed: o for seed, o in outcomes.items() if o.mismatch}
    matched = sum(o.matched for o in outcomes.values())
    stats = sum((o.stats for o in outcomes.values() if not o.mismatch), Counter())
    named = sum((o.named for o in outcomes.values()), Counter())
    workloads = Counter(what for o in outcomes.values() for what in o.named)
    stopped = Counter(o.stopped for o in outcomes.values() if o.stopped)
    kinds = Counter(tuple(o.differs) or ("not finished",) for o in mismatched.values())
    summary = (f"{matched} of {len(outcomes)} workloads alike at every step; named differences: steps "
               f"{dict(named)}, workloads {dict(workloads)}, workloads compared no further after one "
               f"{dict(stopped)}; {len(mismatched)} mismatched otherwise ({dict(kinds) or 'none'}); "
               f"compared steps: {dict(stats)}")
    return summary, mismatched, matched, stats, named


def fail_on(summary: str, mismatched: dict[int, Outcome], named_free: bool = False) -> None:
    if mismatched:
        seed = min(mismatched)
        cfg, requests = shrink(*make_workload(seed, named_free), classify=not named_free)
        small = compare(cfg, requests, classify=not named_free)
        pytest.fail(f"{summary}\nfirst: seed {seed}: {mismatched[seed].mismatch}\nshrunk: {small.mismatch}",
                    pytrace=False)


def test_v1_policy_decides_as_vllm_v1_does_step_by_step():
    summary, mismatched, matched, stats, named = summarize({seed: run(seed) for seed in SEEDS})
    print(summary)
    fail_on(summary, mismatched)
    assert matched >= MATCHED_SHARE * len(SEEDS), summary
    for what in NAMED:  # every classifier recognized something: none is dead code
        assert named[what] > 0, f"no workload showed {what}: {summary}"
    # The workloads reach every rule being compared: otherwise agreement would say little.
    for what in (*COVERED, "prefix_hits", "evictions"):
        assert stats[what] > 0, f"no compared step had any {what}: {summary}"


def test_v1_policy_decides_as_vllm_v1_does_where_no_named_difference_can_occur():
    # No classifier: every step of every workload must be alike.
    summary, mismatched, matched, stats, _ = summarize({seed: run(seed, named_free=True) for seed in SEEDS})
    print(summary)
    fail_on(summary, mismatched, named_free=True)
    assert matched == len(SEEDS), summary
    for what in COVERED:
        assert stats[what] > 0, f"no compared step had any {what}: {summary}"


# -- the comparison can fail --------------------------------------------------------------------


def test_the_comparison_notices_a_threshold_ignored(monkeypatch):
    # tinyserve's v1 chunk without long_prefill_token_threshold: some workload must then differ.
    from tinyserve.v1_round import V1RoundMixin

    chunk = V1RoundMixin._v1_chunk

    def no_threshold(self, seq, computed, budget):
        cfg = self.scheduler_config
        saved, cfg.long_prefill_token_threshold = cfg.long_prefill_token_threshold, 0
        try:
            return chunk(self, seq, computed, budget)
        finally:
            cfg.long_prefill_token_threshold = saved

    monkeypatch.setattr(V1RoundMixin, "_v1_chunk", no_threshold)
    found = next((o for o in map(run, SEEDS) if o.mismatch and "scheduled" in o.differs), None)
    assert found is not None, "no workload noticed long_prefill_token_threshold"


def _hits_a_block_short(monkeypatch):
    from tinyserve.prefix_cache import PrefixCachingBlockSpaceManager

    num_cached_tokens = PrefixCachingBlockSpaceManager.num_cached_tokens
    monkeypatch.setattr(PrefixCachingBlockSpaceManager, "num_cached_tokens",
                        lambda self, seq: max(0, num_cached_tokens(self, seq) - self.block_size))


def _forgets_freed_blocks(monkeypatch):
    from tinyserve.prefix_cache import CachedBlockAllocator

    free = CachedBlockAllocator.free

    def forgetful(self, block):  # a freed block loses its name at once, not when evicted
        free(self, block)
        if self.evictor.pop(block.block_number, None) is not None:
            self.forget(block)
            self.free_blocks.append(block)

    monkeypatch.setattr(CachedBlockAllocator, "free", forgetful)


@pytest.mark.parametrize("mutate", [_hits_a_block_short, _forgets_freed_blocks])
def test_the_classifiers_do_not_hide_a_prefix_cache_bug(monkeypatch, mutate):
    # A prefix cache that misses where it should hit: some workload that agrees as it is must then
    # mismatch, unrecognized (not taken for a same-step hit or an eviction).
    def broken(seed: int) -> bool:
        with monkeypatch.context() as m:
            mutate(m)
            return run(seed).mismatch is not None

    assert any(broken(seed) and run(seed).mismatch is None for seed in SEEDS)


def test_the_oracle_gives_v1_one_block_more_for_its_null_block():
    cfg = WorkloadConfig(block_size=4, num_gpu_blocks=5, max_num_seqs=2, max_num_batched_tokens=16, max_model_len=16)
    ov = OracleSide(cfg)
    pool = ov.sched.kv_cache_manager.block_pool
    assert pool.num_gpu_blocks == 6 and pool.null_block.block_id == 0 and ov.free_blocks() == 5


def test_install_hint_names_the_target():
    assert "make v1-oracle" in INSTALL_HINT


# -- each difference found, on the smallest workload found for it --------------------------------

P = tuple(range(1000, 1016))  # a prompt of 16 tokens; its heads are shared below

# Fixed in tinyserve: these must now agree at every step.
FIXED = [
    ("resumed-cut-without-chunking",
     "chunked prefill off: tinyserve cut a request preempted after it sampled to the budget left; "
     "V1 skips it (it never cuts without chunked prefill but for the threshold) and admits the next",
     WorkloadConfig(8, 4, 3, 20, 20, enable_chunked_prefill=False),
     [Request(1, (19492,), 3), Request(5, (3323,), 4), Request(6, (18879,), 5), Request(8, (1583,), 1),
      Request(9, (1583, 25438, 14207, 26109, 5521), 7), Request(11, tuple(range(2000, 2011)), 7),
      Request(12, (15412,), 4), Request(14, (3323,), 1)]),
    ("full-block-shared-by-name",
     "two equal prompts of one full block in one step: no hit (the last token is computed), yet tinyserve's "
     "grow shared the first one's block by name; V1 gives each its own block (duplicates are kept)",
     WorkloadConfig(2, 4, 2, 8, 8, enable_prefix_caching=True),
     [Request(0, P[:2], 1), Request(1, P[:2], 1)]),
    ("partial-block-shared-by-name",
     "a block allocated for 5 of its 16 tokens was named by all 16 prompt tokens in tinyserve, and a second "
     "request with that prompt was admitted onto it with no free block; V1 names blocks only once full of "
     "scheduled tokens, so it waits for a free block",
     WorkloadConfig(16, 2, 4, 16, 20, long_prefill_token_threshold=5, enable_prefix_caching=True),
     [Request(0, P, 1), Request(1, (7,), 2), Request(2, P, 1)]),
    ("decode-filled-block-named-late",
     "r001's decode step fills its first block (token 4 of 4); V1 names the block when it allocates the slot "
     "for that token, tinyserve's append_slot named it only when it appended the next token's slot. r001 is "
     "preempted before that, so its block was freed unnamed and its resume hit nothing in tinyserve, 4 tokens "
     "in V1",
     WorkloadConfig(4, 2, 2, 8, 8, enable_prefix_caching=True), [Request(0, (10,), 3), Request(1, P[:3], 3)]),
    ("freed-head-block-evicted-first",
     "a finished request's blocks went to tinyserve's evictor head block first, so the head was evicted first "
     "and the whole cached prefix lost; V1 frees a request's blocks tail first (as tinyserve now does)",
     WorkloadConfig(2, 4, 2, 8, 8, enable_prefix_caching=True),
     [Request(0, P[:4], 1), Request(1, P[8:14], 1, arrival_step=1), Request(2, P[:5], 1, arrival_step=2)]),
]


@pytest.mark.parametrize(("cfg", "requests"), [
    pytest.param(cfg, requests, id=name) for name, _, cfg, requests in FIXED])
def test_fixed_divergence_stays_fixed(cfg, requests):
    out = compare(cfg, requests, classify=False)
    assert out.matched, out.mismatch


# Named simplifications (v1_round.py's docstring): each differs, and its classifier says so.
NAMED_CASES = [
    (EOS_LAST, "EOS sampled as the max_tokens-th token: V1's check_stop checks the length cap first "
     "(finish_reason 'length'), tinyserve's the stop first ('stop')",
     WorkloadConfig(16, 2, 1, 16, 24), [Request(0, (10,), max_tokens=1, stop_at=1)]),
    (SKIPPED_REVERSED, "chunked prefill off, two prompts over the budget left: V1 puts them back in reverse order",
     WorkloadConfig(16, 3, 4, 16, 16, enable_chunked_prefill=False),
     [Request(0, P[:10], 1), Request(1, P[:8], 1), Request(2, P[8:], 1)]),
    (SAME_STEP_HIT, "V1 names a full block when it allocates it for scheduled tokens (allocate_slots -> "
     "cache_blocks), so a request admitted later in the same step hits it; tinyserve hits only blocks computed "
     "in an earlier step",
     WorkloadConfig(8, 21, 7, 72, 56, enable_prefix_caching=True), [Request(0, P[:8], 1), Request(1, P[:9], 1)]),
]


@pytest.mark.parametrize(("named", "cfg", "requests"), [
    pytest.param(named, cfg, requests, id=named) for named, _, cfg, requests in NAMED_CASES])
def test_named_difference_is_told_by_its_classifier(named, cfg, requests):
    assert compare(cfg, requests, classify=False).mismatch is not None  # it does differ
    out = compare(cfg, requests)
    assert out.mismatch is None and set(out.named) == {named}, (out.mismatch, out.named)


def test_v1_never_finishes_a_prompt_of_max_model_len_tokens_in_chunks():
    # Why the workloads keep prompts below max_model_len: V1 caps a running request's chunk at
    # max_model_len - 1 - num_computed_tokens (meant for speculative decoding), so the last token
    # of such a prompt is never scheduled and it never samples. tinyserve finishes it.
    cfg = WorkloadConfig(4, 4, 2, 4, 8)
    ov = OracleSide(cfg)
    ov.add(Request(0, P[:8], 4))
    steps = []
    for _ in range(4):
        steps.append(ov.schedule().scheduled)
        ov.play(STUB)
    assert steps == [[("r000", 4)], [("r000", 3)], [], []] and ov.unfinished()
