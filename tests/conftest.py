"""Shared fixtures: a tiny random Llama saved as a Hugging Face directory, and the default model.

The tiny model has its own small trained tokenizer (so it needs neither the default model nor a
download, and runs on a GPU machine that lacks the weights package) and random weights drawn
with a wide spread, so greedy decoding has clear winners rather than near-ties
that a 1e-6 difference could flip.
"""

from __future__ import annotations

import os
from pathlib import Path

# Before torch starts its OpenMP threads (see the Makefile): notebook kernels inherit it too.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

CORPUS = [
    "Hello, my name is", "The future of AI is", "The life is", "List three colors: red, green, blue.",
    "In a small village by the sea, an old fisherman mended his nets every morning.",
    "Paging the KV cache into fixed-size blocks lets a server run many more requests at once.",
    "You are a helpful assistant. Answer briefly and clearly.", "What is the capital of France?",
    "0123456789 The quick brown fox jumps over the lazy dog.",
]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def make_tiny_tokenizer():
    """A byte-level BPE tokenizer trained on a few sentences: any text encodes, nothing is downloaded,
    and the tiny model's vocabulary stays small."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>",
                                   pad_token="<|im_end|>", unk_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_tiny_model_dir(path: Path, seed: int = 0, **overrides) -> Path:
    """A 2-layer random Llama (GQA 4:2) with the tiny tokenizer, saved as a Hugging Face directory."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = make_tiny_tokenizer()
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
