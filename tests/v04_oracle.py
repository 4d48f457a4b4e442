"""vLLM v0.4.0's own scheduler as a test oracle, and one interface over it and tinyserve's.

``make venv`` installs ``vllm==0.4.0`` with ``--no-deps`` (its CUDA dependencies are not wanted).
Its ``vllm/__init__.py`` imports the whole engine (ray, xformers, CUDA kernels), so ``load``
never runs it: it registers an empty ``vllm`` package whose ``__path__`` is the installed folder
and imports only what the scheduler needs (``vllm.core.scheduler``, ``vllm.core.block_manager_v1``,
``vllm.core.policy``, ``vllm.sequence``, ``vllm.block``, ``vllm.config``; torch and transformers,
which ``vllm.config`` imports, are in the venv anyway). The empty package stays in
``sys.modules``: ``BlockSpaceManager.get_block_space_manager_class`` imports its block manager
when a Scheduler is built.

Two changes to the oracle, both in ``make_oracle_scheduler`` and both on the test's copy only:

- v0.4.0 frees a block table by iterating ``set(block_table)``, whose order follows the blocks'
  memory addresses, so which block its stack of free blocks hands out next is not reproducible.
  ``TableOrderBlockSpaceManagerV1`` frees in table order instead (one of the orders v0.4.0 can
  take, and the one tinyserve uses), so block numbers, and so block tables, can be compared.
- v0.4.0's Scheduler builds its block manager with the default watermark (0.01); the test
  builds the same ``BlockSpaceManagerV1`` with the watermark of the workload, which v0.4.0's
  class takes as an argument, so that the watermark rules are compared too.

``OracleSide`` and ``TinyserveSide`` drive the two schedulers the same way: add a request,
schedule a round and describe what it decided (``Decision``), play the model's part
(``play``, the engine's bookkeeping with made-up tokens, ``ModelStub``), and describe the state
(``state``).
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.metadata
import importlib.util
import logging
import random
import sys
import types
from dataclasses import dataclass, field

from tinyserve.config import CacheConfig, SchedulerConfig
from tinyserve.scheduler import Scheduler
from tinyserve.sequence import SamplingParams, Sequence, SequenceGroup, SequenceStatus

VERSION = "0.4.0"
INSTALL_HINT = (f"vLLM v{VERSION}, the scheduler oracle, is not installed in .venv: run `make venv` "
                f"(it installs vllm=={VERSION} with --no-deps)")


class OracleMissing(RuntimeError):
    """vllm==0.4.0 is not installed where this Python looks."""


def check_version() -> None:
    """Raise OracleMissing, saying to run ``make venv``, unless vllm 0.4.0 is installed."""
    try:
        version = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        raise OracleMissing(INSTALL_HINT) from None
    if version != VERSION:
        raise OracleMissing(f"vllm {version} is installed, the oracle is {VERSION}. {INSTALL_HINT}")


def locate() -> list[str]:
    """The installed ``vllm`` package's folder, found without importing it (which would run
    ``vllm/__init__.py``); OracleMissing when it is not there or is another version."""
    check_version()
    spec = importlib.util.find_spec("vllm")  # a top-level package's spec: nothing is executed
    if spec is None or not spec.submodule_search_locations:
        raise OracleMissing(INSTALL_HINT)
    return list(spec.submodule_search_locations)


_oracle: types.SimpleNamespace | None = None


def load() -> types.SimpleNamespace:
    """v0.4.0's scheduler modules, imported once (see the module docstring)."""
    global _oracle
    if _oracle is not None:
        return _oracle
    if "vllm" not in sys.modules:
        pkg = types.ModuleType("vllm")
        pkg.__path__ = locate()
        # A spec, so that importlib.util.find_spec("vllm") (test_prose reads v0.4.0's files
        # through it) still finds the package after this stand-in takes its place.
        pkg.__spec__ = importlib.machinery.ModuleSpec("vllm", None, is_package=True)
        pkg.__spec__.submodule_search_locations = list(pkg.__path__)
        sys.modules["vllm"] = pkg
    else:  # imported already (by an earlier load, or for real): its spec cannot be looked up again
        check_version()
    scheduler = importlib.import_module("vllm.core.scheduler")
    block_manager = importlib.import_module("vllm.core.block_manager_v1")
    # v0.4.0 logs each refused prompt as a warning on stdout (its loggers do not propagate).
    for module in (scheduler, block_manager):
        module.logger.setLevel(logging.ERROR)
    gpu = importlib.import_module("vllm.utils").Device.GPU

    class TableOrderBlockSpaceManagerV1(block_manager.BlockSpaceManagerV1):
        """BlockSpaceManagerV1 whose frees go in table order rather than ``set`` order."""

        def _free_block_table(self, block_table):
            assert self.block_sliding_window is None  # the test never sets one
            # dict.fromkeys: each block once (as the set does), in the order of the table.
            for block in dict.fromkeys(block_table):
                (self.gpu_allocator if block.device == gpu else self.cpu_allocator).free(block)

    _oracle = types.SimpleNamespace(
        scheduler=scheduler,
        block_manager=block_manager,
        TableOrderBlockSpaceManagerV1=TableOrderBlockSpaceManagerV1,
        sequence=importlib.import_module("vllm.sequence"),
        config=importlib.import_module("vllm.config"),
        sampling_params=importlib.import_module("vllm.sampling_params"),
    )
    return _oracle


