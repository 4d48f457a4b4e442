"""Chapter 10's lab for the reader's tensor-parallel MLP: ranks simulated in one process, and the
reader's class sent to real rank processes.

- ``ThreadGroup``: ``k`` ranks as ``k`` threads of this process, with an ``all_reduce`` that really
  waits for every rank and returns the sum (in rank order, so every rank gets the same bits).
  ``ThreadGroup(k).run(fn)`` calls ``fn(rank, all_reduce)`` on every rank at once; the chapter's
  checker runs the reader's MLP this way.
- ``WorkspaceMLP``: a picklable stand-in for the reader's saved ``ParallelMLP``. A class written in
  a notebook cannot be pickled into a spawned process; this object can, and each rank builds its
  MLPs with the class it loads from the saved file (``models.loader.use_mlp`` is the hook).
- ``generate_with_mlp``: a real tensor-parallel run (``TensorParallelExecutor(..., mlp=)``) of
  greedy prompts, every layer's MLP on every rank built by the given factory.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

import torch

BARRIER_TIMEOUT_S = 10.0  # a rank that never reaches the all-reduce fails the run instead of hanging it


class ThreadGroup:
    """``size`` simulated ranks. ``all_reduce_for(rank)`` is that rank's collective: it blocks until
    every rank has called it, then returns the sum (a new tensor; its argument is left alone)."""

    def __init__(self, size: int, timeout_s: float = BARRIER_TIMEOUT_S) -> None:
        self.size = size
        self.barrier = threading.Barrier(size, timeout=timeout_s)
        self.slots: list[torch.Tensor | None] = [None] * size
        self.calls = [0] * size  # all-reduces each rank has made

    def all_reduce_for(self, rank: int):
        def all_reduce(t: torch.Tensor) -> torch.Tensor:
            self.slots[rank] = t.detach().clone()
            self.barrier.wait()  # every rank's term is in
            shapes = {tuple(s.shape) for s in self.slots}
            if len(shapes) != 1:
                raise ValueError(f"the ranks all-reduced tensors of different shapes: {sorted(shapes)}")
            total = self.slots[0].clone()
            for term in self.slots[1:]:
                total += term
            self.barrier.wait()  # every rank has read the terms before any rank overwrites its own
            self.calls[rank] += 1
            return total
        return all_reduce

    def run(self, fn) -> list:
        """``[fn(rank, all_reduce) for each rank]``, run at the same time on ``size`` threads. The
        first exception any rank raised is raised again (the others are released)."""
        results: list = [None] * self.size
        errors: list[tuple[int, BaseException]] = []

        def body(rank: int) -> None:
            try:
                results[rank] = fn(rank, self.all_reduce_for(rank))
            except BaseException as e:  # noqa: BLE001 - passed to the caller below
                errors.append((rank, e))
                self.barrier.abort()  # peers waiting in an all-reduce for this rank give up at once

        threads = [threading.Thread(target=body, args=(r,), name=f"tinyserve-sim-rank{r}") for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            # A BrokenBarrierError is only the echo of another rank's failure: report the cause.
            rank, e = next(((r, e) for r, e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
            if isinstance(e, threading.BrokenBarrierError):
                raise RuntimeError(f"rank {rank} waited in all_reduce and the other ranks never came: every rank "
                                   "must call all_reduce the same number of times") from None
            raise RankError(rank, e) from e
        return results


class RankError(RuntimeError):
    """An exception raised on one simulated rank (``rank``, ``error``)."""

    def __init__(self, rank: int, error: BaseException) -> None:
        super().__init__(f"rank {rank}: {type(error).__name__}: {error}")
        self.rank, self.error = rank, error


@dataclass(frozen=True)
class WorkspaceMLP:
    """Builds MLPs with the ``ParallelMLP`` saved in ``path`` (the reader's workspace module),
    loading it once per process. Picklable, so a tensor-parallel rank can be given it."""

    path: str

    def __call__(self, *args, **kwargs):
        return self.load()(*args, **kwargs)

    def load(self):
        from tinyserve.workspace.store import COMPONENTS, import_file

        key = (self.path, Path(self.path).stat().st_mtime_ns)  # a file saved again is loaded again
        cls = _loaded.get(key)
        if cls is None:
            module = import_file(Path(self.path), "_tinyserve_workspace.parallel_mlp")
            cls = _loaded[key] = getattr(module, COMPONENTS["parallel_mlp"].object)
        return cls


_loaded: dict[tuple[str, int], type] = {}


def saved_mlp() -> WorkspaceMLP | None:
    """The reader's saved ``parallel_mlp`` as a factory ranks can be sent, or None if not saved."""
    from tinyserve.workspace.store import path_of

    path = path_of("parallel_mlp")
    return WorkspaceMLP(str(path)) if path.exists() else None


def generate_with_mlp(model_dir, mlp, prompts: list[str], max_tokens: int, tp_size: int = 2,
                      attention_backend="auto", **cache) -> tuple[list[list[int]], list[dict]]:
    """Greedy tokens of ``prompts`` from a ``tp_size``-rank run of the model in ``model_dir``,
    every rank's MLPs built by ``mlp``; and the ranks' ``rank_info``. The ranks stop at the end."""
    from tinyserve.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig
    from tinyserve.engine import LLMEngine
    from tinyserve.parallel import TensorParallelExecutor
    from tinyserve.sampling_params import SamplingParams

    model_config = ModelConfig(model=str(model_dir), device=cache.pop("device", "cpu"))
    cache_config = CacheConfig(**cache)
    executor = TensorParallelExecutor(model_config, ParallelConfig(tensor_parallel_size=tp_size),
                                      attention_backend=attention_backend, mlp=mlp)
    try:
        engine = LLMEngine(model_config, cache_config, SchedulerConfig(max_model_len=256), executor=executor)
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, params)
        tokens: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    tokens[out.request_id] = list(out.outputs[0].token_ids)
        return [tokens[str(i)] for i in range(len(prompts))], executor.rank_info
    finally:
        executor.shutdown()
