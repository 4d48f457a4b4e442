"""The decode step compiled with ``torch.compile`` (inductor), one graph per padded batch size.

This is vLLM V1's recipe on the CPU: the model's whole forward pass traced into one graph with
no breaks, attention an opaque custom op (``attention/opaque.py``) whose shapes do not depend on
the context, and the batch padded to a capture size (``sizes.py``) so that each size is
compiled once and then found by the compiler's guards. Inductor fuses each stretch between two
matmuls (a norm, the rotary embedding, an activation, a residual add) into one C++ loop: the
hundreds of small ops of an eager step, each with its Python dispatch and its pass over memory,
become a few dozen kernels. Matmuls run on weights packed once for oneDNN
(``models/packed_linear.py``) where the CPU supports it.

Compiling a size takes seconds (``compile_seconds``); inductor keeps what it compiled in its
on-disk cache (``TORCHINDUCTOR_CACHE_DIR``, by default a folder under the temp directory), so a
later process with the same model shape loads it rather than compiling again. Padding rows run
through the graph with token 0 at position 0; attention stores nothing for them and returns
zeros, and their hidden states are cut off before the LM head, so they reach neither the cache
nor sampling.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable

import torch

from tinyserve.attention.metadata import AttentionMetadata
from tinyserve.attention.opaque import step_context
from tinyserve.graphs.sizes import graph_size, pad
from tinyserve.model_runner import ModelInput

logger = logging.getLogger("tinyserve.graphs")


def say(line: str) -> None:
    """A progress line on standard error, and in the ``tinyserve.graphs`` log."""
    print(f"tinyserve: {line}", file=sys.stderr, flush=True)
    logger.debug(line)


class CompiledDecode:
    """Runs padded decode batches of ``model`` through ``torch.compile``'d graphs.

    ``sizes`` are the capture sizes (``sizes.capture_sizes``). ``progress`` is called with a
    line before and after each size compiles (default: ``say``, on standard error, since a
    silent pause of many seconds looks like a hang).
    """

    def __init__(self, model: torch.nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], sizes: list[int],
                 progress: Callable[[str], None] | None = None) -> None:
        self.model, self.kv_caches, self.sizes = model, kv_caches, sizes
        self.progress = progress or say
        self.compile_seconds: dict[int, float] = {}  # size -> seconds its first call took
        # Each padded size is one more entry in the compiler's cache of this function; the
        # default limit (8) would fall back to eager past the eighth size.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, len(sizes) + 8)
        self._graph = torch.compile(self._forward, dynamic=False, fullgraph=True)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # The caches stay out of the graph: attention finds them in its step context.
        return self.model(input_ids, positions, None, None)

    @torch.inference_mode()  # as every step runs (Worker.execute_model): a graph is kept per grad mode
    def compile_all(self) -> None:
        """Compile every capture size now, on batches of padding alone, as vLLM captures its
        graphs at start-up: a server pays before it answers rather than in its first requests."""
        device = self.model.embed_tokens.device
        empty = AttentionMetadata.build([], [], [], [], device=device)
        for size in self.sizes:
            if size not in self.compile_seconds:
                # Two tensors, not one passed twice: the compiler guards on aliasing between inputs.
                self._call(size, torch.zeros(size, dtype=torch.long, device=device),
                           torch.zeros(size, dtype=torch.long, device=device), empty, 0)

    def run(self, inputs: ModelInput) -> torch.Tensor | None:
        """Hidden states of the batch's rows through the graph of its padded size, or None when
        no graph takes the batch (it then runs eagerly)."""
        size = graph_size(inputs, self.sizes)
        if size is None:
            return None
        n = inputs.input_ids.shape[0]
        hidden = self._call(size, pad(inputs.input_ids, size, 0), pad(inputs.positions, size, 0),
                            inputs.attn_metadata, n)
        return hidden[:n]

    def _call(self, size: int, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
              n: int) -> torch.Tensor:
        """The graph of ``size`` rows on padded inputs whose first ``n`` rows are real."""
        first = size not in self.compile_seconds
        if first:
            self.progress(f"compiling the decode step for batch size {size} (once; later runs load it from "
                          f"inductor's cache)")
            start = time.perf_counter()
        with step_context(self.model.backend, meta, n, self.kv_caches):
            hidden = self._graph(input_ids, positions)
        if first:
            self.compile_seconds[size] = time.perf_counter() - start
            self.progress(f"compiled batch size {size} in {self.compile_seconds[size]:.1f} s")
        return hidden
