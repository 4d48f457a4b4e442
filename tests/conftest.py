"""Shared fixtures: a tiny random Llama saved as a Hugging Face directory, and the default model.

The tiny model borrows the default model's tokenizer (so text round-trips) and has random
weights drawn with a wide spread, so greedy decoding has clear winners rather than near-ties
that a 1e-6 difference could flip.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


def make_tiny_model_dir(path: Path, seed: int = 0, **overrides) -> Path:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from tinyserve.models.loader import resolve_model_dir

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_dir("smollm2-135m")), local_files_only=True)
    settings = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                    initializer_range=0.15, tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
                    eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
    settings.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**settings)).float()
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path), safe_serialization=True)
    tokenizer.save_pretrained(str(path))
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_loaded(tiny_model_dir: Path):
    from tinyserve.models.loader import load_model

    return load_model(tiny_model_dir, device="cpu", dtype=torch.float32)


@pytest.fixture(scope="session")
def smollm2_loaded():
    from tinyserve.models.loader import load_model

    return load_model("smollm2-135m", device="cpu", dtype=torch.float32)
