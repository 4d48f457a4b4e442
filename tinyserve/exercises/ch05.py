"""Checkers for chapter 05: the vLLM scheduler, preemption and the swapped queue.

``check_scheduler_round`` grades the chapter's main exercise, the reader's vLLM round (a Scheduler
subclass with ``_schedule_vllm`` and its three phases), round by round against the package's
Scheduler on s0/s1/s2, the A–E workload, random workloads on tiny caches, the hooks and the Orca
round, and names the first round and fact that differ and the method that makes the difference.
``check_admission`` and ``check_preempted`` compare the reader's prediction with the real
Scheduler in the same situation. ``check_victim_policy`` and ``check_cautious_swap_in`` grade
components the reader writes for the real scheduler: a victim policy
(``Scheduler(choose_victim=...)``) and a block manager whose ``can_swap_in`` keeps headroom
(``Scheduler(block_manager=...)``). Each is checked rule by rule on random states against a
version of the rule kept here, then round by round on s0/s1/s2 and random workloads against the
same scheduler running that version.
"""

from __future__ import annotations

import contextlib
import random
import signal
import threading
from collections.abc import Callable

from tinyserve import presets
from tinyserve.block import Device
from tinyserve.block_manager import BlockSpaceManager
from tinyserve.config import CacheConfig, SchedulerConfig
from tinyserve.exercises.ch03 import answer_name
from tinyserve.exercises.sched_runs import (
    SimWorkload,
    check_runs,
    round_run_difference,
    run_with_manager,
    scheduler_run,
    seed_workloads,
)
from tinyserve.exercises.verdict import checker, run_cases, verdict
from tinyserve.scheduler import Scheduler
from tinyserve.sequence import SamplingParams, Sequence, SequenceGroup, SequenceStatus
from tinyserve.sim import Request, make_record, simulate


def _request_group(request_id: str, seq_id: int, prompt_len: int, block_size: int,
                   num_outputs: int = 0) -> SequenceGroup:
    seq = Sequence(seq_id, None, list(range(1000, 1000 + prompt_len)), block_size)
    for t in range(num_outputs):
        seq.append_token_id(t)
    return SequenceGroup(request_id, [seq], SamplingParams(max_tokens=64), arrival_time=float(seq_id))


def _describe_case(case: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in case.items())


# -- predictions ------------------------------------------------------------------------------------

def _admitted(case: dict) -> list[str]:
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=case["token_budget"], max_num_seqs=case["max_num_seqs"],
                                      max_model_len=case["token_budget"]),
                      CacheConfig(block_size=case["block_size"], num_gpu_blocks=case["num_free_blocks"],
                                  num_cpu_blocks=0, watermark=0.0))
    for i, (rid, n) in enumerate(case["waiting"]):
        sched.add_seq_group(_request_group(rid, i, n, case["block_size"]))
    _, out = sched.schedule()
    return [s.seq_group.request_id for s in out.scheduled_seq_groups]


def _prompt_len(rng: random.Random, budget: int, free: int, block_size: int, never: bool) -> int:
    """A prompt that fits the budget and the cache on its own, or, if ``never``, one that can never
    run: longer than the budget, or with more blocks than the whole cache (or both)."""
    longest = min(budget, free * block_size)
    if not never:
        return rng.randint(1, longest)
    kinds = ["too long"] + (["too big"] if free * block_size < budget else [])
    if rng.choice(kinds) == "too long":
        return budget + rng.randint(1, 12)
    return rng.randint(free * block_size + 1, budget)  # within the budget, more blocks than the cache


