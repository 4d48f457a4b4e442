"""tinyserve's paged Llama against transformers' LlamaForCausalLM on tiny random configs.

Each test prefills a packed batch of prompts through the paged cache (blocks handed out in a
shuffled order), then decodes token by token, and compares every logit row with transformers
running the whole sequence densely.
"""

from __future__ import annotations

import math
import random
import threading

import pytest
import torch
from transformers import LlamaConfig
from transformers import LlamaForCausalLM as HFLlama

from tinyserve.attention.metadata import AttentionMetadata
from tinyserve.models.llama import LlamaForCausalLM

ATOL = 1e-4

CONFIGS = {
    "mha-untied": dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False),
    "gqa2-tied": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    # Llama 3.1 scaling with a short original context, so all three frequency bands are in use.
    "gqa4-llama3-rope": dict(
        num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=False, rope_theta=10000.0,
        rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
    ),
    "gqa2-linear-rope-bias": dict(
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, rope_theta=500.0,
        rope_scaling={"rope_type": "linear", "factor": 2.0}, attention_bias=True, mlp_bias=True,
    ),
}


def make_hf(variant: str, seed: int = 0) -> HFLlama:
    config = LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=2, head_dim=16,
        max_position_embeddings=128, rms_norm_eps=1e-6, initializer_range=0.1,
        attn_implementation="eager", **CONFIGS[variant],
    )
    torch.manual_seed(seed)
    model = HFLlama(config).eval()
    with torch.no_grad():  # HF zero-inits biases and ones-inits norms; randomize them so they count
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def make_tinyserve(hf: HFLlama, **kwargs) -> LlamaForCausalLM:
    model = LlamaForCausalLM(hf.config, **kwargs)
    model.load_weights(hf.state_dict())
    return model.eval()


