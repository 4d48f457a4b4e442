"""The driver side of tensor parallelism: start ``k`` rank processes, talk to them, stop them.

``TensorParallelExecutor`` offers the Worker's interface (``determine_num_blocks``,
``init_cache``, ``execute_model``) to the engine, so neither the engine nor the scheduler knows
the difference. Behind it, ``k`` processes started with ``torch.multiprocessing`` (spawn) meet on
a free loopback port and run ``rank.worker_main``. Every round the driver sends every rank the
same message (the scheduled groups and the swap-in, swap-out and copy maps): block numbers mean
the same on every rank, only the heads stored in a block differ. Rank 0 sends the logits back.

Shutdown is explicit (``shutdown``/``close``/``with``), and also happens on garbage collection
and at interpreter exit (``weakref.finalize`` runs its callback from an atexit hook).

A worker that fails, dies or stops answering surfaces as a ``WorkerError`` in the driver, never
as a hang, and the whole group is stopped (the ranks are out of step). While it waits, the driver
watches each rank's answer, its process handle (a death shows at once) and its heartbeat (see
``liveness``): a rank silent for ``ParallelConfig.heartbeat_timeout_s`` (5 s by default) is
stopped or frozen, and fails the call. A round that the ranks keep beating through but never
finish fails at its deadline, ``max(step_timeout_s, step_timeout_factor x the slowest round so
far)`` (30 s at first by default). The orders go out from a thread, so even the send cannot block
on a rank that has stopped reading. Only the start keeps a long, fixed limit: loading weights can
take minutes, with no heartbeat yet while a rank imports torch.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import socket
import sys
import threading
import time
import types
import weakref
from multiprocessing.connection import Connection, wait
from multiprocessing.reduction import ForkingPickler

import torch

from tinyserve.attention.backend import BackendSpec, check_backend
from tinyserve.config import CacheConfig, ModelConfig, ParallelConfig, resolve_device, resolve_dtype
from tinyserve.models.loader import LoadedModel, read_hf_config, resolve_model_dir
from tinyserve.models.sharding import check_shardable
from tinyserve.parallel.liveness import Heartbeats, RoundDeadline, beat_interval, is_stopped, process_state
from tinyserve.parallel.rank import worker_main
from tinyserve.sequence import SequenceGroupMetadata
from tinyserve.worker import DEFAULT_SWAP_GIB

START_TIMEOUT_S = 300.0  # process start, rendezvous and weight loading on every rank
CALL_TIMEOUT_S = 600.0  # any call but a round (and a round with its deadline off): a hang guard only
STOP_TIMEOUT_S = 10.0  # grace period for a clean exit before terminate(), then kill()


class WorkerError(RuntimeError):
    """A tensor-parallel worker failed, died or stopped answering."""


def _check_sendable(attention_backend: BackendSpec) -> None:
    """A backend object goes to every rank by pickle (each rank gets its own copy): refuse one
    that cannot make the trip, before any process starts."""
    if isinstance(check_backend(attention_backend), str):
        return
    _check_sendable_part("attention_backend", attention_backend)


def _check_sendable_part(name: str, part) -> None:
    kind = "a backend object" if name == "attention_backend" else f"{name}"
    if (part.__module__ if isinstance(part, type) else type(part).__module__) == "__main__":
        raise ValueError(f"{name}: with tensor_parallel_size > 1 {kind} is sent to every "
                         "rank, so its class must live in an importable module, not in __main__ or a notebook")
    try:
        pickle.dumps(part)
    except Exception as e:
        raise ValueError(f"{name}: with tensor_parallel_size > 1 {kind} is sent to every "
                         f"rank and must be picklable ({e})") from None


def _free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _main_module_hidden():
    """Start spawned processes without re-running the driver's script in them.

    A spawned child normally re-imports the parent's ``__main__`` (so a script without an
    ``if __name__ == "__main__":`` guard would build a second engine in every worker). The
    workers' code lives in this package and needs nothing from ``__main__``, so while they are
    started, ``__main__`` is a blank stand-in that spawn has nothing to re-import from."""
    main = sys.modules.get("__main__")
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        if main is not None:
            sys.modules["__main__"] = main


def _cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class _Workers:
    """The worker processes and the driver's end of their pipes. Kept apart from the executor so
    the finalizer can stop them without holding a reference to the executor itself."""

    def __init__(self, procs: list, conns: list[Connection]) -> None:
        self.procs, self.conns = procs, conns
        self.stopped = False
        self.grace_s = STOP_TIMEOUT_S  # how long a worker may take to finish its round and exit
        self.sender: threading.Thread | None = None

    def send_all(self, message) -> None:
        """Write the same pickled message to every rank, from a thread. A rank that has stopped
        reading (stopped, frozen) takes no more than its socket's buffer, and a blocked write has no
        timeout; meanwhile the driver waits for the answers, heartbeats and deaths included."""
        if self.sender is not None:
            self.sender.join()  # long done: every rank has answered the previous call

        def send() -> None:
            for conn in self.conns:
                try:
                    conn.send_bytes(message)
                except (OSError, ValueError):
                    pass  # that process died; the driver's wait sees its handle

        self.sender = threading.Thread(target=send, name="tinyserve-tp-send", daemon=True)
        self.sender.start()

    def stop(self) -> None:
        if self.stopped:
            return
        self.stopped = True
        self._kill_stopped()  # a stopped process would sit out the grace period, then ignore SIGTERM
        for conn in self.conns:
            try:
                os.set_blocking(conn.fileno(), False)  # a goodbye must not wait on a rank that is not reading
                conn.send(("shutdown", ()))
            except (OSError, ValueError):
                pass  # that worker is already gone, or not reading (it is ended below)
        deadline = time.monotonic() + self.grace_s
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        self._kill_stopped()
        for p in self.procs:
            if p.is_alive():  # stuck, e.g. in a collective whose peer died
                p.terminate()
                p.join(2.0)
            if p.is_alive():
                p.kill()
                p.join()
        if self.sender is not None:
            self.sender.join(5.0)  # every reader is gone, so its writes fail at once; then the pipes can close
        for conn in self.conns:
            conn.close()

    def _kill_stopped(self) -> None:
        for p in self.procs:
            if p.is_alive() and is_stopped(p.pid):
                p.kill()  # SIGKILL is the one signal a stopped process obeys
                p.join(2.0)


class TensorParallelExecutor:
    """Drives ``tensor_parallel_size`` worker processes with the Worker's interface.

    ``loaded`` carries the tokenizer and config in the driver (``loaded.model`` is None: the
    weights live in the workers). ``rank_info`` says what each rank built (pid, device, heads,
    KV heads, weight bytes). ``mlp``: a picklable factory every rank builds its layers' MLPs with
    (``models.loader.use_mlp``; chapter 10 plugs in the reader's).
    """

    def __init__(self, model_config: ModelConfig, parallel_config: ParallelConfig,
                 attention_backend: BackendSpec = "auto", start_timeout_s: float = START_TIMEOUT_S,
                 call_timeout_s: float = CALL_TIMEOUT_S, mlp=None) -> None:
        from transformers import AutoTokenizer

        self.tp_size = k = parallel_config.tensor_parallel_size
        # Resolved once, here; the ranks are told the result.
        self.device = resolve_device(model_config.device)
        self.dtype = resolve_dtype(model_config.dtype, self.device)
        self.call_timeout_s = call_timeout_s
        self._round_deadline = RoundDeadline(parallel_config.step_timeout_s, parallel_config.step_timeout_factor)
        # Everything that can be refused is refused here, before a single process starts.
        _check_sendable(attention_backend)
        if mlp is not None:
            _check_sendable_part("mlp", mlp)
        path = resolve_model_dir(model_config.model)
        hf_config = read_hf_config(path)
        check_shardable(hf_config, k)
        if self.device.type == "cuda" and torch.cuda.device_count() < k:
            raise ValueError(f"tensor_parallel_size={k} needs {k} CUDA devices (one per rank), "
                             f"found {torch.cuda.device_count()}")
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        self.loaded = LoadedModel(model=None, tokenizer=tokenizer, hf_config=hf_config, path=path)

        ctx = torch.multiprocessing.get_context("spawn")
        port = _free_loopback_port()
        threads = max(1, _cpu_count() // k)
        beats = ctx.RawArray("Q", k)  # rank r counts up beats[r] (no lock: one writer per slot)
        self._heartbeats = Heartbeats(beats, parallel_config.heartbeat_timeout_s)
        # The finalizer exists before the first process does, so no path (not even Ctrl-C
        # halfway through the starts) can leave a started worker without someone to stop it.
        self._workers = _Workers([], [])
        self._finalizer = weakref.finalize(self, self._workers.stop)
        try:
            with _main_module_hidden():
                for rank in range(k):
                    here, there = ctx.Pipe()
                    p = ctx.Process(target=worker_main, name=f"tinyserve-tp{rank}", daemon=True,
                                    args=(rank, k, port, model_config, self.device.type, self.dtype, path,
                                          hf_config.to_dict(), attention_backend, there, START_TIMEOUT_S,
                                          threads, beats, beat_interval(parallel_config.heartbeat_timeout_s),
                                          mlp))
                    self._workers.conns.append(here)
                    p.start()
                    self._workers.procs.append(p)
                    there.close()  # only the worker holds its end, so its death reads as EOF here
            # No heartbeats here: a rank imports torch before it can beat, and loads its weights in
            # calls that may hold the GIL for long.
            self.rank_info: list[dict] = self._gather("start", start_timeout_s, expect="ready", watch=False)
        except BaseException:
            self._workers.grace_s = 1.0  # a failed start has nothing worth waiting for
            self.shutdown()
            raise
        self.backend_name = self.rank_info[0]["backend"]

    # -- the Worker interface ---------------------------------------------------------------

    def determine_num_blocks(self, block_size: int, gpu_memory_utilization: float = 0.9,
                             swap_space_gib: float = DEFAULT_SWAP_GIB) -> tuple[int, int]:
        """The smallest count over the ranks: one block table indexes every rank's cache."""
        counts = self._call("determine_num_blocks", block_size, gpu_memory_utilization, swap_space_gib)
        return min(c[0] for c in counts), min(c[1] for c in counts)

    def init_cache(self, cache_config: CacheConfig) -> None:
        self._call("init_cache", cache_config)

    def execute_model(self, groups: list[SequenceGroupMetadata], blocks_to_swap_in: dict[int, int],
                      blocks_to_swap_out: dict[int, int], blocks_to_copy: dict[int, list[int]]) -> torch.Tensor | None:
        """One round on every rank (same orders everywhere); rank 0's float32 logits, on the CPU.
        The round must finish within its deadline, set by the slowest round so far."""
        started = time.monotonic()
        results = self._call("execute_model", groups, blocks_to_swap_in, blocks_to_swap_out, blocks_to_copy,
                             timeout=self._round_deadline.seconds(otherwise=self.call_timeout_s))
        self._round_deadline.record(time.monotonic() - started)
        return None if results[0] is None else torch.from_numpy(results[0])

    # -- lifetime ---------------------------------------------------------------------------

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self._workers.procs]

    @property
    def is_running(self) -> bool:
        return not self._workers.stopped

    def shutdown(self) -> None:
        """Stop every worker (idempotent): ask, wait, then terminate and kill stragglers."""
        self._finalizer()

    close = shutdown

    def __enter__(self) -> TensorParallelExecutor:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # -- talking to the ranks ---------------------------------------------------------------

    def _call(self, method: str, *args, timeout: float | None = None) -> list:
        if self._workers.stopped:
            raise WorkerError("the tensor-parallel workers have been shut down; create a new executor (or LLM)")
        # Pickled once, and here: an argument that cannot be sent fails in the caller, before any rank moves.
        message = ForkingPickler.dumps((method, args))
        try:
            self._workers.send_all(message)
            return self._gather(method, self.call_timeout_s if timeout is None else timeout)
        except BaseException as e:
            # A failed, timed-out or interrupted round leaves the ranks out of step (some may be
            # waiting in a collective forever): the group cannot be reused, so stop it now.
            if not isinstance(e, KeyboardInterrupt):
                self._workers.grace_s = 1.0  # ...and quickly: the ranks may be stuck
            self.shutdown()
            raise

    def _gather(self, what: str, timeout: float, expect: str = "ok", watch: bool = True) -> list:
        """Every rank's answer, as they arrive; the first failure, death or silence raises at once.
        ``watch``: fail a rank whose heartbeat stops (waking every ``poll_s`` to look)."""
        workers = self._workers
        answers: dict[int, object] = {}
        deadline = time.monotonic() + timeout
        heartbeats = self._heartbeats if watch and self._heartbeats.timeout_s is not None else None
        if heartbeats is not None:
            heartbeats.restart()
        while len(answers) < len(workers.procs):
            pending = [r for r in range(len(workers.procs)) if r not in answers]
            left = deadline - time.monotonic()
            if left <= 0:
                # >>> fold: WorkerError: a rank did not answer in time
                pids = [workers.procs[r].pid for r in pending]
                alive = ", though they still beat: alive but stuck" if heartbeats is not None else ""
                limit = " (the round deadline: see ParallelConfig.step_timeout_s)" if what == "execute_model" else ""
                raise WorkerError(f"tensor-parallel workers {pending} (pids {pids}) did not answer {what!r} within "
                                  f"{timeout:.1f} s{alive}{limit}")
                # <<<
            waitables = [workers.conns[r] for r in pending] + [workers.procs[r].sentinel for r in pending]
            ready = wait(waitables, timeout=left if heartbeats is None else min(left, heartbeats.poll_s))
            for r in pending:
                conn, proc = workers.conns[r], workers.procs[r]
                if conn in ready or conn.poll():
                    try:
                        status, payload = conn.recv()
                    except (EOFError, OSError):  # its end of the pipe closed: the process is exiting
                        status, payload = "died", None
                    if status == expect:
                        answers[r] = payload
                        continue
                    if status == "error":
                        # >>> fold: WorkerError: the rank's own traceback
                        raise WorkerError(f"tensor-parallel worker rank {r} failed in {what!r}:\n{payload}")
                        # <<<
                elif proc.sentinel not in ready:
                    continue
                self._raise_died(r, what)
            if heartbeats is not None:
                for r, silent_s in heartbeats.silent([r for r in pending if r not in answers]):
                    self._raise_silent(r, what, silent_s)
        return [answers[r] for r in range(len(workers.procs))]

    def _raise_died(self, rank: int, what: str) -> None:
        proc = self._workers.procs[rank]
        proc.join(1.0)
        raise WorkerError(f"tensor-parallel worker rank {rank} (pid {proc.pid}) died during {what!r} "
                          f"(exit code {proc.exitcode})")

    def _raise_silent(self, rank: int, what: str, silent_s: float) -> None:
        pid = self._workers.procs[rank].pid
        state = process_state(pid)
        how = {"T": "stopped by a signal (SIGSTOP, Ctrl-Z)", "t": "stopped by a debugger",
               None: "stopped or frozen"}.get(state, f"alive but frozen (kernel state {state!r})")
        raise WorkerError(f"tensor-parallel worker rank {rank} (pid {pid}) stopped answering during {what!r}: "
                          f"no heartbeat for {silent_s:.1f} s (heartbeat_timeout_s={self._heartbeats.timeout_s:g}); "
                          f"its process is {how}")
