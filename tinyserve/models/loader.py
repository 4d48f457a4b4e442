"""Loading a model: from a name or a directory to tinyserve's Llama, with its weights and tokenizer.

``load_model("smollm2-135m")`` (the default model, see ``default_model``) or
``load_model("/path/to/a/hf/llama")`` returns the model, its tokenizer and its config.
``build_model`` is the one place a model is built: construct this rank's shard on the device,
cast it to the dtype, load the weights. ``load_model``, ``random_model`` (random weights, for
speed and memory checks) and the tensor-parallel ranks all go through it, and device and dtype
settings are resolved by ``config.resolve_device``/``resolve_dtype`` only.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from tinyserve.attention.backend import BackendSpec
from tinyserve.config import ModelConfig, resolve_device, resolve_dtype
from tinyserve.models.default_model import DEFAULT_MODEL, ensure_default_model
from tinyserve.models.llama import LlamaForCausalLM

__all__ = ["DEFAULT_MODEL", "LoadedModel", "build_model", "check_architecture", "check_max_model_len",
           "load_model", "max_model_len_for", "random_model", "random_state_dict", "read_hf_config",
           "read_state_dict", "resolve_model_dir", "smollm2_135m_config", "use_mlp"]


@dataclass
class LoadedModel:
    model: LlamaForCausalLM | None  # None in a tensor-parallel driver: the weights live in the ranks
    tokenizer: object  # a transformers tokenizer (None in a tensor-parallel rank)
    hf_config: object  # the transformers config the model was built from
    path: Path


def resolve_model_dir(model: str | os.PathLike) -> Path:
    """Local directory holding ``config.json``, weights and tokenizer for ``model``:
    ``"smollm2-135m"`` (converted on first use) or a local Hugging Face directory."""
    if str(model) == DEFAULT_MODEL:
        return ensure_default_model()
    path = Path(model).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path
    raise ValueError(
        f"model {str(model)!r} is neither {DEFAULT_MODEL!r} nor a local Hugging Face directory with a "
        "config.json (tinyserve never downloads from a model hub)"
    )


def check_architecture(hf_config) -> None:
    """Refuse anything but a Llama-family model, naming what was found.

    ``hf_config`` is a transformers config or the plain dict of a ``config.json`` (checked
    before transformers parses it, so even a model_type transformers does not know gets a
    clear message)."""
    get = hf_config.get if isinstance(hf_config, dict) else lambda key: getattr(hf_config, key, None)
    archs = list(get("architectures") or [])
    model_type = get("model_type")
    if model_type != "llama" and "LlamaForCausalLM" not in archs:
        raise ValueError(
            f"unsupported architecture {', '.join(archs) or '?'} (model_type {model_type!r}): "
            "tinyserve runs Llama-family models (model_type 'llama', LlamaForCausalLM)"
        )


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a HF directory: safetensors files (one or sharded) or PyTorch .bin files."""
    files = sorted(path.glob("*.safetensors"))
    if files:
        from safetensors.torch import load_file

        state: dict[str, torch.Tensor] = {}
        for f in files:
            state.update(load_file(str(f)))
        return state
    files = sorted(path.glob("pytorch_model*.bin"))
    if files:
        state = {}
        for f in files:
            state.update(torch.load(f, map_location="cpu", weights_only=True))
        return state
    raise FileNotFoundError(f"no *.safetensors or pytorch_model*.bin weights in {path}")


def read_hf_config(path: Path):
    """The transformers config of a model directory, after checking it is a Llama."""
    from transformers import AutoConfig

    check_architecture(json.loads((path / "config.json").read_text()))
    return AutoConfig.from_pretrained(str(path), local_files_only=True)


def check_max_model_len(max_model_len: int, hf_config) -> None:
    """Refuse a context limit longer than the model's position embeddings reach."""
    limit = getattr(hf_config, "max_position_embeddings", None)
    if limit is not None and max_model_len > limit:
        raise ValueError(f"max_model_len={max_model_len} is longer than the model's "
                         f"max_position_embeddings={limit}")


def max_model_len_for(model_config: ModelConfig) -> int:
    """The context limit to schedule for: ``model_config.max_model_len``, or the model's own
    (``max_position_embeddings``) when it is None. Reads the config only, never the weights."""
    hf_config = read_hf_config(resolve_model_dir(model_config.model))
    if model_config.max_model_len is None:
        return hf_config.max_position_embeddings
    check_max_model_len(model_config.max_model_len, hf_config)
    return model_config.max_model_len


def build_model(hf_config, state_dict: dict[str, torch.Tensor], device: torch.device | str = "cpu",
                dtype: torch.dtype | str = "auto", tp_rank: int = 0, tp_size: int = 1, all_reduce=None,
                attention_backend: BackendSpec = "auto",
                model_class: type[LlamaForCausalLM] = LlamaForCausalLM, mlp=None) -> LlamaForCausalLM:
    """Rank ``tp_rank``'s shard of ``hf_config``'s model on ``device``, in ``dtype``, with the
    weights of the full Hugging Face-named ``state_dict``, ready to run (eval, no grad).
    ``mlp``: build every layer's MLP with it instead (see ``use_mlp``)."""
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    with torch.device(device):  # parameters are created in place, not on the CPU and then moved
        model = model_class(hf_config, tp_rank, tp_size, all_reduce, attention_backend)
    model.to(dtype)
    model.load_weights(state_dict)
    if mlp is not None:
        use_mlp(model, state_dict, mlp)
    return model.eval().requires_grad_(False)