def make_oracle_scheduler(cfg: WorkloadConfig):
    """v0.4.0's Scheduler, with a BlockSpaceManagerV1 that frees in table order and keeps the
    workload's watermark (see the module docstring)."""
    o = load()
    sc = o.config.SchedulerConfig(cfg.max_num_batched_tokens, cfg.max_num_seqs, cfg.max_model_len)
    cc = o.config.CacheConfig(cfg.block_size, gpu_memory_utilization=0.9, swap_space=0, cache_dtype="auto")
    cc.num_gpu_blocks, cc.num_cpu_blocks = cfg.num_gpu_blocks, cfg.num_cpu_blocks  # the engine sets them
    sched = o.scheduler.Scheduler(sc, cc, None)
    assert type(sched.block_manager) is o.block_manager.BlockSpaceManagerV1  # the class being replaced
    sched.block_manager = o.TableOrderBlockSpaceManagerV1(cfg.block_size, cfg.num_gpu_blocks, cfg.num_cpu_blocks,
                                                          watermark=cfg.watermark)
    return sched


# -- the workload -------------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkloadConfig:
    block_size: int
    num_gpu_blocks: int
    num_cpu_blocks: int
    watermark: float
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int


@dataclass(frozen=True)
class Request:
    """One request: its prompt sequence has id ``index``, its forks ``child_id(index, k)``;
    it arrives before round ``arrival_round``, at ``arrival_time`` (by default ``index``, so
    distinct; several requests may share one). Its id is ``name``, by default ``index``
    zero-padded (v0.4 sorts a batch by request id, as text: "r10" comes before "r9")."""

    index: int
    prompt: tuple[int, ...]
    n: int
    max_tokens: int
    arrival_round: int
    arrival_time: float | None = None
    name: str | None = None

    @property
    def request_id(self) -> str:
        return self.name if self.name is not None else f"r{self.index:03d}"

    @property
    def arrival(self) -> float:
        return float(self.index) if self.arrival_time is None else self.arrival_time


def child_id(parent_seq_id: int, k: int) -> int:
    """The same id for the same fork on both sides, whatever order the forks happen in."""
    return 100_000 + 10 * parent_seq_id + k


