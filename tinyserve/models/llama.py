"""A Llama-family decoder in plain PyTorch that reads and writes a paged KV cache.

This is the model the engine runs: the same math as Hugging Face's ``LlamaForCausalLM`` (RMSNorm,
rotary position embeddings, grouped-query attention, a SwiGLU MLP), with two differences that make
it a serving model rather than a training one:

- It takes a *packed* batch: the new tokens of every scheduled sequence back to back, with their
  positions, and no padding. Attention learns where each sequence starts and which cache blocks
  hold its past from ``AttentionMetadata``.
- Past keys and values live in the paged cache. Each layer stores its new K/V through the slot
  mapping and lets the attention backend read the whole context back through the block tables.

It is written tensor-parallel-ready (Megatron-style). With ``tp_size`` ranks, each rank holds
``1/tp_size`` of the attention heads, KV heads and MLP columns: q/k/v and gate/up are split by
output rows (column-parallel), o_proj and down_proj by input columns (row-parallel), and the
partial outputs of the row-parallel layers are summed across ranks with ``all_reduce``. That is
two all-reduces per layer and no other communication. Embeddings and the LM head are replicated.
``sharding.py`` has the arithmetic of the split, ``rotary.py`` the position embeddings.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tinyserve.attention.backend import AttentionBackend, BackendSpec, check_backend, get_backend
from tinyserve.attention.metadata import AttentionMetadata
from tinyserve.attention.opaque import paged_attention
from tinyserve.models.packed_linear import packed_linear
from tinyserve.models.rotary import RotaryEmbedding, apply_rotary, rope_settings
from tinyserve.models.sharding import check_shardable, column_shard, row_shard

AllReduce = Callable[[torch.Tensor], object]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in float32 even for half inputs, as the reference implementation does.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Linear(nn.Module):
    """``y = x W^T + b`` with uninitialized weights: they are always loaded or set afterwards,
    and nn.Linear's random init of a 135M-parameter model would cost a second for nothing."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.packed: int | None = None  # a handle of models/packed_linear.py, once packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # >>> chapter 11: weights packed for oneDNN
        if self.packed is not None:
            return packed_linear(x, self.packed)
        # <<<
        return F.linear(x, self.weight, self.bias)


class LlamaAttention(nn.Module):
    def __init__(self, config, tp_size: int, reduce: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.num_heads = config.num_attention_heads // tp_size
        self.num_kv_heads = config.num_key_value_heads // tp_size
        self.scale = self.head_dim**-0.5
        self.layer_index = 0  # set by the model: the compiled path finds its cache by it
        bias = bool(getattr(config, "attention_bias", False))
        # q, k and v of this rank's heads in one matmul.
        self.qkv_proj = Linear(config.hidden_size, (self.num_heads + 2 * self.num_kv_heads) * self.head_dim, bias)
        # Row-parallel: the bias is added once, after the partial outputs are summed.
        self.o_proj = Linear(self.num_heads * self.head_dim, config.hidden_size)
        self.o_bias = nn.Parameter(torch.empty(config.hidden_size)) if bias else None
        self.reduce = reduce

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata | None,
                backend: AttentionBackend | None) -> torch.Tensor:
        tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        num_qk = self.num_heads + self.num_kv_heads
        # q and k are rotated together, in one pass over their heads.
        qk = apply_rotary(qkv[:, : num_qk * self.head_dim].view(tokens, num_qk, self.head_dim), cos, sin)
        # Contiguous, so a backend's kernels may assume the plain [T, heads, head_dim] strides.
        q, k = (t.contiguous() for t in qk.split([self.num_heads, self.num_kv_heads], dim=1))
        v = qkv[:, num_qk * self.head_dim:].reshape(tokens, self.num_kv_heads, self.head_dim).contiguous()
        if meta is not None:
            backend.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
            out = backend.forward(q, k_cache, v_cache, meta, self.scale)
        # >>> chapter 11: compiled decode steps
        else:  # inside a compiled graph: attention is one opaque op (attention/opaque.py)
            out = paged_attention(q, k, v, self.layer_index, self.scale)
        # <<<
        out = self.reduce(self.o_proj(out.reshape(tokens, self.num_heads * self.head_dim)))
        return out if self.o_bias is None else out + self.o_bias