@checker(chapter=5, answer="admission")
def check_admission(fn: Callable[..., list[str]], num_cases: int = 60, seed: int = 3) -> bool:
    """``fn(waiting, token_budget, max_num_seqs, num_free_blocks, block_size)`` returns the ids
    the vLLM policy admits into a prefill round, in order. ``waiting`` is a list of
    (request id, prompt length), front of the queue first; nothing is running, the watermark is
    0, and ``max_model_len`` is the token budget. A prompt that can never run (longer than the
    budget, or needing more blocks than the whole cache) is ignored (section 5.6) and does not
    hold up the prompts behind it. Many cases put one or two such prompts in the queue, ahead
    of others that fit."""
    rng = random.Random(seed)
    cases = [{"waiting": [("a", 30), ("b", 3)], "token_budget": 10, "max_num_seqs": 4, "num_free_blocks": 4,
              "block_size": 5}]
    while len(cases) < num_cases:
        block_size = rng.choice([2, 4, 8])
        budget = rng.randint(8, 40)
        free = rng.randint(2, 10)
        size = rng.randint(1, 6)
        never = {rng.randrange(size)} if size > 1 and len(cases) % 2 else set()
        if never and rng.random() < 0.3:
            never.add(rng.randrange(size))
        waiting = [(f"r{i}", _prompt_len(rng, budget, free, block_size, i in never)) for i in range(size)]
        cases.append({"waiting": waiting, "token_budget": budget, "max_num_seqs": rng.randint(1, 5),
                      "num_free_blocks": free, "block_size": block_size})
    return run_cases(answer_name(fn, "admission"),
                     lambda c: list(fn(list(c["waiting"]), c["token_budget"], c["max_num_seqs"],
                                       c["num_free_blocks"], c["block_size"])),
                     [((case,), _admitted(case)) for case in cases], describe=lambda args: _describe_case(args[0]))


def _preempted(case: dict) -> list[str]:
    """A real decode round: each request holds one block of 4 slots; a prompt of 4 tokens fills
    it, so after its first token it needs a second block, a prompt of 3 does not."""
    running, needs, free = case["running"], case["needs_block"], case["num_free_blocks"]
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=16, max_model_len=256,
                                      preemption_mode="recompute"),
                      CacheConfig(block_size=4, num_gpu_blocks=len(running) + free, num_cpu_blocks=0, watermark=0.0))
    for i, rid in enumerate(running):
        sched.add_seq_group(_request_group(rid, i, 4 if needs[rid] else 3, 4))
    _, prefill = sched.schedule()
    sched.postprocess(prefill, lambda group, seq: 7)
    _, out = sched.schedule()
    return list(out.preempted)


@checker(chapter=5, answer="preempted")
def check_preempted(fn: Callable[[list[str], dict[str, bool], int], list[str]], num_cases: int = 40,
                    seed: int = 4) -> bool:
    """``fn(running, needs_block, num_free_blocks)`` returns the ids preempted, in order, in a
    decode round under the package's victim policy. ``running`` is oldest first;
    ``needs_block[id]`` says whether that request needs a new block for its next token; each
    running request holds exactly one block, which is freed if it is preempted (recompute)."""
    rng = random.Random(seed)
    cases = []
    for _ in range(num_cases):
        running = [f"r{i}" for i in range(rng.randint(1, 6))]
        case = {"running": running, "needs_block": {rid: rng.random() < 0.6 for rid in running},
                "num_free_blocks": rng.randint(0, 2)}
        cases.append(((case,), _preempted(case)))
    return run_cases(answer_name(fn, "preempted"),
                     lambda c: list(fn(list(c["running"]), dict(c["needs_block"]), c["num_free_blocks"])),
                     cases, describe=lambda args: _describe_case(args[0]))


# -- a victim policy ------------------------------------------------------------------------------

def _num_tokens(group: SequenceGroup) -> int:
    return sum(seq.get_len() for seq in group.get_seqs(SequenceStatus.RUNNING))


def _most_tokens(running: list[SequenceGroup]) -> SequenceGroup:
    """The rule: the most tokens; among equals, the one furthest back in the list (the newest)."""
    best = running[0]
    for group in running[1:]:
        if _num_tokens(group) >= _num_tokens(best):
            best = group
    return best


def _victim_lists(num_cases: int, seed: int) -> list[list[SequenceGroup]]:
    rng = random.Random(seed)
    lists = []
    for _ in range(num_cases):
        groups = []
        for i in range(rng.randint(1, 6)):
            group = _request_group(f"r{i}", i, rng.randint(1, 8), 4, num_outputs=rng.randint(0, 6))
            for seq in group.get_seqs():
                seq.status = SequenceStatus.RUNNING
            groups.append(group)
        lists.append(groups)
    return lists


def victim_workloads() -> list[SimWorkload]:
    runs = seed_workloads()
    rng = random.Random(11)
    for i, mode in enumerate(("swap", "recompute")):
        requests = [Request(f"r{j}", rng.randint(1, 8), rng.randint(2, 12), rng.randint(1, 4)) for j in range(7)]
        runs.append((f"random workload {i}, preemption_mode={mode!r}", requests,
                     SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=6, max_model_len=20,
                                     preemption_mode=mode),
                     CacheConfig(block_size=2, num_gpu_blocks=10, num_cpu_blocks=16, watermark=0.0)))
    return runs


