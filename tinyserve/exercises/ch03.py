"""Checkers for chapter 03: the BlockSpaceManager.

``check_block_manager`` grades the chapter's core component: a BlockSpaceManager subclass that
writes ``can_allocate``, ``allocate``, ``can_append_slot``, ``append_slot`` (copy-on-write
included), ``fork`` and ``free``. It drives the reader's manager and the package's side by side
with the same random stream of operations, as a scheduler would issue them (admissions, forks
into several samples, decode rounds whose preemptions recompute or swap, finished samples, swaps
back in) on tiny caches with and without a watermark, and names the first call whose return
value, block tables, ref counts or free counts differ, with the state before it; then it runs
the reader's manager as the real scheduler's (``Scheduler(block_manager=...)``) on s0/s1/s2 and
random workloads, block tables included. ``check_group_blocks`` compares with the real
manager's bookkeeping.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from tinyserve.block import Device
from tinyserve.block_manager import AllocStatus, BlockSpaceManager
from tinyserve.config import CacheConfig, SchedulerConfig
from tinyserve.exercises.sched_runs import SimWorkload, check_runs, run_with_manager, seed_workloads
from tinyserve.exercises.verdict import checker, run_cases, verdict
from tinyserve.sequence import SamplingParams, Sequence, SequenceGroup, SequenceStatus
from tinyserve.sim import Request


def _call_raised(e: Exception) -> str:
    return f"raised {type(e).__name__}" + (f": {e}" if str(e) else "")


def _sampled_group(request_id: str, prompt_len: int, block_size: int, n: int = 1, seq_id: int = 0) -> SequenceGroup:
    params = SamplingParams(n=n, temperature=1.0 if n > 1 else 0.0)
    return SequenceGroup(request_id, [Sequence(seq_id, None, list(range(prompt_len)), block_size)], params, 0.0)


# -- copy-on-write, counted --------------------------------------------------------------------------

def _blocks_held(prompt_len: int, n: int, num_tokens: int, block_size: int) -> int:
    """Play it on a real manager: allocate, fork n-1 times, each sample appends num_tokens tokens."""
    bm = BlockSpaceManager(block_size, 256, 0, watermark=0.0)
    group = _sampled_group("g", prompt_len, block_size, n=n)
    bm.allocate(group)
    parent = group.get_seqs()[0]
    parent.status = SequenceStatus.RUNNING
    seqs = [parent]
    for i in range(1, n):
        child = parent.fork(i)
        group.add(child)
        bm.fork(parent, child)
        seqs.append(child)
    for t in range(num_tokens):
        for s in seqs:
            s.append_token_id(t)
            bm.append_slot(s)
    return bm.num_total_gpu_blocks - bm.get_num_free_gpu_blocks()


@checker(chapter=3, answer="group_blocks")
def check_group_blocks(fn: Callable[[int, int, int, int], int], num_cases: int = 200, seed: int = 0) -> bool:
    """``fn(prompt_len, n, num_tokens, block_size)``: how many distinct GPU blocks a group holds
    when its prompt has been allocated, the sequence forked into ``n`` samples, and every
    sample has then appended ``num_tokens`` tokens, one round at a time, with ``append_slot``
    after each (copy-on-write included)."""
    rng = random.Random(seed)
    cases = []
    for prompt_len, n, tokens, bs in [(5, 2, 1, 4), (4, 2, 1, 4), (8, 3, 0, 4), (3, 1, 6, 4)]:
        cases.append(((prompt_len, n, tokens, bs), _blocks_held(prompt_len, n, tokens, bs)))
    while len(cases) < num_cases:
        bs = rng.choice([1, 2, 3, 4, 8])
        prompt_len = rng.randint(1, 5) * bs if rng.random() < 0.3 else rng.randint(1, 30)
        args = (prompt_len, rng.randint(1, 4), rng.choice([0, 1, 2, rng.randint(1, 3 * bs)]), bs)
        cases.append((args, _blocks_held(*args)))
    return run_cases("group_blocks", fn, cases)


# -- the BlockSpaceManager, the chapter's component ----------------------------------------------


def answer_name(answer: object, fallback: str) -> str:
    """The name the reader gave their answer (a class's or a function's), for the checker's
    report; ``fallback`` for one without a name of its own (a lambda, a partial)."""
    name = getattr(answer, "__name__", None)
    return name if isinstance(name, str) and name.isidentifier() else fallback


ManagerConfig = tuple[int, int, int, float]  # (block_size, num_gpu_blocks, num_cpu_blocks, watermark)


class _World:
    """One manager and the requests a scripted scheduler runs on it, recording every call.

    The scheduler's side is played here, the same way for the reader's manager and the
    package's: a group is admitted when ``can_allocate`` says OK (and dropped on NEVER); its
    prefill samples a token for each sequence, and a group asking for ``n`` samples then forks;
    a decode round asks ``can_append_slot``, then calls ``append_slot`` for every running
    sequence, each of which then samples its next token; a group that cannot grow is preempted,
    by recomputation if it has one sequence (freed, back to waiting) and by swapping otherwise;
    a swapped group comes back when ``can_swap_in`` says so; a finished sample is freed (twice:
    ``free`` must be safe to call again).
    """

    def __init__(self, cls: type, config: ManagerConfig) -> None:
        self.steps: list[tuple[str, str, dict]] = []  # (call, what it returned, the state after it)
        self.groups: dict[str, SequenceGroup] = {}
        self.names: dict[int, str] = {}  # seq_id -> "A.0", "A.1", ...
        self.next_id = 0
        self.next_token = 1000
        self.broken = False  # the manager raised: the run stops there
        block_size, num_gpu, num_cpu, watermark = config
        try:
            self.bm = cls(block_size, num_gpu, num_cpu, watermark)
        except Exception as e:  # the reader's constructor
            self.broken = True
            self.record(f"{answer_name(cls, 'cls')}{config}", _call_raised(e))

    # -- what is observed ---------------------------------------------------------------------

    def state(self) -> dict[str, str]:
        """Each table (``"A.1": "[0 (x2), 3]"``: block numbers, ``cpu`` for swap space, ref counts
        other than 1), and ``"free"``, the free counts."""
        bm = self.bm
        try:
            state = {}
            for seq_id, table in bm.block_tables.items():
                cells = [("cpu " if b.device == Device.CPU else "") + str(b.block_number)
                         + (f" (x{b.ref_count})" if b.ref_count != 1 else "") for b in table]
                state[str(self.names.get(seq_id, seq_id))] = f"[{', '.join(cells)}]"
            state = dict(sorted(state.items()))
            state["free"] = f"{bm.get_num_free_gpu_blocks()} GPU and {bm.get_num_free_cpu_blocks()} CPU blocks free"
        except Exception as e:
            return {"free": f"unreadable block tables ({type(e).__name__}: {e})"}
        return state

    def record(self, call: str, result: str) -> None:
        self.steps.append((call, result, {} if self.broken else self.state()))

    def call(self, call: str, fn: Callable, *args, show: Callable[[object], str] = repr):
        """``fn(*args)``, recorded; None (and the run stops) if it raised."""
        try:
            value = fn(*args)
        except Exception as e:  # the reader's method: any error is what it did
            self.record(call, _call_raised(e))
            self.broken = True
            return None
        self.record(call, f"returned {show(value)}")
        return value

    # -- the scheduler's moves ----------------------------------------------------------------

    def arrive(self, rid: str, prompt_len: int, n: int) -> None:
        seq = Sequence(self.next_id, None, list(range(prompt_len)), self.bm.block_size)
        self.names[self.next_id] = f"{rid}.0"
        self.next_id += 1
        self.groups[rid] = SequenceGroup(rid, [seq], SamplingParams(n=n, temperature=1.0 if n > 1 else 0.0), 0.0)

    def sample(self, seq: Sequence) -> None:
        seq.append_token_id(self.next_token)
        self.next_token += 1

    def admit(self, rid: str) -> None:
        group = self.groups[rid]
        status = self.call(f"can_allocate({rid})", self.bm.can_allocate, group,
                           show=lambda s: getattr(s, "name", repr(s)))
        if status is None:
            return
        if status == AllocStatus.NEVER:
            del self.groups[rid]  # the scheduler ignores it, with a message
            return
        if status != AllocStatus.OK:
            return
        waiting = group.get_seqs(SequenceStatus.WAITING)
        if self.call(f"allocate({rid})", self.bm.allocate, group) is None and self.broken:
            return
        for seq in waiting:
            seq.status = SequenceStatus.RUNNING
            self.sample(seq)  # the prefill samples each sequence's first (next) token

    def fork(self, rid: str) -> None:
        group = self.groups[rid]
        parent = group.get_seqs(SequenceStatus.RUNNING)[0]
        child = parent.fork(self.next_id)
        self.names[self.next_id] = f"{rid}.{len(group.get_seqs())}"
        self.next_id += 1
        group.add(child)
        self.call(f"fork({self.names[parent.seq_id]}, {self.names[child.seq_id]})", self.bm.fork, parent, child)

    def decode(self, rid: str) -> None:
        group = self.groups[rid]
        ok = self.call(f"can_append_slot({rid})", self.bm.can_append_slot, group)
        if self.broken:
            return
        if ok:
            for seq in group.get_seqs(SequenceStatus.RUNNING):
                self.call(f"append_slot({self.names[seq.seq_id]})", self.bm.append_slot, seq)
                if self.broken:
                    return
                self.sample(seq)
        elif group.num_seqs() == 1:  # preempted by recomputation
            seq = group.get_seqs()[0]
            self.call(f"free({self.names[seq.seq_id]}) (preempted, to be recomputed)", self.bm.free, seq)
            seq.reset_for_recompute()
        elif self.bm.can_swap_out(group):  # a group of samples is swapped out (the package's swap_out)
            self.call(f"swap_out({rid}) (the package's)", self.bm.swap_out, group,
                      show=lambda m: repr(dict(sorted(m.items()))))
            for seq in group.get_seqs(SequenceStatus.RUNNING):
                seq.status = SequenceStatus.SWAPPED
        else:  # no room anywhere: aborted
            self.finish(rid, every=True)

    def swap_in(self, rid: str) -> None:
        group = self.groups[rid]
        if self.call(f"can_swap_in({rid}) (the package's)", self.bm.can_swap_in, group):
            self.call(f"swap_in({rid}) (the package's)", self.bm.swap_in, group,
                      show=lambda m: repr(dict(sorted(m.items()))))
            for seq in group.get_seqs(SequenceStatus.SWAPPED):
                seq.status = SequenceStatus.RUNNING

    def finish(self, rid: str, every: bool = False) -> None:
        group = self.groups[rid]
        running = group.get_seqs(SequenceStatus.RUNNING) + group.get_seqs(SequenceStatus.SWAPPED)
        swapped = bool(group.num_seqs(SequenceStatus.SWAPPED))
        for seq in running if every or swapped else running[-1:]:  # a swapped group is aborted whole
            seq.status = SequenceStatus.FINISHED_STOPPED
            for again in ("", " again"):
                why = "aborted" if every or swapped else "finished"
                self.call(f"free({self.names[seq.seq_id]}){again} ({why})", self.bm.free, seq)
                if self.broken:
                    return
        if not group.get_unfinished_seqs():
            del self.groups[rid]

    # -- one random move ----------------------------------------------------------------------

    def moves(self) -> list[tuple[str, str]]:
        """The moves open now, as (move, request)."""
        open_ = []
        for rid, group in self.groups.items():
            if group.num_seqs(SequenceStatus.WAITING):
                open_.append(("admit", rid))
            elif group.num_seqs(SequenceStatus.SWAPPED):
                open_ += [("swap_in", rid)] * 3 + [("finish", rid)]  # a client may give up while swapped
            elif group.num_seqs(SequenceStatus.RUNNING):
                if group.num_seqs() < group.sampling_params.n:
                    open_.append(("fork", rid))
                open_ += [("decode", rid)] * 3 + [("finish", rid)]
        return open_


def play_manager(cls: type, config: ManagerConfig, seed: int, num_moves: int = 40) -> list[tuple[str, str, dict]]:
    """A random stream of the scheduler's moves on a manager of class ``cls``: every call made,
    what it returned, and the block tables and free counts after it (``_World.state``). The stream depends only
    on ``seed`` and on what the calls returned, so two managers that agree get the same one."""
    rng = random.Random(seed)
    world = _World(cls, config)
    block_size, num_gpu = config[0], config[1]
    arrived = 0
    for _ in range(num_moves):
        if world.broken:
            break
        moves = world.moves()
        if arrived < 6 and (not moves or rng.random() < 0.25):
            rid = "ABCDEF"[arrived]
            arrived += 1
            # Mostly prompts that fit; some that fill the cache, or more.
            prompt_len = rng.randint(1, 3 * block_size) if rng.random() < 0.8 else \
                rng.randint(num_gpu * block_size - block_size, (num_gpu + 1) * block_size)
            world.arrive(rid, max(1, prompt_len), rng.choice([1, 1, 2, 3]))
            continue
        if not moves:
            break
        move, rid = rng.choice(moves)
        getattr(world, move)(rid)
    return world.steps


def _manager_config(rng: random.Random) -> ManagerConfig:
    return (rng.choice([1, 2, 3, 4]), rng.randint(2, 10), rng.randint(0, 8), rng.choice([0.0, 0.1, 0.2, 0.34]))


def describe_state(state: dict[str, str]) -> str:
    tables = "; ".join(f"{name} {table}" for name, table in state.items() if name != "free")
    return f"tables {tables or 'none'}, {state.get('free', '?')}"


def manager_difference(cls: type, config: ManagerConfig, seed: int) -> str | None:
    """Where ``cls`` first departs from the package's BlockSpaceManager on one random stream, or
    None: the calls before, the state they left, the call, and what differs (its return value,
    or the tables and free counts it left)."""
    mine, want = play_manager(cls, config, seed), play_manager(BlockSpaceManager, config, seed)
    block_size, num_gpu, num_cpu, watermark = config
    where = f"{num_gpu} GPU and {num_cpu} CPU blocks of {block_size}, watermark {watermark}"
    for k, ((call, got, after), (want_call, expected, want_after)) in enumerate(zip(mine, want)):
        if (call, got, after) == (want_call, expected, want_after):
            continue
        calls = [c for c, _, _ in mine[:k]]
        before = (f"after {'..., ' if len(calls) > 5 else ''}{', '.join(calls[-5:])} "
                  f"({describe_state(want[k - 1][2])})") if k else "on an empty manager"
        head = f"{where}; {before}: {call}"
        if call != want_call:
            return f"{head}, expected {want_call}"
        if got != expected:
            return f"{head} {got}, expected {expected.removeprefix('returned ')}"
        wrong = [f"{name} {after.get(name, 'missing')} instead of {want_after.get(name, 'none')}"
                 for name in dict.fromkeys([*want_after, *after]) if after.get(name) != want_after.get(name)]
        return f"{head} {got} as expected, but left " + "; ".join(
            w.replace("free ", "", 1) if w.startswith("free ") else f"table {w}" for w in wrong)
    if len(mine) != len(want):
        return f"{where}: {len(mine)} calls instead of {len(want)}"
    return None


def manager_workloads() -> list[SimWorkload]:
    runs = seed_workloads()
    rng = random.Random(3)
    requests = [Request(f"r{i}", rng.randint(1, 8), rng.randint(1, 10), rng.randint(1, 5)) for i in range(8)]
    runs.append(("8 random requests, 8 GPU blocks of 2", requests,
                 SchedulerConfig(max_num_batched_tokens=12, max_num_seqs=4, max_model_len=16, preemption_mode="swap"),
                 CacheConfig(block_size=2, num_gpu_blocks=8, num_cpu_blocks=12, watermark=0.0)))
    requests = [Request(f"q{i}", rng.randint(1, 9), rng.randint(1, 8), rng.randint(1, 4)) for i in range(8)]
    runs.append(("8 random requests, 10 GPU blocks of 2, watermark 0.2, recompute", requests,
                 SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4, max_model_len=18,
                                 preemption_mode="recompute"),
                 CacheConfig(block_size=2, num_gpu_blocks=10, num_cpu_blocks=4, watermark=0.2)))
    return runs


@checker(chapter=3, answer="CopyOnWriteManager")
def check_block_manager(cls: type, num_cases: int = 300, seed: int = 0) -> bool:
    """``cls``: a subclass of ``tinyserve.block_manager.BlockSpaceManager`` (its constructor,
    allocators, swap methods and getters) that writes the chapter's six methods:
    ``can_allocate(group)`` (OK, LATER or NEVER, with the watermark and its two exemptions),
    ``allocate(group)`` (the prompt's blocks, shared by the group's waiting sequences),
    ``can_append_slot(group)`` (enough free blocks for the running sequences that need one),
    ``append_slot(seq)`` (a new block, nothing, or a copy of a shared last block, returning
    ``(src, dst)``), ``fork(parent, child)`` and ``free(seq)`` (safe to call twice). Graded
    call by call beside the package's manager on random streams of a scheduler's operations,
    then as the real scheduler's block manager on s0/s1/s2 and random workloads."""
    rng = random.Random(seed)
    configs = [((4, 8, 4, 0.0), 11), ((2, 6, 6, 0.0), 12), ((1, 5, 3, 0.2), 13), ((3, 10, 0, 0.1), 14)]
    while len(configs) < num_cases:
        configs.append((_manager_config(rng), rng.randrange(1 << 30)))
    failures = [d for config, stream in configs if (d := manager_difference(cls, config, stream))]
    name = answer_name(cls, "BlockSpaceManager")
    calls_ok = verdict(f"{name}, call by call beside the package's BlockSpaceManager", failures, len(configs))
    engine_ok = check_runs(f"{name} in the scheduler", manager_workloads(),
                           lambda *w: run_with_manager(cls, *w), lambda *w: run_with_manager(BlockSpaceManager, *w),
                           tables=True)
    return calls_ok and engine_ok