class LlamaMLP(nn.Module):
    def __init__(self, config, tp_size: int, reduce: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (Llama uses silu)")
        self.intermediate = config.intermediate_size // tp_size
        bias = bool(getattr(config, "mlp_bias", False))
        self.gate_up_proj = Linear(config.hidden_size, 2 * self.intermediate, bias)
        self.down_proj = Linear(self.intermediate, config.hidden_size)
        self.down_bias = nn.Parameter(torch.empty(config.hidden_size)) if bias else None
        self.reduce = reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        out = self.reduce(self.down_proj(F.silu(gate) * up))
        return out if self.down_bias is None else out + self.down_bias


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, tp_size: int, reduce: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, tp_size, reduce)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config, tp_size, reduce)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata | None,
                backend: AttentionBackend | None) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, k_cache, v_cache, meta, backend)
        return h + self.mlp(self.post_attention_layernorm(h))


def _fill(fused: torch.Tensor, *parts: torch.Tensor) -> None:
    """Copy ``parts`` into consecutive rows of a fused weight (no concatenated temporary)."""
    if sum(part.shape[0] for part in parts) != fused.shape[0]:
        raise ValueError(f"shard rows {[part.shape[0] for part in parts]} do not fill {tuple(fused.shape)}")
    start = 0
    for part in parts:
        fused[start:start + part.shape[0]].copy_(part)
        start += part.shape[0]


