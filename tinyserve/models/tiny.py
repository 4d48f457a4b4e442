"""A tiny random Llama with a tiny tokenizer of its own: the model the tests and the exercise
checkers run through the real engine in a fraction of a second.

Nothing is downloaded and the default model is not needed. The tokenizer is a byte-level BPE
trained on a few sentences, so any text encodes and the vocabulary stays at a few hundred
tokens. The weights are random with a wide spread (``initializer_range=0.15``), so greedy
decoding has clear winners rather than near-ties that a 1e-6 difference in an attention backend
could flip.

- ``tiny_model()``: the model in memory, as a ``LoadedModel`` a ``Worker(loaded=...)`` runs.
- ``make_tiny_model_dir(path)``: the same shape saved as a Hugging Face directory (with
  transformers' own random weights), for ``LLM(model=path)`` and for comparisons with transformers.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tinyserve.models.loader import LoadedModel, random_model

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
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>",
                                   pad_token="<|im_end|>", unk_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_config(tokenizer, **overrides):
    """A 2-layer Llama config (GQA 4:2, hidden size 64) sized to ``tokenizer``'s vocabulary."""
    from transformers import LlamaConfig

    settings = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                    initializer_range=0.15, tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
                    eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
    settings.update(overrides)
    return LlamaConfig(**settings)


def tiny_model(seed: int = 0, device: torch.device | str = "cpu", attention_backend="torch",
               **overrides) -> LoadedModel:
    """The tiny Llama in float32 on ``device``, random weights drawn from ``seed``, with its tokenizer."""
    tokenizer = make_tiny_tokenizer()
    config = tiny_config(tokenizer, **overrides)
    model = random_model(config, device=device, dtype=torch.float32, seed=seed, attention_backend=attention_backend)
    return LoadedModel(model=model, tokenizer=tokenizer, hf_config=config, path=None)


def make_tiny_model_dir(path: Path, seed: int = 0, **overrides) -> Path:
    """The tiny Llama (transformers' random weights from ``seed``) with its tokenizer, saved as a
    Hugging Face directory."""
    from transformers import LlamaForCausalLM

    tokenizer = make_tiny_tokenizer()
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_config(tokenizer, **overrides)).float()
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path), safe_serialization=True)
    tokenizer.save_pretrained(str(path))
    return path