@checker(chapter=5, answer="most_tokens_victim")
def check_victim_policy(fn: Callable[[list[SequenceGroup]], SequenceGroup], num_cases: int = 100,
                        seed: int = 0) -> bool:
    """``fn(running)`` for ``Scheduler(choose_victim=...)``: ``running`` lists the running groups
    that still wait for their slot this round (oldest first, starting with the one that needs a
    block); return the group whose running sequences hold the most tokens together (so freeing
    it frees the most blocks), the newest of equals. Graded on random lists, then inside the
    real scheduler on s0/s1/s2 and random workloads."""
    lists = _victim_lists(num_cases, seed)
    cases = [((groups,), _most_tokens(groups).request_id) for groups in lists]
    name = answer_name(fn, "most_tokens_victim")
    rule_ok = run_cases(name, lambda groups: fn(list(groups)).request_id, cases,
                        describe=lambda args: "running " + ", ".join(f"{g.request_id}({_num_tokens(g)} tokens)"
                                                                     for g in args[0]))
    engine_ok = check_runs(f"{name} in the scheduler", victim_workloads(),
                           lambda *w: scheduler_run(*w, choose_victim=fn),
                           lambda *w: scheduler_run(*w, choose_victim=_most_tokens))
    return rule_ok and engine_ok


# -- a cautious swap-in ---------------------------------------------------------------------------------

class _CautiousModel(BlockSpaceManager):
    """The rule: the package's test, plus one free block for every sequence already on the GPU."""

    def can_swap_in(self, seq_group: SequenceGroup) -> bool:
        swapped = seq_group.get_seqs(SequenceStatus.SWAPPED)
        cpu_blocks = {b.block_number for seq in swapped for b in self.block_tables[seq.seq_id]}
        on_gpu = sum(1 for seq_id, table in self.block_tables.items() if table and table[0].device == Device.GPU)
        needed = len(cpu_blocks) + len(swapped) + on_gpu
        return self.get_num_free_gpu_blocks() - needed >= self._reserve()


def _swap_state(cls: type, rng: random.Random) -> tuple[BlockSpaceManager, SequenceGroup]:
    """A manager of class ``cls`` with a group (one or two samples) swapped out, and the GPU
    holding a few running sequences, its free blocks near the margin."""
    bs = rng.choice([2, 4])
    total = rng.randint(8, 40)
    bm = cls(bs, total, 64, rng.choice([0.0, 0.0, 0.1]))
    group = SequenceGroup("g", [Sequence(0, None, list(range(rng.randint(1, 3 * bs))), bs)],
                          SamplingParams(n=2, temperature=1.0), 0.0)
    bm.allocate(group)
    parent = group.get_seqs()[0]
    parent.status = SequenceStatus.RUNNING
    if rng.random() < 0.5:
        child = parent.fork(1)
        group.add(child)
        bm.fork(parent, child)
    bm.swap_out(group)
    for seq in group.get_seqs():
        seq.status = SequenceStatus.SWAPPED
    neighbours = rng.randint(0, 3)
    for i in range(neighbours):  # running neighbours, one sequence each
        if bm.get_num_free_gpu_blocks() > 2:
            bm.allocate(_request_group(f"n{i}", 10 + i, rng.randint(1, 2 * bs), bs))
    # Leave about what the rule needs free, where the package's test and this one part: the
    # group's blocks, one per returning sequence, the reserve, and one per sequence on the GPU
    # (counting the filler that takes up the rest).
    on_gpu = sum(1 for t in bm.block_tables.values() if t and t[0].device == Device.GPU) + 1
    blocks = len({b.block_number for seq in group.get_seqs() for b in bm.block_tables[seq.seq_id]})
    target = blocks + group.num_seqs() + bm.watermark_blocks + rng.randint(-1, on_gpu + 1)
    if bm.get_num_free_gpu_blocks() > target:
        bm.allocate(_request_group("filler", 50, (bm.get_num_free_gpu_blocks() - target) * bs, bs))
    return bm, group


