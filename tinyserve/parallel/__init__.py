"""Tensor parallelism: one engine driving ``k`` worker processes that each hold 1/k of every layer.

The process that runs the engine (the *driver*) keeps the scheduler, the block manager, the
sampler and the tokenizer; ``k`` rank processes hold the weights and the KV cache, each its
share of the heads. The package has these parts, plus the arithmetic they share:

- ``models.sharding``: what is cut and how (column- and row-parallel shards, whole heads per
  rank, the sizes that work, bytes per rank). The model loads its own shard with it.
- ``rank``: one worker process: join the ``torch.distributed`` group (gloo on the CPU, NCCL on
  CUDA), build the shard, run an ordinary ``Worker`` over it, answer the driver.
- ``executor``: the driver's ``TensorParallelExecutor``: start the ranks, send every rank the
  same orders each round, gather rank 0's logits, stop them (and never hang on a dead one).
- ``liveness``: how the driver tells a busy rank from a stopped or stuck one (heartbeats and a
  round deadline), so that a rank that stops answering fails within seconds, not minutes.

What is split and what is not:
- q/k/v and gate/up are split by output rows (column-parallel), o_proj and down_proj by input
  columns (row-parallel), so each decoder layer needs two all-reduces and nothing else.
- The embedding and the LM head are *replicated*. For SmolLM2 they are one tied 49152 x 576
  matrix (113 MB in float32), and a vocab-parallel LM head would need an all-gather of the
  logits every step for rank 0 to sample from, an extra collective to save a small matrix.
  Only rank 0 applies the LM head; the others skip it (``ShardWithoutHead``).
- KV heads are never replicated, so ``k`` must divide the number of KV heads.
"""

from tinyserve.models.sharding import (
    check_shardable,
    shard_shapes,
    valid_tp_sizes,
    weight_bytes,
    weight_bytes_per_rank,
)
from tinyserve.parallel.executor import TensorParallelExecutor, WorkerError
from tinyserve.parallel.rank import ShardWithoutHead, worker_main

__all__ = ["ShardWithoutHead", "TensorParallelExecutor", "WorkerError", "check_shardable", "shard_shapes",
           "valid_tp_sizes", "weight_bytes", "weight_bytes_per_rank", "worker_main"]