@torch.no_grad()
def use_mlp(model: LlamaForCausalLM, state_dict: dict[str, torch.Tensor], mlp) -> None:
    """The hook for one's own tensor-parallel MLP (chapter 10): every layer's ``mlp`` becomes
    ``mlp(gate_weight, up_weight, down_weight, tp_rank, tp_size, all_reduce, gate_bias=,
    up_bias=, down_bias=)``, an ``nn.Module`` built from the *full* weights of ``state_dict`` (on
    the model's device and dtype; biases None without ``mlp_bias``) that keeps this rank's shard.
    Its ``all_reduce(t)`` returns the sum of ``t`` over the ranks (``t`` itself when there is one)."""
    weights = {(k[len("model."):] if k.startswith("model.") else k): v for k, v in state_dict.items()}
    like = model.embed_tokens

    def full(name: str) -> torch.Tensor | None:
        w = weights.get(name)
        return None if w is None else w.to(device=like.device, dtype=like.dtype)

    for i, layer in enumerate(model.layers):
        p = f"layers.{i}.mlp."
        layer.mlp = mlp(full(p + "gate_proj.weight"), full(p + "up_proj.weight"), full(p + "down_proj.weight"),
                        model.tp_rank, model.tp_size, model._reduce, gate_bias=full(p + "gate_proj.bias"),
                        up_bias=full(p + "up_proj.bias"), down_bias=full(p + "down_proj.bias"))


def load_model(model: str | os.PathLike = DEFAULT_MODEL, device: torch.device | str = "cpu",
               dtype: torch.dtype | str = torch.float32, tp_rank: int = 0, tp_size: int = 1, all_reduce=None,
               attention_backend: BackendSpec = "auto") -> LoadedModel:
    """Load ``model`` (this rank's shard of it) with its tokenizer, ready to run."""
    from transformers import AutoTokenizer

    path = resolve_model_dir(model)
    hf_config = read_hf_config(path)
    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    llama = build_model(hf_config, read_state_dict(path), device, dtype, tp_rank, tp_size, all_reduce,
                        attention_backend)
    return LoadedModel(model=llama, tokenizer=tokenizer, hf_config=hf_config, path=path)


def smollm2_135m_config():
    """A LlamaConfig with SmolLM2-135M's shape, for random-weight runs that need no conversion."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
        rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )


def random_state_dict(hf_config, seed: int = 0) -> dict[str, torch.Tensor]:
    """Full-size random weights with Hugging Face names (the same on every rank for one seed)."""
    gen = torch.Generator().manual_seed(seed)
    std = getattr(hf_config, "initializer_range", 0.02)
    hidden, inter = hf_config.hidden_size, hf_config.intermediate_size
    head_dim = getattr(hf_config, "head_dim", None) or hidden // hf_config.num_attention_heads
    q_out = hf_config.num_attention_heads * head_dim
    kv_out = hf_config.num_key_value_heads * head_dim

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    state = {"model.embed_tokens.weight": randn(hf_config.vocab_size, hidden),
             "model.norm.weight": torch.ones(hidden)}
    for i in range(hf_config.num_hidden_layers):
        p = f"model.layers.{i}."
        state.update({
            p + "self_attn.q_proj.weight": randn(q_out, hidden),
            p + "self_attn.k_proj.weight": randn(kv_out, hidden),
            p + "self_attn.v_proj.weight": randn(kv_out, hidden),
            p + "self_attn.o_proj.weight": randn(hidden, q_out),
            p + "mlp.gate_proj.weight": randn(inter, hidden),
            p + "mlp.up_proj.weight": randn(inter, hidden),
            p + "mlp.down_proj.weight": randn(hidden, inter),
            p + "input_layernorm.weight": torch.ones(hidden),
            p + "post_attention_layernorm.weight": torch.ones(hidden),
        })
        if getattr(hf_config, "attention_bias", False):
            for name, n in (("q_proj", q_out), ("k_proj", kv_out), ("v_proj", kv_out), ("o_proj", hidden)):
                state[p + f"self_attn.{name}.bias"] = randn(n)
        if getattr(hf_config, "mlp_bias", False):
            for name, n in (("gate_proj", inter), ("up_proj", inter), ("down_proj", hidden)):
                state[p + f"mlp.{name}.bias"] = randn(n)
    if not getattr(hf_config, "tie_word_embeddings", False):
        state["lm_head.weight"] = randn(hf_config.vocab_size, hidden)
    return state


def random_model(hf_config=None, device: torch.device | str = "cpu", dtype: torch.dtype | str = torch.float32,
                 seed: int = 0, tp_rank: int = 0, tp_size: int = 1, all_reduce=None,
                 attention_backend: BackendSpec = "auto") -> LlamaForCausalLM:
    """A model of ``hf_config``'s shape (SmolLM2-135M's by default) with random weights, for
    speed and memory checks that do not care what the model says."""
    hf_config = hf_config if hf_config is not None else smollm2_135m_config()
    check_architecture(hf_config)
    return build_model(hf_config, random_state_dict(hf_config, seed), device, dtype, tp_rank, tp_size,
                       all_reduce, attention_backend)