def swap_in_workloads() -> list[SimWorkload]:
    seed = presets.seed_rounds("swap")
    runs = [("s0/s1/s2, preemption_mode='swap'", seed.requests, seed.scheduler_config, seed.cache_config)]
    rng = random.Random(5)
    for i in range(3):
        requests = [Request(f"r{j}", rng.randint(1, 8), rng.randint(2, 12), rng.randint(1, 4)) for j in range(7)]
        runs.append((f"random workload {i}, preemption_mode='swap'", requests,
                     SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=6, max_model_len=20,
                                     preemption_mode="swap"),
                     CacheConfig(block_size=2, num_gpu_blocks=10, num_cpu_blocks=24, watermark=0.0)))
    return runs


@checker(chapter=5, answer="CautiousSwapManager")
def check_cautious_swap_in(cls: type, num_cases: int = 150, seed: int = 0) -> bool:
    """``cls``: a BlockSpaceManager subclass whose ``can_swap_in(group)`` lets a swapped group
    back only if the GPU then still has one free block for every sequence already running there
    (so the next decode round cannot preempt anyone at once), on top of the package's own test
    (the group's blocks plus one per returning sequence, keeping the manager's reserve, its
    ``_reserve()``). Graded on random states, then as the scheduler's block manager on s0/s1/s2
    and random workloads that swap."""
    rng = random.Random(seed)
    seeds = [rng.randrange(1 << 30) for _ in range(num_cases)]
    cases = [((s,), _CautiousModel.can_swap_in(*_swap_state(_CautiousModel, random.Random(s)))) for s in seeds]

    def decide(state_seed: int) -> bool:
        bm, group = _swap_state(cls, random.Random(state_seed))
        return bm.can_swap_in(group)

    def describe(args: tuple) -> str:
        bm, group = _swap_state(_CautiousModel, random.Random(args[0]))
        on_gpu = sum(1 for t in bm.block_tables.values() if t and t[0].device == Device.GPU)
        blocks = {b.block_number for s in group.get_seqs() for b in bm.block_tables[s.seq_id]}
        return (f"a group of {group.num_seqs(SequenceStatus.SWAPPED)} sequences on {len(blocks)} CPU blocks, "
                f"{on_gpu} sequences on the GPU, {bm.get_num_free_gpu_blocks()} of {bm.num_total_gpu_blocks} "
                f"GPU blocks free, watermark {bm.watermark_blocks} blocks")

    name = answer_name(cls, "CautiousSwapManager")
    rule_ok = run_cases(f"{name}.can_swap_in", decide, cases, describe=describe,
                        same=lambda got, want: isinstance(got, bool) and got == want)
    engine_ok = check_runs(f"{name} in the scheduler", swap_in_workloads(),
                           lambda *w: run_with_manager(cls, *w), lambda *w: run_with_manager(_CautiousModel, *w))
    return rule_ok and engine_ok


# -- the vLLM round -------------------------------------------------------------------------------

ROUND_METHODS = ("_schedule_vllm", "_admit_waiting", "_decode_running", "_swap_in_swapped")


def _fewest_running(group: SequenceGroup, budget, block_manager) -> bool:
    """An admission rule for the hook run: at most two groups at a time (chapter 04's seam)."""
    return budget.num_curr_seqs < 2