@dataclass(frozen=True)
class ModelStub:
    """The model's part: a made-up token per sequence and step, and whether the sequence stops
    there, at max_tokens or (with probability ``stop_p``, as an EOS would) earlier. A pure
    function of the sequence id and length, so both sides see the same."""

    seed: int
    stop_p: float

    def token(self, seq_id: int, output_len: int) -> int:
        return 10 + (seq_id * 7919 + output_len * 104_729) % 30_000

    def finish(self, seq_id: int, output_len: int, max_tokens: int) -> str | None:
        if output_len >= max_tokens:
            return "length"
        if self.stop_p and random.Random(self.seed * 1_000_003 + seq_id * 10_007 + output_len).random() < self.stop_p:
            return "stop"
        return None


# -- one round, as both sides report it ---------------------------------------------------------


@dataclass
class Decision:
    """What one ``schedule()`` decided, in terms both schedulers share.

    ``kind`` is "prompt" (a prompt round: prefills, or only refusals), "decode" or "none".
    ``scheduled`` lists each scheduled request with its token chunk, in batch order (v0.4.0's
    ``SchedulerOutputs`` sorts its batch by (LoRA id, request id); ``compat="vllm-0.4"`` too).
    ``ignored`` are the requests refused this round. ``errors`` (tinyserve only) are the reasons
    given for them.
    """

    kind: str
    scheduled: list[tuple[str, int]]
    ignored: list[str]
    swap_in: dict[int, int]
    swap_out: dict[int, int]
    copy: dict[int, list[int]]
    errors: dict[str, str] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        """Nothing ran and nothing moved (v0.4.0's ``SchedulerOutputs.is_empty``)."""
        return not (self.scheduled or self.swap_in or self.swap_out or self.copy)


def _kind(scheduled: bool, prompt: bool, ignored: bool) -> str:
    if scheduled:
        return "prompt" if prompt else "decode"
    return "prompt" if ignored else "none"


class _Side:
    """What the two sides share: the queues and block tables, read the same way."""

    sched = None
    finished_status: dict[str, object] = {}

    def queues(self) -> dict[str, list[str]]:
        return {name: [g.request_id for g in getattr(self.sched, name)] for name in ("waiting", "running", "swapped")}

    def unfinished(self) -> bool:
        return bool(self.sched.waiting or self.sched.running or self.sched.swapped)

    def state(self) -> dict:
        """The queues after a round (``running`` and ``swapped`` as sets: both schedulers sort
        them by arrival before using them, but may leave them in different orders, as tinyserve
        sorts in prompt rounds too; ``waiting``'s order is FCFS admission, kept), free blocks,
        and every block table with its device."""
        bm = self.sched.block_manager
        q = self.queues()
        return {
            "waiting": q["waiting"],
            "running": sorted(q["running"]),
            "swapped": sorted(q["swapped"]),
            "free_gpu": bm.get_num_free_gpu_blocks(),
            "free_cpu": bm.get_num_free_cpu_blocks(),
            "tables": {sid: (t[0].device.name if t else None, [b.block_number for b in t])
                       for sid, t in sorted(bm.block_tables.items())},
        }

    def _play_group(self, group, prompt_run: bool, stub: ModelStub, samples: int, status, append, free):
        """v0.4.0's ``LLMEngine._process_sequence_group_outputs`` (no beam search) with made-up
        tokens: each running sequence takes a token, a prompt's first sample forks into
        ``samples`` (each child copies its parent before the parent's token), then the children
        join the group and fork their parent's blocks unless they already finished, and the
        parents that finished free theirs. tinyserve's engine does the same, bar the order of
        frees; the order matters, for v0.4.0's free blocks are a stack, so both sides use this."""
        children = []
        for parent in group.get_seqs(status.RUNNING):
            k = samples if prompt_run else 1
            for j in range(k - 1):
                child = parent.fork(child_id(parent.seq_id, j))
                append(child, stub.token(child.seq_id, child.get_output_len()))
                children.append((child, parent))
            append(parent, stub.token(parent.seq_id, parent.get_output_len()))
            children.append((parent, parent))
        for seq, _ in children:
            reason = stub.finish(seq.seq_id, seq.get_output_len(), group.sampling_params.max_tokens)
            if reason is not None:
                seq.status = self.finished_status[reason]
        for seq, parent in children:
            if seq is not parent:
                group.add(seq)
                if not seq.is_finished():
                    self.sched.fork_seq(parent, seq)
        for seq, parent in children:
            if seq is parent and seq.is_finished():
                free(seq)


