"""Tensor parallelism: one engine driving ``k`` worker processes that each hold 1/k of every layer.

The process that runs the engine (the *driver*) keeps the scheduler, the block manager, the
sampler and the tokenizer. It starts ``k`` worker processes with ``torch.multiprocessing``
(spawn), which meet on a free loopback port and form a ``torch.distributed`` group: gloo on the
CPU, NCCL on CUDA (rank ``r`` on ``cuda:r``). Each rank builds an ordinary ``Worker`` over its
shard of the model and its own CacheEngine for its share of the KV heads.

Every round the driver sends every rank the same message (the scheduled groups and the swap-in,
swap-out and copy maps): block *numbers* mean the same on every rank, only the heads stored in
a block differ. The ranks run the layer stack in lock step, summing the partial outputs of each
row-parallel layer with ``all_reduce``; rank 0 sends the logits back.

What is split and what is not (see ``models/llama.py`` for the math):
- q/k/v and gate/up are split by output rows (column-parallel), o_proj and down_proj by input
  columns (row-parallel), so each decoder layer needs two all-reduces and nothing else.
- The embedding and the LM head are *replicated*. For SmolLM2 they are one tied 49152 x 576
  matrix (113 MB in float32), and a vocab-parallel LM head would need an all-gather of the
  logits every step for rank 0 to sample from, an extra collective to save a small matrix.
  Only rank 0 applies the LM head; the others skip it (``_ShardWithoutHead``).
- KV heads are never replicated, so ``k`` must divide the number of KV heads.

Shutdown is explicit (``shutdown``/``close``/``with``), and also happens on garbage collection
and at interpreter exit (``weakref.finalize`` runs its callback from an atexit hook). The driver
waits on its workers with timeouts and watches their process handles, so a worker that dies or
fails surfaces as an error in the driver, never as a hang.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import socket
import sys
import time
import traceback
import types
import weakref
from dataclasses import replace
from datetime import timedelta
from multiprocessing.connection import Connection, wait

import torch

from tinyserve.config import CacheConfig, ModelConfig, ParallelConfig
from tinyserve.models.llama import LlamaForCausalLM
from tinyserve.models.loader import LoadedModel, check_architecture, read_state_dict, resolve_model_dir
from tinyserve.sequence import SequenceGroupMetadata
from tinyserve.worker import DEFAULT_SWAP_GIB, Worker, resolve_device, resolve_dtype

START_TIMEOUT_S = 300.0  # process start, rendezvous and weight loading on every rank
CALL_TIMEOUT_S = 600.0  # one round (or any other call): a hang guard, not a performance target
STOP_TIMEOUT_S = 10.0  # grace period for a clean exit before terminate(), then kill()


class WorkerError(RuntimeError):
    """A tensor-parallel worker failed, died or stopped answering."""


def check_shardable(hf_config, tp_size: int) -> None:
    """Refuse a ``tp_size`` this model cannot be split into, before any process starts."""
    heads, kv_heads = hf_config.num_attention_heads, hf_config.num_key_value_heads
    if tp_size > kv_heads:
        raise ValueError(
            f"tensor_parallel_size={tp_size} is larger than the model's {kv_heads} KV heads. Each rank "
            "keeps the KV heads of its own query heads, and tinyserve does not replicate KV heads "
            f"across ranks, so at most {kv_heads} ranks can share this model; sizes that work: "
            f"{valid_tp_sizes(hf_config)}"
        )
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = getattr(hf_config, name)
        if value % tp_size:
            raise ValueError(
                f"{name}={value} is not divisible by tensor_parallel_size={tp_size}: every rank must hold "
                f"the same share of it. This model has {heads} heads and {kv_heads} KV heads; sizes that "
                f"work: {valid_tp_sizes(hf_config)}"
            )


def valid_tp_sizes(hf_config) -> list[int]:
    """Every tensor-parallel size the model splits into evenly (the divisors of the KV heads that
    also divide the heads and the MLP width)."""
    g = math.gcd(hf_config.num_attention_heads, hf_config.num_key_value_heads, hf_config.intermediate_size)
    return [k for k in range(1, g + 1) if g % k == 0]


def shard_shapes(hf_config, tp_size: int) -> dict[str, tuple[int, ...]]:
    """Shape of each weight of one decoder layer on one rank, plus the replicated ones.

    The layer weights are named after the fused matrices tinyserve keeps (``qkv_proj`` holds this
    rank's q, k and v rows; ``gate_up_proj`` its gate and up rows)."""
    check_shardable(hf_config, tp_size)
    hidden = hf_config.hidden_size
    head_dim = getattr(hf_config, "head_dim", None) or hidden // hf_config.num_attention_heads
    q = hf_config.num_attention_heads // tp_size * head_dim
    kv = hf_config.num_key_value_heads // tp_size * head_dim
    inter = hf_config.intermediate_size // tp_size
    return {
        "embed_tokens": (hf_config.vocab_size, hidden),
        "qkv_proj": (q + 2 * kv, hidden),
        "o_proj": (hidden, q),
        "gate_up_proj": (2 * inter, hidden),
        "down_proj": (hidden, inter),
        "input_layernorm": (hidden,),
        "post_attention_layernorm": (hidden,),
    }


def weight_bytes_per_rank(hf_config, tp_size: int, bytes_per_param: int = 2) -> dict[str, int]:
    """Weight bytes one rank holds, split into what every rank repeats and what it shares out.

    ``replicated``: the embedding, the LM head (unless tied to the embedding), the norms and the
    biases added after an all-reduce. ``sharded``: this rank's slice of q/k/v, o, gate/up and down
    (and of their biases)."""
    shapes = shard_shapes(hf_config, tp_size)
    hidden, layers = hf_config.hidden_size, hf_config.num_hidden_layers
    sharded = sum(math.prod(shapes[name]) for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))
    replicated = 2 * hidden  # the two norms of a layer
    if getattr(hf_config, "attention_bias", False):
        sharded += shapes["qkv_proj"][0]
        replicated += hidden  # o_proj's bias, added once after the sum
    if getattr(hf_config, "mlp_bias", False):
        sharded += shapes["gate_up_proj"][0]
        replicated += hidden
    embed = math.prod(shapes["embed_tokens"])
    head = 0 if getattr(hf_config, "tie_word_embeddings", False) else embed
    out = {"replicated": (embed + head + hidden + layers * replicated) * bytes_per_param,
           "sharded": layers * sharded * bytes_per_param}
    out["total"] = out["replicated"] + out["sharded"]
    return out


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of a module's parameters (what one rank's shard holds)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _main_module_hidden():
    """Start spawned processes without re-running the driver's script in them.

    A spawned child normally re-imports the parent's ``__main__`` (so a script without an
    ``if __name__ == "__main__":`` guard would build a second engine in every worker). The
    workers' code lives in this module and needs nothing from ``__main__``, so while they are
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


class _ShardWithoutHead(LlamaForCausalLM):
    """A rank other than 0: the same layers, but it skips the LM head. Only rank 0's logits are
    sampled from, and the head is a large replicated matmul (49152 x 576 per row for SmolLM2)."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden.new_empty((hidden.shape[0], 0), dtype=torch.float32)


