"""How chapter 03's exercise 1, the reader's BlockSpaceManager, is driven: a scripted scheduler
(``_World``) that plays a random stream of a scheduler's operations on one manager and records
every call, what it returned, and the block tables and free counts after it (``play_manager``).
The stream depends only on its seed and on what the calls returned, so two managers that agree
get the same one, and ``tinyserve.exercises.ch03.check_block_manager`` compares the reader's
manager with the package's call by call.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from tinyserve.block import Device
from tinyserve.block_manager import AllocStatus
from tinyserve.sequence import SamplingParams, Sequence, SequenceGroup, SequenceStatus


def _call_raised(e: Exception) -> str:
    return f"raised {type(e).__name__}" + (f": {e}" if str(e) else "")



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
