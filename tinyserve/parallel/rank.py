"""One tensor-parallel rank: a worker process that holds 1/k of every layer and obeys the driver.

``worker_main`` is the whole life of the process. It joins the ``torch.distributed`` group
(gloo on the CPU, NCCL on CUDA with rank ``r`` on ``cuda:r``), builds its shard of the model
(``models.loader.build_model``, with ``all_reduce`` summing the row-parallel layers' partial
outputs across the ranks) and an ordinary ``Worker`` around it, then answers the driver's calls
(``determine_num_blocks``, ``init_cache``, ``execute_model``) until told to stop or until the
driver's end of the pipe closes. From its first line to its last, a thread beats a heartbeat in
shared memory (``liveness.start_beating``) so that the driver can tell a stopped rank from a busy one.
"""

from __future__ import annotations

import os
import signal
import sys
import traceback
import types
from dataclasses import replace
from datetime import timedelta
from multiprocessing.connection import Connection

import torch

from tinyserve.attention.backend import BackendSpec, backend_label
from tinyserve.config import ModelConfig, dtype_name
from tinyserve.models.llama import LlamaForCausalLM
from tinyserve.models.loader import LoadedModel, build_model, read_state_dict
from tinyserve.models.sharding import weight_bytes
from tinyserve.parallel.liveness import start_beating
from tinyserve.worker import Worker


class ShardWithoutHead(LlamaForCausalLM):
    """A rank other than 0: the same layers, but it skips the LM head. Only rank 0's logits are
    sampled from, and the head is a large replicated matmul (49152 x 576 per row for SmolLM2)."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden.new_empty((hidden.shape[0], 0), dtype=torch.float32)


def worker_main(rank: int, size: int, port: int, model_config: ModelConfig, device_type: str,
                dtype: torch.dtype, path, config_fields: dict, attention_backend: BackendSpec,
                conn: Connection, start_timeout_s: float, num_threads: int, beats, beat_interval_s: float,
                mlp=None) -> None:
    """Body of one worker process: join the group, build the shard, then serve the driver's calls.

    The driver resolved device and dtype once; the model config comes as plain fields (importing
    transformers would add seconds to every worker's start) and the tokenizer stays with the
    driver, the only process that encodes or decodes text. ``beats`` is the shared array of
    heartbeat counts; this rank counts up ``beats[rank]`` every ``beat_interval_s``. ``mlp``, if
    given, builds every layer's MLP (``models.loader.use_mlp``)."""
    # Ctrl-C in a terminal reaches the whole process group. The driver alone decides when the
    # workers stop; a worker interrupted halfway through a collective would hang its peers.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    start_beating(beats, rank, beat_interval_s)
    import torch.distributed as dist

    exit_code = 0
    try:
        device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        else:
            torch.set_num_threads(num_threads)  # k ranks share the cores instead of fighting over them
        if os.path.isdir("/sys/class/net/lo"):  # keep every socket on the loopback interface
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
            os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                                rank=rank, world_size=size, timeout=timedelta(seconds=start_timeout_s))

        def all_reduce(t: torch.Tensor) -> None:
            dist.all_reduce(t)  # in place: the model carries on with the summed tensor

        config = types.SimpleNamespace(**config_fields)
        model = build_model(config, read_state_dict(path), device, dtype, rank, size, all_reduce, attention_backend,
                            model_class=LlamaForCausalLM if rank == 0 else ShardWithoutHead, mlp=mlp)
        loaded = LoadedModel(model=model, tokenizer=None, hf_config=config, path=path)
        model_config = replace(model_config, device=str(device), dtype=dtype_name(dtype))
        worker = Worker(model_config, attention_backend, tp_rank=rank, tp_size=size, all_reduce=all_reduce,
                        loaded=loaded)
        conn.send(("ready", dict(rank=rank, pid=os.getpid(), device=str(worker.device),
                                 backend=backend_label(model.backend), num_heads=model.num_heads,
                                 num_kv_heads=model.num_kv_heads, weight_bytes=weight_bytes(model))))
        _serve(worker, conn, rank)
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


def _serve(worker: Worker, conn: Connection, rank: int) -> None:
    """Answer the driver's ``(method, args)`` calls with ``("ok", result)`` or ``("error", trace)``."""
    while True:
        try:
            method, args = conn.recv()
        except EOFError:  # the driver is gone: nobody is left to answer
            return
        if method == "shutdown":
            return
        try:
            result = getattr(worker, method)(*args)
            if isinstance(result, torch.Tensor):
                # Only rank 0's logits are used; numpy pickles by value (a tensor would travel
                # as a shared-memory handle that the sender must keep alive).
                result = result.cpu().numpy() if rank == 0 else None
            conn.send(("ok", result))
        except Exception:
            conn.send(("error", traceback.format_exc()))