class LlamaForCausalLM(nn.Module):
    """A Llama decoder over a paged KV cache; this rank's shard when ``tp_size > 1``.

    ``config`` is a transformers ``LlamaConfig`` (or any object with the same fields).
    ``all_reduce(tensor)`` must sum ``tensor`` over the ranks, in place like
    ``torch.distributed.all_reduce`` or by returning the sum.
    """

    def __init__(self, config, tp_rank: int = 0, tp_size: int = 1, all_reduce: AllReduce | None = None,
                 attention_backend: BackendSpec = "auto") -> None:
        super().__init__()
        check_shardable(config, tp_size)
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank={tp_rank} is outside [0, {tp_size})")
        if tp_size > 1 and all_reduce is None:
            raise ValueError("tensor parallelism (tp_size > 1) needs an all_reduce function")
        self.config = config
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self._all_reduce = all_reduce
        self.attention_backend = check_backend(attention_backend)
        self._backend: AttentionBackend | None = None

        self.vocab_size = config.vocab_size
        self.hidden_size = config.hidden_size
        self.num_layers = config.num_hidden_layers
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.num_heads = config.num_attention_heads // tp_size  # on this rank
        self.num_kv_heads = config.num_key_value_heads // tp_size  # on this rank: the cache's width
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))

        self.embed_tokens = nn.Parameter(torch.empty(config.vocab_size, config.hidden_size))
        theta, scaling = rope_settings(config)
        self.rotary = RotaryEmbedding(self.head_dim, config.max_position_embeddings, theta, scaling)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, tp_size, self._reduce) for _ in range(config.num_hidden_layers)
        )
        for i, layer in enumerate(self.layers):
            layer.self_attn.layer_index = i
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = None if self.tie_word_embeddings else nn.Parameter(
            torch.empty(config.vocab_size, config.hidden_size)
        )
        self.packed_head: int | None = None  # the LM head packed (models/packed_linear.py)

    def _reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return x
        out = self._all_reduce(x)
        return out if isinstance(out, torch.Tensor) else x

    def set_attention_backend(self, backend: BackendSpec) -> None:
        """Switch backends (a name, see ``attention.backend``, or a backend object) without
        reloading the weights."""
        self.attention_backend = check_backend(backend)
        self._backend = None

    @property
    def backend(self) -> AttentionBackend:
        # Chosen on first use, once the model's device is final ("auto" depends on it).
        if self._backend is None:
            self._backend = get_backend(self.attention_backend, self.embed_tokens.device)
        return self._backend

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None,
                meta: AttentionMetadata | None) -> torch.Tensor:
        """Final (normed) hidden states ``[T, hidden_size]`` of a packed batch of ``T`` tokens.

        Stores every token's K/V into ``kv_caches`` (one ``(k_cache, v_cache)`` per layer) at
        ``meta.slot_mapping`` before attending, so a sequence's later steps can read it. With
        ``meta=None`` attention is the opaque op of ``attention/opaque.py``, which finds the step's
        metadata and caches in its ``step_context`` (``kv_caches`` is then ignored): that is how
        a compiled graph runs the model.
        """
        # >>> chapter 11: compiled decode steps
        if meta is None:  # the opaque op finds each layer's caches itself
            kv_caches = [(None, None)] * self.num_layers
        # <<<
        # >>> fold: validation: one cache pair per layer
        if len(kv_caches) != self.num_layers:
            raise ValueError(f"expected {self.num_layers} (k_cache, v_cache) pairs, got {len(kv_caches)}")
        # <<<
        backend = None if meta is None else self.backend
        cos, sin = self.rotary(positions)
        h = F.embedding(input_ids, self.embed_tokens)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            h = layer(h, cos, sin, k_cache, v_cache, meta, backend)
        return self.norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 next-token logits ``[T, vocab_size]``; pass only the rows you sample from."""
        # >>> chapter 11: weights packed for oneDNN
        if self.packed_head is not None:
            return packed_linear(hidden, self.packed_head).float()
        # <<<
        return F.linear(hidden, self.head_weight).float()

    @property
    def head_weight(self) -> torch.Tensor:
        """The LM head's weight: the embedding when the two are tied."""
        return self.embed_tokens if self.lm_head is None else self.lm_head

    @torch.no_grad()
    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load a full Hugging Face-named state dict, keeping this rank's shard of each weight."""
        weights = {(k[len("model."):] if k.startswith("model.") else k): v for k, v in state_dict.items()}
        used: set[str] = set()

        def take(name: str) -> torch.Tensor:
            # >>> fold: ValueError: a missing weight
            if name not in weights:
                raise ValueError(f"weight {name!r} is missing from the state dict")
            # <<<
            used.add(name)
            return weights[name]

        def rows(name: str) -> torch.Tensor:  # column-parallel: this rank's block of output rows
            return column_shard(take(name), self.tp_rank, self.tp_size)

        def cols(name: str) -> torch.Tensor:  # row-parallel: this rank's block of input columns
            return row_shard(take(name), self.tp_rank, self.tp_size)

        if self.lm_head is None and "embed_tokens.weight" not in weights and "lm_head.weight" in weights:
            weights["embed_tokens.weight"] = weights.pop("lm_head.weight")  # tied, saved as the head
        self.embed_tokens.copy_(take("embed_tokens.weight"))
        for i, layer in enumerate(self.layers):
            p = f"layers.{i}."
            attn, mlp = layer.self_attn, layer.mlp
            _fill(attn.qkv_proj.weight, rows(p + "self_attn.q_proj.weight"),
                  rows(p + "self_attn.k_proj.weight"), rows(p + "self_attn.v_proj.weight"))
            attn.o_proj.weight.copy_(cols(p + "self_attn.o_proj.weight"))
            if attn.o_bias is not None:
                _fill(attn.qkv_proj.bias, rows(p + "self_attn.q_proj.bias"),
                      rows(p + "self_attn.k_proj.bias"), rows(p + "self_attn.v_proj.bias"))
                attn.o_bias.copy_(take(p + "self_attn.o_proj.bias"))
            _fill(mlp.gate_up_proj.weight, rows(p + "mlp.gate_proj.weight"),
                  rows(p + "mlp.up_proj.weight"))
            mlp.down_proj.weight.copy_(cols(p + "mlp.down_proj.weight"))
            if mlp.down_bias is not None:
                _fill(mlp.gate_up_proj.bias, rows(p + "mlp.gate_proj.bias"),
                      rows(p + "mlp.up_proj.bias"))
                mlp.down_bias.copy_(take(p + "mlp.down_proj.bias"))
            layer.input_layernorm.weight.copy_(take(p + "input_layernorm.weight"))
            layer.post_attention_layernorm.weight.copy_(take(p + "post_attention_layernorm.weight"))
        self.norm.weight.copy_(take("norm.weight"))
        if self.lm_head is not None:
            self.lm_head.copy_(take("lm_head.weight"))
        else:
            used.add("lm_head.weight")  # a tied checkpoint may still list it; it equals the embedding

        unexpected = sorted(k for k in weights if k not in used and "rotary_emb" not in k)
        # >>> fold: ValueError: weights the model has no place for
        if unexpected:
            raise ValueError(f"unexpected weights in the state dict: {unexpected[:5]}")
        # <<<
