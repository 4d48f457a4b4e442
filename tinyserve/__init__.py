"""tinyserve: a textbook vLLM-style inference engine.

    from tinyserve import LLM, SamplingParams
    llm = LLM()  # SmolLM2-135M-Instruct, on CUDA when present
    outs = llm.generate(["Hello, my name is"], SamplingParams(temperature=0.0, max_tokens=16))

The engine is imported lazily so that ``import tinyserve`` (and the scheduling chapters, which
need no model) stays light.
"""

from tinyserve.sequence import SamplingParams

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
