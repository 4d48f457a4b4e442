"""Bad input at the boundary: every field gets a ValueError that names it, and loses nothing.

``LLM``'s dtype takes torch dtypes and vLLM's strings; ``generate`` and ``add_request`` refuse
malformed prompts and token ids instead of raising TypeErrors or running them.
"""

from __future__ import annotations

import numpy
import pytest
import torch

from tinyserve.llm import LLM
from tinyserve.sequence import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def half_llm(tiny_model_dir):
    return LLM(model=str(tiny_model_dir), device="cpu", dtype=torch.float16, num_gpu_blocks=64, num_cpu_blocks=8)


def test_llm_takes_a_torch_dtype_and_runs_in_it(half_llm):
    assert half_llm.engine.executor.dtype == torch.float16
    assert next(half_llm.engine.executor.model.parameters()).dtype == torch.float16
    assert half_llm.engine.executor.cache_engine.gpu_cache[0][0].dtype == torch.float16
    out = half_llm.generate(["Hello, my name is"], GREEDY)[0].outputs[0]
    assert len(out.token_ids) == 4 and out.finish_reason == "length"


@pytest.mark.parametrize(("dtype", "expected"), [("half", torch.float16), ("bfloat16", torch.bfloat16),
                                                 ("float", torch.float32), ("auto", torch.float32)])
def test_llm_takes_vllms_dtype_strings(tiny_model_dir, dtype, expected):
    llm = LLM(model=str(tiny_model_dir), device="cpu", dtype=dtype, num_gpu_blocks=32, num_cpu_blocks=0)
    assert llm.engine.executor.dtype == expected
    assert next(llm.engine.executor.model.parameters()).dtype == expected


@pytest.mark.parametrize(("kwargs", "field"), [({"dtype": "fp16"}, "dtype"), ({"dtype": torch.int8}, "dtype"),
                                               ({"max_model_len": 0}, "max_model_len"),
                                               ({"max_model_len": -5}, "max_model_len")])
def test_llm_refuses_bad_settings_naming_the_field(tiny_model_dir, kwargs, field):
    with pytest.raises(ValueError, match=field):
        LLM(model=str(tiny_model_dir), device="cpu", num_gpu_blocks=32, num_cpu_blocks=0, **kwargs)


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"prompt_token_ids": [1, 2, 3]}, "prompt_token_ids"),  # flat: one prompt must be [[1, 2, 3]]
    ({"prompt_token_ids": [[5, 2.7]]}, "prompt_token_ids"),
    ({"prompt_token_ids": [[5, True]]}, "prompt_token_ids"),
    ({"prompt_token_ids": [["5"]]}, "prompt_token_ids"),
    ({"prompt_token_ids": [[5, 10**9]]}, "prompt_token_ids"),  # outside the vocabulary
    ({"prompt_token_ids": [[-1]]}, "prompt_token_ids"),
    ({"prompts": [3]}, "prompts"),
    ({"prompts": ["ok", None]}, "prompts"),
    ({"prompts": ["ok"], "sampling_params": SamplingParams(stop_token_ids=[10**6])}, "stop_token_ids"),
    ({"prompts": ["ok"], "sampling_params": {"temperature": 0}}, "sampling_params"),
])
def test_generate_refuses_malformed_input_naming_the_field(half_llm, kwargs, field):
    with pytest.raises(ValueError, match=field):
        half_llm.generate(**kwargs)
    assert not half_llm.engine.has_unfinished_requests()
    # Accepted spellings still work: a tuple of ids, numpy integers.
    out = half_llm.generate(prompt_token_ids=[(numpy.int64(5), 6, 7)], sampling_params=GREEDY)
    assert out[0].prompt_token_ids == [5, 6, 7]


def test_add_request_refuses_a_prompt_that_is_not_text(half_llm):
    with pytest.raises(ValueError, match="prompt"):
        half_llm.engine.add_request("x", 123, GREEDY)
    with pytest.raises(ValueError, match="sampling_params"):
        half_llm.engine.add_request("x", "hi", None)
    assert not half_llm.engine.has_unfinished_requests()


def test_stop_must_be_text(half_llm):
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=123)
    params = SamplingParams(max_tokens=3)
    params.stop = 123  # changed after construction: add_request checks again
    with pytest.raises(ValueError, match="stop"):
        half_llm.generate(["hi"], params)