class OracleSide(_Side):
    """vLLM v0.4.0's Scheduler and BlockSpaceManagerV1."""

    def __init__(self, cfg: WorkloadConfig, swap: bool = False) -> None:
        """``swap``: preempt by swapping, whatever the group. v0.4.0's ``_preempt`` takes the mode
        as an argument (its scheduler never passes one); this passes ``PreemptionMode.SWAP``."""
        self.o = load()
        self.cfg = cfg
        self.sched = make_oracle_scheduler(cfg)
        if swap:
            preempt, mode = self.sched._preempt, self.o.scheduler.PreemptionMode.SWAP
            self.sched._preempt = lambda group, blocks_to_swap_out: preempt(group, blocks_to_swap_out, mode)
        status = self.o.sequence.SequenceStatus
        self.finished_status = {"length": status.FINISHED_LENGTH_CAPPED, "stop": status.FINISHED_STOPPED}
        self.out = None

    def add(self, req: Request) -> None:
        seq_mod = self.o.sequence
        seq = seq_mod.Sequence(req.index, None, list(req.prompt), self.cfg.block_size)
        params = self.o.sampling_params.SamplingParams(n=req.n, max_tokens=req.max_tokens, temperature=1.0)
        self.sched.add_seq_group(seq_mod.SequenceGroup(req.request_id, [seq], params, req.arrival))

    def schedule(self) -> Decision:
        """One round; lets v0.4.0's RuntimeError (CPU swap space full) through."""
        _, out = self.sched.schedule()
        self.out = out
        return Decision(
            kind=_kind(bool(out.scheduled_seq_groups), out.prompt_run, bool(out.ignored_seq_groups)),
            scheduled=[(s.seq_group.request_id, s.token_chunk_size) for s in out.scheduled_seq_groups],
            ignored=sorted(g.request_id for g in out.ignored_seq_groups),
            swap_in=dict(out.blocks_to_swap_in), swap_out=dict(out.blocks_to_swap_out),
            copy={k: list(v) for k, v in out.blocks_to_copy.items()})

    def readmitted_with_finished_samples(self) -> list[str]:
        """Groups this prompt round prefilled that hold more than the one sequence prefilled:
        a sample preempted by recompute whose siblings finished. v0.4.0's ``allocate`` gives
        the prompt's blocks a ref count of all the group's sequences, finished ones too, so
        they never return to the free list (and its sampler would fork the sample again)."""
        if not self.out.prompt_run:
            return []
        return [s.seq_group.request_id for s in self.out.scheduled_seq_groups if s.seq_group.num_seqs() > 1]

    def play(self, stub: ModelStub) -> None:
        """v0.4.0's ``LLMEngine._process_model_outputs``, in its batch order (by request id)."""
        logprob = self.o.sequence.Logprob
        out = self.out
        for scheduled in out.scheduled_seq_groups:
            group = scheduled.seq_group
            group.update_num_computed_tokens(scheduled.token_chunk_size)
            # v0.4.0's sampler draws best_of samples for every group of a prompt run.
            self._play_group(group, out.prompt_run, stub, group.sampling_params.best_of, self.o.sequence.SequenceStatus,
                             append=lambda s, t: s.append_token_id(t, {t: logprob(0.0)}),
                             free=self.sched.free_seq)
        self.sched.free_finished_seq_groups()