def round_workloads() -> list[tuple[str, list[Request], SchedulerConfig, CacheConfig, dict]]:
    """The runs ``check_scheduler_round`` compares, each with the Scheduler's hooks it sets:
    s0/s1/s2 under both preemption modes and vLLM's rule, the A–E workload (roomy, then on a
    cache that makes it preempt), random workloads on tiny caches (prompts that can never run,
    swap space that fills up, arrivals over time), a victim policy and an admission rule through
    the hooks, and the Orca round (the package's ``_schedule_mixed``) calling the reader's phases."""
    runs = []
    for mode in ("swap", "recompute", None):
        seed = presets.seed_rounds(mode)
        runs.append((f"s0/s1/s2, preemption_mode={mode!r}", seed.requests, seed.scheduler_config,
                     seed.cache_config, {}))
    ae = presets.orca_example("vllm")
    runs.append(("A-E, policy='vllm'", ae.requests, ae.scheduler_config, ae.cache_config, {}))
    for mode in ("swap", "recompute"):
        runs.append((f"A-E on 7 GPU blocks of 4, preemption_mode={mode!r}", ae.requests,
                     SchedulerConfig(max_num_batched_tokens=12, max_num_seqs=4, max_model_len=28, preemption_mode=mode),
                     CacheConfig(block_size=4, num_gpu_blocks=7, num_cpu_blocks=3, watermark=0.0), {}))
    rng = random.Random(7)
    for i in range(24):
        mode = ("swap", "recompute")[i % 2]
        budget, block_size, gpu = rng.randint(8, 16), rng.choice([2, 4]), rng.randint(4, 10)
        cpu = rng.choice([0, 2, 4, 16])  # a small swap space fills up: single sequences are recomputed instead
        limit = min(budget, gpu * block_size)
        requests = []
        for j in range(rng.randint(3, 8)):
            never = rng.random() < 0.15
            prompt = rng.randint(limit + 1, limit + 6) if never else rng.randint(1, max(1, limit - 2))
            requests.append(Request(f"r{j}", prompt, rng.randint(1, 10), rng.randint(1, 4)))
        runs.append((f"random workload {i} ({len(requests)} requests, {gpu} GPU and {cpu} CPU blocks of {block_size}, "
                     f"budget {budget}, preemption_mode={mode!r})", requests,
                     SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=rng.randint(2, 5),
                                     max_model_len=gpu * block_size, preemption_mode=mode),
                     CacheConfig(block_size=block_size, num_gpu_blocks=gpu, num_cpu_blocks=cpu,
                                 watermark=rng.choice([0.0, 0.0, 0.2])), {}))
    # Older requests bring longer prompts, so the group with the most tokens is rarely the newest.
    hooked = [Request(f"r{j}", 8 - j, 10, 1 + j // 3) for j in range(7)]
    sc = SchedulerConfig(max_num_batched_tokens=12, max_num_seqs=6, max_model_len=16, preemption_mode="swap")
    cc = CacheConfig(block_size=2, num_gpu_blocks=8, num_cpu_blocks=16, watermark=0.0)
    runs.append(("7 requests, choose_victim=the most tokens (exercise 4's policy)", hooked, sc, cc,
                 {"choose_victim": _most_tokens}))
    runs.append(("7 requests, can_admit=at most two groups running", hooked, sc, cc, {"can_admit": _fewest_running}))
    # A refill longer than what the decodes leave of the budget is prefilled in pieces over rounds,
    # and the package's mixed round hands the pieces to _decode_running.
    for i, mode in enumerate(("recompute", "recompute", "swap")):
        requests = [Request(f"r{j}", rng.randint(3, 8), rng.randint(4, 10), rng.randint(1, 3)) for j in range(7)]
        runs.append((f"policy='orca' (the package's Orca round calling your phases) {i}, preemption_mode={mode!r}",
                     requests, SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=5, max_model_len=16,
                                               policy="orca", preemption_mode=mode),
                     CacheConfig(block_size=2, num_gpu_blocks=12, num_cpu_blocks=8, watermark=0.0), {}))
    return runs


def _round_records(cls: type, requests: list[Request], sc: SchedulerConfig, cc: CacheConfig, hooks: dict,
            max_rounds: int) -> tuple[list, str | None]:
    """The simulator's rounds on ``cls(sc, cc, **hooks)``, kept as they happen, so that a run that
    raises (or never ends) still shows the rounds before it, with the error."""
    records = []
    try:
        with _time_limit(RUN_SECONDS):
            _simulate_recorded(cls, requests, sc, cc, hooks, max_rounds, records)
    except Exception as e:  # the reader's code
        return records, _error(cls, e)
    return records, None


RUN_SECONDS = 2.0  # one run takes milliseconds; a loop in a phase that never ends takes forever


class RunTooLong(Exception):
    """A run of the reader's round that went past ``RUN_SECONDS``."""


@contextlib.contextmanager
def _time_limit(seconds: float):
    """Raise RunTooLong in the block after ``seconds`` (where the platform allows: the main thread
    on POSIX, as in a notebook; elsewhere the block runs unlimited)."""
    if not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise RunTooLong(f"the run took more than {seconds:g} s (a loop that never ends?)")

    previous = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _simulate_recorded(cls, requests, sc, cc, hooks, max_rounds, records: list) -> None:
    """Run the simulator on ``cls(sc, cc, **hooks)``, appending each round's record to ``records``."""
    scheduler = cls(sc, cc, **hooks)
    postprocess = scheduler.postprocess

    def recording(out, next_token):  # simulate calls it once a round, right after schedule()
        finished = postprocess(out, next_token)
        records.append(make_record(len(records) + 1, scheduler, out, finished))
        return finished

    scheduler.postprocess = recording
    simulate(requests, sc, cc, max_rounds=max_rounds, scheduler=scheduler)


def _error(cls: type, e: Exception) -> str:
    """The error, and the innermost of the reader's methods it came from ("not written yet" for a
    skeleton's NotImplementedError)."""
    mine = {f.__code__ for k in cls.__mro__ if k is not Scheduler and issubclass(k, Scheduler)
            for f in vars(k).values() if hasattr(f, "__code__")}
    frames = [tb.tb_frame.f_code for tb in _tracebacks(e.__traceback__) if tb.tb_frame.f_code in mine]
    where = f" in your {frames[-1].co_name}" if frames else ""
    if isinstance(e, NotImplementedError):
        return f"NotImplementedError{where} (not written yet)"
    return f"{type(e).__name__}{where}: {e}"


def _tracebacks(tb):
    while tb is not None:
        yield tb
        tb = tb.tb_next


def _with_only(cls: type, method: str, methods: tuple[str, ...] = ROUND_METHODS) -> type:
    """``cls`` with the package's versions of every round method (of ``methods``) but ``method``."""
    return type(f"only_your_{method}", (cls,), {m: getattr(Scheduler, m) for m in methods if m != method})


def _culprits(cls: type, workload, expected: list, methods: tuple[str, ...] = ROUND_METHODS) -> list[str]:
    """The methods of ``cls`` (among ``methods``, the vLLM round's by default) that, alone among
    the package's others, already depart from it."""
    _, requests, sc, cc, hooks = workload
    found = []
    for method in methods:
        if getattr(cls, method) is getattr(Scheduler, method):
            continue
        mine, error = _round_records(_with_only(cls, method, methods), requests, sc, cc, hooks,
                                     4 * len(expected) + 20)
        if round_run_difference(mine, error, expected) is not None:
            found.append(method)
    return found


@checker(chapter=5, answer="VllmRound")
def check_scheduler_round(cls: type) -> bool:
    """``cls``: a subclass of tinyserve.scheduler.Scheduler whose ``_schedule_vllm``,
    ``_admit_waiting``, ``_decode_running`` and ``_swap_in_swapped`` make the vLLM policy's round
    (``_schedule_mixed`` is chapter 04's and stays the package's). Run through the simulator
    beside the package's Scheduler on every workload of ``round_workloads``, it must decide every
    round alike: batch, pieces, preemptions, swaps, refusals, queues and block tables. A failure
    names the workload, the first round and fact that differ and, where one method alone makes
    the difference (run with the package's other three), that method."""
    name = answer_name(cls, "VllmRound")
    if not (isinstance(cls, type) and issubclass(cls, Scheduler)):
        print(f"✗ {name} must be a class that subclasses tinyserve.scheduler.Scheduler, got {cls!r}")
        return False
    if cls._schedule_mixed is not Scheduler._schedule_mixed:
        print(f"✗ {name} overrides _schedule_mixed: that is chapter 04's round (orca_round); leave it to the package")
        return False
    workloads = round_workloads()
    return verdict(name, round_failures(cls, workloads, _culprits), len(workloads))


def round_failures(cls: type, workloads: list, culprits: Callable[[type, tuple, list], list[str]]) -> list[str]:
    """Run every workload (label, requests, configs, hooks) through ``cls`` and the package's
    Scheduler; one line per workload whose rounds differ, naming the first difference and the
    methods ``culprits(cls, workload, expected)`` finds alone to blame. A run that never ends
    stops the others (they would wait as long). Chapter 13's v1 round is graded the same way."""
    failures = []
    for workload in workloads:
        want = _round_records(Scheduler, *workload[1:], 10_000)[0]
        mine, error = _round_records(cls, *workload[1:], 4 * len(want) + 20)
        problem = round_run_difference(mine, error, want)
        if problem is None:
            continue
        stuck = bool(error) and error.startswith("RunTooLong")
        parts = [] if error and error.startswith(("NotImplementedError", "RunTooLong")) else \
            culprits(cls, workload, want)
        where = (f"; with the package's other methods, your {' and your '.join(parts)} alone already "
                 f"differ{'s' if len(parts) == 1 else ''}") if parts else ""
        if stuck:  # every other run would wait as long: one is enough to see it
            where += " (the other workloads were not run)"
        failures.append(f"{workload[0]}: {problem}{where}")
        if stuck:
            break
    return failures