class PagedRun:
    """Block tables and slots for a few sequences over a cache whose blocks come shuffled."""

    def __init__(self, model: LlamaForCausalLM, block_size: int, num_blocks: int = 64, seed: int = 0):
        self.block_size = block_size
        shape = (num_blocks, block_size, model.num_kv_heads, model.head_dim)
        # NaN outside what the model has written: a read outside a sequence's blocks shows up.
        self.caches = [(torch.full(shape, float("nan")), torch.full(shape, float("nan")))
                       for _ in range(model.num_layers)]
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def step(self, model: LlamaForCausalLM, new_tokens: dict[int, list[int]]) -> torch.Tensor:
        """Run the new tokens of each sequence as one packed batch; returns logits per token."""
        ids, positions, slots, q_lens, ctx_lens, tables = [], [], [], [], [], []
        for seq, toks in new_tokens.items():
            start = self.lens.get(seq, 0)
            end = start + len(toks)
            table = self.tables.setdefault(seq, [])
            while len(table) * self.block_size < end:
                table.append(self.free.pop())
            for pos in range(start, end):
                slots.append(table[pos // self.block_size] * self.block_size + pos % self.block_size)
            ids += toks
            positions += range(start, end)
            q_lens.append(len(toks))
            ctx_lens.append(end)
            tables.append(list(table))
            self.lens[seq] = end
        meta = AttentionMetadata.build(q_lens, ctx_lens, tables, slots)
        with torch.no_grad():
            hidden = model(torch.tensor(ids), torch.tensor(positions), self.caches, meta)
            return model.compute_logits(hidden)


def hf_logits(hf: HFLlama, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


def prefill_then_decode(model, hf, prompts, block_size, steps):
    run = PagedRun(model, block_size)
    logits = run.step(model, dict(enumerate(prompts)))
    seqs = [list(p) for p in prompts]
    got = [[] for _ in prompts]
    start = 0
    for i, p in enumerate(prompts):
        got[i].append(logits[start:start + len(p)])
        start += len(p)
    for _ in range(steps):
        for i, seq in enumerate(seqs):
            seq.append(int(got[i][-1][-1].argmax()))
        logits = run.step(model, {i: [seq[-1]] for i, seq in enumerate(seqs)})
        for i in range(len(seqs)):
            got[i].append(logits[i:i + 1])
    return seqs, [torch.cat(g) for g in got]


@pytest.mark.parametrize("variant", list(CONFIGS))
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_prefill_and_decode_match_transformers(variant, block_size):
    hf = make_hf(variant)
    model = make_tinyserve(hf)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 96, (n,), generator=gen).tolist() for n in (5, 11, 3)]
    seqs, got = prefill_then_decode(model, hf, prompts, block_size, steps=6)
    for seq, logits in zip(seqs, got):
        # Every row: the prompt's prefill positions, then one per decode step.
        want = hf_logits(hf, seq)
        assert logits.shape == want.shape == (len(seq), 96)
        assert want.std() > 0.5  # logits big enough that 1e-4 is a real test
        torch.testing.assert_close(logits, want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_prefill_over_cached_prefix_in_a_mixed_batch(block_size):
    hf = make_hf("gqa2-tied", seed=3)
    model = make_tinyserve(hf)
    gen = torch.Generator().manual_seed(2)
    a, b, c = (torch.randint(0, 96, (n,), generator=gen).tolist() for n in (13, 6, 9))
    run = PagedRun(model, block_size, seed=5)
    run.step(model, {0: a[:6], 1: b})  # the first half of a, and all of b
    # One batch: the second half of a over its cached prefix, a decode of b, a fresh prefill of c.
    logits = run.step(model, {0: a[6:], 1: [7], 2: c})
    torch.testing.assert_close(logits[:7], hf_logits(hf, a)[6:], atol=ATOL, rtol=0)
    torch.testing.assert_close(logits[7], hf_logits(hf, b + [7])[-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(logits[8:], hf_logits(hf, c), atol=ATOL, rtol=0)


def test_greedy_tokens_match_transformers_generate():
    hf = make_hf("gqa4-llama3-rope", seed=4)
    model = make_tinyserve(hf)
    prompt = [5, 17, 33, 2, 80, 41, 9]
    seqs, _ = prefill_then_decode(model, hf, [prompt], block_size=4, steps=10)
    hf.generation_config.eos_token_id = None  # a random model may well "say" token 2
    hf.generation_config.pad_token_id = 0
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=11, do_sample=False,
                          attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    # prefill_then_decode appends one token per step after the prefill's: 10 decode steps
    # consume 10 tokens; generate's 11th is the argmax of our last logits row.
    assert seqs[0] == out[0, : len(prompt) + 10].tolist()


def test_tensor_parallel_shards_match_one_rank():
    """Two ranks as two threads, summing partial outputs through a barrier: the sharding of
    q/k/v, gate/up (by rows) and o/down (by columns) must reproduce the unsharded model."""
    hf = make_hf("gqa2-tied", seed=6)
    tp = 2
    barrier = threading.Barrier(tp)
    slots: list[torch.Tensor | None] = [None] * tp

    def make_all_reduce(rank):
        def all_reduce(t: torch.Tensor) -> None:
            slots[rank] = t.clone()
            barrier.wait()
            total = sum(slots)
            barrier.wait()  # everyone has read the slots before the next call refills them
            t.copy_(total)
        return all_reduce

    models = [make_tinyserve(hf, tp_rank=r, tp_size=tp, all_reduce=make_all_reduce(r)) for r in range(tp)]
    assert models[0].num_heads == 2 and models[0].num_kv_heads == 1
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8]]
    results: list = [None] * tp

    def work(rank):
        torch.set_num_threads(1)
        results[rank] = prefill_then_decode(models[rank], hf, prompts, block_size=4, steps=3)

    threads = [threading.Thread(target=work, args=(r,)) for r in range(tp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    single = prefill_then_decode(make_tinyserve(hf), hf, prompts, block_size=4, steps=3)
    for seqs, logits in results:
        assert seqs == single[0]
        for got, want in zip(logits, single[1]):
            torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_indivisible_tensor_parallel_is_rejected():
    # The model refuses with the same rule and message as the tensor-parallel driver (sharding.py).
    config = make_hf("gqa2-tied").config  # 4 heads, 2 KV heads
    with pytest.raises(ValueError, match="tensor_parallel_size=4 is larger than the model's 2 KV heads"):
        LlamaForCausalLM(config, tp_rank=0, tp_size=4, all_reduce=lambda t: t)
    odd = LlamaConfig(vocab_size=32, hidden_size=48, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=6, num_key_value_heads=3, max_position_embeddings=32)
    with pytest.raises(ValueError, match="num_key_value_heads=3 is not divisible by tensor_parallel_size=2"):
        LlamaForCausalLM(odd, tp_rank=0, tp_size=2, all_reduce=lambda t: t)


def test_missing_and_unexpected_weights_are_named():
    hf = make_hf("mha-untied")
    model = LlamaForCausalLM(hf.config)
    sd = dict(hf.state_dict())
    del sd["lm_head.weight"]
    with pytest.raises(ValueError, match="lm_head.weight"):
        model.load_weights(sd)
    sd = dict(hf.state_dict(), **{"model.layers.9.mlp.up_proj.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match="layers.9.mlp.up_proj.weight"):
        model.load_weights(sd)


def test_unsupported_rope_scaling_is_named():
    config = make_hf("mha-untied").config
    config.rope_parameters = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}
    with pytest.raises(ValueError, match="yarn"):
        LlamaForCausalLM(config)


def test_rope_inv_freq_llama3_bands():
    # Independent check of the Llama 3.1 rule on hand-picked wavelengths.
    from tinyserve.models.rotary import rope_inv_freq

    inv = rope_inv_freq(16, 10000.0, {"rope_type": "default"})
    scaled = rope_inv_freq(16, 10000.0, {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
    for f, s in zip(inv.tolist(), scaled.tolist()):
        wavelen = 2 * math.pi / f
        if wavelen < 32 / 4:  # short wavelengths (fast pairs) are untouched
            assert s == pytest.approx(f)
        elif wavelen > 32 / 1:  # long ones are interpolated by the factor
            assert s == pytest.approx(f / 4)
        else:
            assert f / 4 < s < f