class TinyserveSide(_Side):
    """tinyserve's Scheduler under ``compat`` (``"vllm-0.4"`` for the comparison).

    Two tinyserve paths that v0.4.0 lacks are recorded as they happen, so the test can tell
    them from a mismatch: ``stand_ins`` (a recomputable group preempted in place of a victim
    that cannot be swapped, ``PreemptionMixin._stand_in``) and the refusals in ``Decision.errors``.
    """

    finished_status = {"length": SequenceStatus.FINISHED_LENGTH_CAPPED, "stop": SequenceStatus.FINISHED_STOPPED}

    def __init__(self, cfg: WorkloadConfig, compat: str = "vllm-0.4", swap: bool = False) -> None:
        self.cfg = cfg
        self.sched = Scheduler(
            SchedulerConfig(max_num_batched_tokens=cfg.max_num_batched_tokens, max_num_seqs=cfg.max_num_seqs,
                            max_model_len=cfg.max_model_len, compat=compat, preemption_mode="swap" if swap else None),
            CacheConfig(block_size=cfg.block_size, num_gpu_blocks=cfg.num_gpu_blocks,
                        num_cpu_blocks=cfg.num_cpu_blocks, watermark=cfg.watermark))
        self.stand_ins: list[str] = []
        stand_in = self.sched._stand_in

        def recording_stand_in(*args):
            group = stand_in(*args)
            if group is not None:
                self.stand_ins.append(group.request_id)
            return group

        self.sched._stand_in = recording_stand_in  # the instance attribute shadows the mixin's method
        self.out = None

    def add(self, req: Request) -> None:
        seq = Sequence(req.index, None, list(req.prompt), self.cfg.block_size)
        params = SamplingParams(n=req.n, max_tokens=req.max_tokens, temperature=1.0)
        self.sched.add_seq_group(SequenceGroup(req.request_id, [seq], params, req.arrival))

    def schedule(self) -> Decision:
        self.stand_ins.clear()
        _, out = self.sched.schedule()
        self.out = out
        prompts = [s.is_prompt for s in out.scheduled_seq_groups]
        kind = "mixed" if any(prompts) and not all(prompts) else _kind(bool(prompts), all(prompts),
                                                                        bool(out.ignored_seq_groups))
        return Decision(
            kind=kind,
            scheduled=[(s.seq_group.request_id, s.token_chunk_size) for s in out.scheduled_seq_groups],
            ignored=sorted(g.request_id for g in out.ignored_seq_groups),
            swap_in=dict(out.blocks_to_swap_in), swap_out=dict(out.blocks_to_swap_out),
            copy={k: list(v) for k, v in out.blocks_to_copy.items()},
            errors={g.request_id: g.error for g in out.ignored_seq_groups})

    def reported_moves(self) -> dict[str, list[str]]:
        """What tinyserve's SchedulerOutputs says moved (the oracle's are derived from its queues)."""
        out = self.out
        return {"preempted": sorted(out.preempted), "swapped_out": sorted(out.swapped_out),
                "swapped_in": sorted(out.swapped_in)}

    def play(self, stub: ModelStub) -> None:
        """The same bookkeeping as ``OracleSide.play``, with tinyserve's pieces, in v0.4.0's order
        (the batch's own under ``compat="vllm-0.4"``; ``"tinyserve"`` keeps the order it scheduled)."""
        out = self.out
        self.sched.update_num_computed_tokens(out)
        for scheduled in sorted(out.scheduled_seq_groups, key=lambda s: s.seq_group.request_id):
            group = scheduled.seq_group
            # tinyserve's engine forks only a prompt that has sampled nothing yet (see play_round).
            fresh = group.is_waiting_for_prefill()
            self._play_group(group, scheduled.is_prompt, stub, group.sampling_params.n if fresh else 1, SequenceStatus,
                             append=lambda s, t: s.append_token_id(t), free=self.sched.free_seq)
        self.sched.free_finished_seq_groups()