def _load_shard(path, config_fields: dict, device: torch.device, dtype: torch.dtype, rank: int, size: int,
                all_reduce, attention_backend: str) -> LoadedModel:
    """This rank's shard, built without transformers: the driver sent the config as plain fields
    (importing transformers would add seconds to every worker's start) and the tokenizer stays
    with the driver, which is the only process that encodes or decodes text."""
    config = types.SimpleNamespace(**config_fields)
    with torch.device(device):
        model = (LlamaForCausalLM if rank == 0 else _ShardWithoutHead)(config, rank, size, all_reduce,
                                                                        attention_backend)
    model.to(dtype)
    model.load_weights(read_state_dict(path))
    return LoadedModel(model=model.eval().requires_grad_(False), tokenizer=None, hf_config=config, path=path)


def _worker_main(rank: int, size: int, port: int, model_config: ModelConfig, path, config_fields: dict,
                 attention_backend: str, conn: Connection, num_threads: int) -> None:
    """Body of one worker process: join the group, build the shard, then serve the driver's calls."""
    # Ctrl-C in a terminal reaches the whole process group. The driver alone decides when the
    # workers stop; a worker interrupted halfway through a collective would hang its peers.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import torch.distributed as dist

    exit_code = 0
    try:
        device = resolve_device(model_config.device)
        if device.type == "cuda":
            device = torch.device("cuda", rank)
            torch.cuda.set_device(device)
            model_config = replace(model_config, device=str(device))
        else:
            torch.set_num_threads(num_threads)  # k ranks share the cores instead of fighting over them
        if os.path.isdir("/sys/class/net/lo"):  # keep every socket on the loopback interface
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
            os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                                rank=rank, world_size=size, timeout=timedelta(seconds=START_TIMEOUT_S))

        def all_reduce(t: torch.Tensor) -> None:
            dist.all_reduce(t)  # in place: the model carries on with the summed tensor

        dtype = resolve_dtype(model_config.dtype, device)
        loaded = _load_shard(path, config_fields, device, dtype, rank, size, all_reduce, attention_backend)
        worker = Worker(model_config, attention_backend, tp_rank=rank, tp_size=size, all_reduce=all_reduce,
                        loaded=loaded)
        model = worker.model
        conn.send(("ready", dict(rank=rank, pid=os.getpid(), device=str(worker.device),
                                 backend=model.backend.name, num_heads=model.num_heads,
                                 num_kv_heads=model.num_kv_heads, weight_bytes=weight_bytes(model))))
        while True:
            try:
                method, args = conn.recv()
            except EOFError:  # the driver is gone: nobody is left to answer
                break
            if method == "shutdown":
                break
            try:
                result = getattr(worker, method)(*args)
                if isinstance(result, torch.Tensor):
                    # Only rank 0's logits are used; numpy pickles by value (a tensor would
                    # travel as a shared-memory handle that the sender must keep alive).
                    result = result.cpu().numpy() if rank == 0 else None
                conn.send(("ok", result))
            except Exception:
                conn.send(("error", traceback.format_exc()))
    except (BrokenPipeError, EOFError, ConnectionResetError):
        exit_code = 1  # the driver went away mid-answer
    except BaseException:
        exit_code = 1
        try:
            conn.send(("error", traceback.format_exc()))
        except OSError:
            pass
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        # Skip the interpreter's teardown: it holds nothing worth saving and takes seconds
        # (thousands of tensors and modules to free), which every shutdown would wait for.
        os._exit(exit_code)


