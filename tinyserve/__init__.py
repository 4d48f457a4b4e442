"""tinyserve: a textbook vLLM-style inference engine.

    from tinyserve import LLM, SamplingParams
    llm = LLM()  # SmolLM2-135M-Instruct, on CUDA when present
    outs = llm.generate(["Hello, my name is"], SamplingParams(temperature=0.0, max_tokens=16))

The engine is imported lazily so that ``import tinyserve`` (and the scheduling chapters, which
need no model) stays light. Importing tinyserve before torch makes torch's idle OpenMP threads
sleep instead of spin (below).
"""

import os
import sys

# OpenMP reads its wait policy once, when torch's runtime loads. Its default spins idle threads,
# which makes torch many times slower whenever another process shares the cores (a second
# notebook, a test run); sleeping costs almost nothing. So it is set here, before torch loads,
# and the chapters import tinyserve first. A reader's own setting wins.
if "torch" not in sys.modules:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from tinyserve.sequence import SamplingParams  # noqa: E402

__all__ = ["LLM", "LLMEngine", "RequestOutput", "SamplingParams"]


def __getattr__(name: str):
    if name == "LLM":
        from tinyserve.llm import LLM

        return LLM
    if name == "LLMEngine":
        from tinyserve.engine import LLMEngine

        return LLMEngine
    if name in ("RequestOutput", "CompletionOutput"):
        from tinyserve import outputs

        return getattr(outputs, name)
    raise AttributeError(f"module 'tinyserve' has no attribute {name!r}")
