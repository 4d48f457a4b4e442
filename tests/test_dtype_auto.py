"""What dtype="auto" picks on a CPU, and what bfloat16 must agree on.

"auto" is bfloat16 on a CPU that computes it natively (AVX-512 BF16 or AMX) and float32 where
bf16 would be emulated (``config.NATIVE_BF16_FLAGS``); ``$TINYSERVE_CPU_DTYPE`` overrides it
(conftest sets float32 for every other test).

Greedy bf16 outputs cannot match float32's, nor even transformers' bf16 token for token: the two
round differently (fused q/k/v and gate/up matmuls, a packed batch), and a near-tie between the
top two logits can go either way. The agreement required is therefore: the two bf16 streams are
equal until a position where float32's top two logits are closer than bfloat16's own error there
(transformers' bf16 logits against its float32 ones, at most over the text); past that point
they are different continuations and are not compared.
"""

from __future__ import annotations

import pytest
import torch

from tinyserve import config
from tinyserve.config import CPU_DTYPE_ENV, cpu_flags, resolve_dtype


def test_cpu_flags_reads_the_kernels_flags_line(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx2 avx512f avx512_bf16\n\n"
                    "processor\t: 1\nflags\t\t: fpu\n")
    assert cpu_flags(str(info)) == {"fpu", "avx2", "avx512f", "avx512_bf16"}
    assert cpu_flags(str(tmp_path / "missing")) == set()


@pytest.mark.parametrize(("native", "expected"), [(True, torch.bfloat16), (False, torch.float32)])
def test_auto_is_bfloat16_only_where_the_cpu_computes_it(monkeypatch, native, expected):
    monkeypatch.delenv(CPU_DTYPE_ENV, raising=False)
    monkeypatch.setattr(config, "cpu_has_native_bf16", lambda: native)
    assert resolve_dtype("auto", "cpu") is expected
    assert resolve_dtype("float32", "cpu") is torch.float32  # an explicit dtype is never changed
    assert resolve_dtype("bfloat16", "cpu") is torch.bfloat16


def test_this_machines_choice_follows_its_flags(monkeypatch):
    monkeypatch.delenv(CPU_DTYPE_ENV, raising=False)
    native = bool(cpu_flags() & set(config.NATIVE_BF16_FLAGS))
    assert resolve_dtype("auto", "cpu") is (torch.bfloat16 if native else torch.float32)


def test_the_environment_overrides_auto_and_a_bad_name_is_refused(monkeypatch):
    monkeypatch.setattr(config, "cpu_has_native_bf16", lambda: False)
    monkeypatch.setenv(CPU_DTYPE_ENV, "bfloat16")
    assert resolve_dtype("auto", "cpu") is torch.bfloat16
    assert resolve_dtype("float32", "cpu") is torch.float32
    monkeypatch.setenv(CPU_DTYPE_ENV, "int8")
    with pytest.raises(ValueError, match=CPU_DTYPE_ENV):
        resolve_dtype("auto", "cpu")


def test_bfloat16_greedy_agrees_with_transformers_bfloat16_up_to_a_near_tie():
    from tinyserve import LLM, SamplingParams, presets
    from tinyserve.lab import perf

    llm = LLM(dtype="bfloat16", device="cpu", num_gpu_blocks=64, num_cpu_blocks=0, max_model_len=256)
    assert llm.engine.executor.dtype is torch.bfloat16
    outs = llm.generate(list(presets.SEED_PROMPTS.values()), SamplingParams(temperature=0.0, max_tokens=16))
    hf16 = perf.load_hf_model("smollm2-135m", dtype=torch.bfloat16)
    hf32 = perf.load_hf_model("smollm2-135m", dtype=torch.float32)
    compared = 0
    for out in outs:
        prompt, ours = list(out.prompt_token_ids), list(out.outputs[0].token_ids)
        ids = torch.tensor([prompt])
        with torch.no_grad():
            theirs = hf16.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                                   pad_token_id=0)[0, len(prompt):].tolist()
        part = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
        if part is None:
            assert ours == theirs
            compared += len(ours)
            continue
        text = torch.tensor([prompt + ours[:part]])
        with torch.no_grad():
            l32, l16 = hf32(text).logits[0].float(), hf16(text).logits[0].float()
        bf16_error = (l16 - l32).abs().max().item()
        top2 = l32[-1].topk(2).values
        gap = (top2[0] - top2[1]).item()
        assert gap < bf16_error, (f"{out.request_id}: parts from transformers' bf16 at token {part}, where "
                                  f"float32's top two logits are {gap:.3f} apart (bf16's error: {bf16_error:.3f})")
        compared += part
    assert compared >= 16  # the rule must not pass by parting at once everywhere
