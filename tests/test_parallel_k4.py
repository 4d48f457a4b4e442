"""Tensor parallelism with k=4 on the CPU: four worker processes must compute what one rank does.

The source story's example is "Tensor Parallel = 4". This runs it for real on a tiny random Llama
with 4 heads and 4 KV heads, so each rank holds one head, one KV head and a quarter of every MLP.
The reference is an in-process k=1 engine on the same weights, which shares no code path with the
sharding, the process group or the executor. One module-scoped k=4 engine serves every test,
because starting four processes costs seconds on a 2-core machine.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import make_tiny_model_dir

from tinyserve import LLM, SamplingParams
from tinyserve.sequence import SamplingParams as SP
from tinyserve.sequence import Sequence, SequenceGroupMetadata

K = 4
ATOL = 1e-5
PROMPTS = ["Hello, my name is", "The future of AI is", "The life is", "Paged attention keeps"]
CACHE = dict(device="cpu", dtype="float32", block_size=4, num_gpu_blocks=64, num_cpu_blocks=0, max_model_len=64)


@pytest.fixture(scope="module")
def four_kv_heads_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # hidden 64 = 4 heads of 16; intermediate 128 splits into 4 x 32.
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-k4"), seed=4, num_attention_heads=4,
                               num_key_value_heads=4)


@pytest.fixture(scope="module")
def engines(four_kv_heads_dir):
    one = LLM(model=str(four_kv_heads_dir), **CACHE)
    four = LLM(model=str(four_kv_heads_dir), tensor_parallel_size=K, **CACHE)
    yield one, four
    four.engine.executor.shutdown()


def test_each_of_four_ranks_holds_a_quarter(engines):
    _, four = engines
    info = four.engine.executor.rank_info
    assert [i["rank"] for i in info] == list(range(K))
    assert [(i["num_heads"], i["num_kv_heads"]) for i in info] == [(1, 1)] * K
    assert len({i["pid"] for i in info}) == K  # four separate processes


def test_k4_generates_the_tokens_of_k1(engines):
    one, four = engines
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in one.generate(PROMPTS, greedy)]
    got = [o.outputs[0].token_ids for o in four.generate(PROMPTS, greedy)]
    assert all(len(t) == 10 for t in want)
    assert got == want


def test_k4_logits_match_k1_through_prefill_and_decode(engines):
    one, four = engines
    tok = one.tokenizer
    seqs = [Sequence(i, p, tok.encode(p), 4) for i, p in enumerate(PROMPTS)]
    # Enough blocks for each prompt and three more tokens, numbered so that tables interleave.
    need = [-(-(s.get_len() + 3) // 4) for s in seqs]
    tables = {i: [j * len(seqs) + i for j in range(n)] for i, n in enumerate(need)}
    for step in range(4):  # a packed prefill of the four prompts, then three decode rounds
        groups = [SequenceGroupMetadata(f"r{i}", step == 0, {i: s}, SP(temperature=0.0), {i: tables[i]},
                                        token_chunk_size=s.get_len() - s.num_computed_tokens)
                  for i, s in enumerate(seqs)]
        want = one.engine.executor.execute_model(groups, {}, {}, {})
        got = four.engine.executor.execute_model(groups, {}, {}, {})
        assert got.shape == want.shape == (len(seqs), one.engine.executor.loaded.hf_config.vocab_size)
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
        for s, row in zip(seqs, want):
            s.num_computed_tokens = s.get_len()
            s.append_token_id(int(row.argmax()))