class _Workers:
    """The worker processes and the driver's end of their pipes. Kept apart from the executor so
    the finalizer can stop them without holding a reference to the executor itself."""

    def __init__(self, procs: list, conns: list[Connection]) -> None:
        self.procs, self.conns = procs, conns
        self.stopped = False
        self.grace_s = STOP_TIMEOUT_S  # how long a worker may take to finish its round and exit

    def stop(self) -> None:
        if self.stopped:
            return
        self.stopped = True
        for conn in self.conns:
            try:
                conn.send(("shutdown", ()))
            except (OSError, ValueError):
                pass  # that worker is already gone
        deadline = time.monotonic() + self.grace_s
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():  # stuck, e.g. in a collective whose peer died
                p.terminate()
                p.join(2.0)
            if p.is_alive():
                p.kill()
                p.join()
        for conn in self.conns:
            conn.close()


class TensorParallelExecutor:
    """Drives ``tensor_parallel_size`` worker processes with the Worker's interface.

    ``loaded`` carries the tokenizer and config in the driver (``loaded.model`` is None: the
    weights live in the workers). ``rank_info`` says what each rank built (pid, device, heads,
    KV heads, weight bytes).
    """

    def __init__(self, model_config: ModelConfig, parallel_config: ParallelConfig, attention_backend: str = "auto",
                 start_timeout_s: float = START_TIMEOUT_S, call_timeout_s: float = CALL_TIMEOUT_S) -> None:
        from transformers import AutoConfig, AutoTokenizer

        self.tp_size = k = parallel_config.tensor_parallel_size
        self.device = resolve_device(model_config.device)
        self.dtype = resolve_dtype(model_config.dtype, self.device)
        self.call_timeout_s = call_timeout_s
        # Everything that can be refused is refused here, before a single process starts.
        path = resolve_model_dir(model_config.model)
        hf_config = AutoConfig.from_pretrained(str(path), local_files_only=True)
        check_architecture(hf_config)
        check_shardable(hf_config, k)
        if self.device.type == "cuda" and torch.cuda.device_count() < k:
            raise ValueError(f"tensor_parallel_size={k} needs {k} CUDA devices (one per rank), "
                             f"found {torch.cuda.device_count()}")
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        self.loaded = LoadedModel(model=None, tokenizer=tokenizer, hf_config=hf_config, path=path)

        ctx = torch.multiprocessing.get_context("spawn")
        port = _free_loopback_port()
        threads = max(1, _cpu_count() // k)
        # The finalizer exists before the first process does, so no path (not even Ctrl-C
        # halfway through the starts) can leave a started worker without someone to stop it.
        self._workers = _Workers([], [])
        self._finalizer = weakref.finalize(self, self._workers.stop)
        try:
            with _main_module_hidden():
                for rank in range(k):
                    here, there = ctx.Pipe()
                    p = ctx.Process(target=_worker_main, name=f"tinyserve-tp{rank}", daemon=True,
                                    args=(rank, k, port, model_config, path, hf_config.to_dict(),
                                          attention_backend, there, threads))
                    self._workers.conns.append(here)
                    p.start()
                    self._workers.procs.append(p)
                    there.close()  # only the worker holds its end, so its death reads as EOF here
            self.rank_info: list[dict] = self._gather("start", start_timeout_s, expect="ready")
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
        """One round on every rank (same orders everywhere); rank 0's float32 logits, on the CPU."""
        results = self._call("execute_model", groups, blocks_to_swap_in, blocks_to_swap_out, blocks_to_copy)
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

    def _call(self, method: str, *args) -> list:
        if self._workers.stopped:
            raise WorkerError("the tensor-parallel workers have been shut down; create a new executor (or LLM)")
        try:
            for rank, conn in enumerate(self._workers.conns):
                try:
                    conn.send((method, args))
                except OSError:  # its end of the pipe is closed: the process died
                    self._raise_died(rank, method)
            return self._gather(method, self.call_timeout_s)
        except BaseException as e:
            # A failed, timed-out or interrupted round leaves the ranks out of step (some may be
            # waiting in a collective forever): the group cannot be reused, so stop it now.
            if not isinstance(e, KeyboardInterrupt):
                self._workers.grace_s = 1.0  # ...and quickly: the ranks may be stuck
            self.shutdown()
            raise

    def _gather(self, what: str, timeout: float, expect: str = "ok") -> list:
        """Every rank's answer, as they arrive; the first failure or death raises at once."""
        workers = self._workers
        answers: dict[int, object] = {}
        deadline = time.monotonic() + timeout
        while len(answers) < len(workers.procs):
            pending = [r for r in range(len(workers.procs)) if r not in answers]
            waitables = [workers.conns[r] for r in pending] + [workers.procs[r].sentinel for r in pending]
            ready = wait(waitables, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise WorkerError(f"tensor-parallel workers {pending} did not answer {what!r} within {timeout:.0f} s")
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
                        raise WorkerError(f"tensor-parallel worker rank {r} failed in {what!r}:\n{payload}")
                elif proc.sentinel not in ready:
                    continue
                self._raise_died(r, what)
        return [answers[r] for r in range(len(workers.procs))]

    def _raise_died(self, rank: int, what: str) -> None:
        proc = self._workers.procs[rank]
        proc.join(1.0)
        raise WorkerError(f"tensor-parallel worker rank {rank} (pid {proc.pid}) died during {what!r} "
                          f"(exit code {proc.exitcode})")
