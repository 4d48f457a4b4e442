"""``attention_backend=`` takes a backend object as well as a name, and the object runs inside the
real engine: ``Worker``, ``LLMEngine`` and ``LLM`` all pass it through to the model's attention.

The object used here counts its calls and delegates to the reference; the engine driven by it
must produce the greedy tokens of the built-in backends, which ``test_engine.py`` holds to
transformers' ``generate``.
"""

from __future__ import annotations

import pytest
from test_engine import GREEDY, PROMPTS, make_engine, run_all

from tinyserve import LLM
from tinyserve.attention import reference
from tinyserve.attention.backend import AttentionBackend, check_backend
from tinyserve.config import ModelConfig
from tinyserve.parallel.executor import _check_sendable
from tinyserve.worker import Worker


class CountingBackend:
    """Delegates to the reference and counts what the model asked of it."""

    name = "counting"

    def __init__(self) -> None:
        self.stores = self.forwards = 0

    def store_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        self.stores += 1
        reference.store_kv(key, value, k_cache, v_cache, slot_mapping)

    def forward(self, q, k_cache, v_cache, meta, scale):
        self.forwards += 1
        return reference.paged_attention(q, k_cache, v_cache, meta, scale)


@pytest.fixture
def model(tiny_loaded):
    yield tiny_loaded
    tiny_loaded.model.set_attention_backend("auto")  # the session's model, left as it was found


@pytest.fixture(scope="module")
def builtin(tiny_loaded):
    """Greedy tokens with each built-in backend (the same for all of them)."""
    runs = {name: run_all(make_engine(tiny_loaded, backend=name), PROMPTS[:4], GREEDY)
            for name in ("torch", "torch-batched")}
    assert runs["torch"] == runs["torch-batched"]
    tiny_loaded.model.set_attention_backend("auto")
    return runs["torch"]


def test_a_backend_object_drives_the_engine_through_the_worker(model, builtin):
    counting = CountingBackend()
    assert isinstance(counting, AttentionBackend)
    engine = make_engine(model, backend=counting)
    assert engine.executor.model.backend is counting and engine.executor.backend_name == "counting"
    forward_passes = []
    run = engine.executor.run
    engine.executor.run = lambda inputs: forward_passes.append(inputs) or run(inputs)
    assert run_all(engine, PROMPTS[:4], GREEDY) == builtin
    # One store and one attention per layer in every forward pass of the model.
    assert counting.stores == counting.forwards == model.model.num_layers * len(forward_passes) > 0


def test_llm_passes_a_backend_object_to_the_engine(tiny_model_dir, builtin):
    counting = CountingBackend()
    llm = LLM(model=str(tiny_model_dir), device="cpu", attention_backend=counting, num_gpu_blocks=64,
              num_cpu_blocks=0, max_model_len=256)
    assert llm.engine.executor.model.backend is counting
    outs = llm.generate(PROMPTS[:4], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == list(builtin.values())
    assert counting.forwards > 0


def test_a_bad_backend_is_refused_by_name(model):
    config = ModelConfig(model=str(model.path), device="cpu", dtype="float32")
    with pytest.raises(ValueError, match="attention_backend must be one of .* got 'cuda-magic'"):
        Worker(config, attention_backend="cuda-magic", loaded=model)

    class NoForward:
        def store_kv(self, *args):
            pass

    with pytest.raises(ValueError, match="attention_backend .* NoForward lacks forward"):
        Worker(config, attention_backend=NoForward(), loaded=model)
    with pytest.raises(ValueError, match="attention_backend"):
        LLM(model=str(model.path), device="cpu", attention_backend="cuda-magic")
    assert check_backend("triton") == "triton"


def test_a_backend_object_for_tensor_parallel_ranks_must_travel():
    _check_sendable(CountingBackend())  # importable and picklable: sent to every rank

    class Local(CountingBackend):  # a class the ranks could not import
        pass

    with pytest.raises(ValueError, match="attention_backend: .* must be picklable"):
        _check_sendable(Local())
    Local.__module__ = "__main__"
    with pytest.raises(ValueError, match="attention_backend: .* not in __main__"):
        _check_sendable(Local())
