"""Shared fixtures: a tiny random Llama saved as a Hugging Face directory, and the default model.

The tiny model (``tinyserve.models.tiny``) has its own small trained tokenizer (so it needs neither
the default model nor a download, and runs on a GPU machine that lacks the weights package) and
random weights drawn with a wide spread, so greedy decoding has clear winners rather than
near-ties that a 1e-6 difference could flip.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

# Before torch starts its OpenMP threads (see the Makefile): notebook kernels inherit it too.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# The chapters (run by test_chapters in kernels that inherit this) must never read or overwrite a
# reader's own answers in the real workspace (tinyserve.workspace): the tests get an empty one.
# dtype="auto" means float32 on every CPU here, even one with native bfloat16 (where the package
# picks bf16): the tests compare greedy tokens exactly, which only float32 keeps from drifting.
# test_dtype_auto.py checks the choice itself and bf16's parity with transformers in bf16.
os.environ["TINYSERVE_CPU_DTYPE"] = "float32"
os.environ["TINYSERVE_WORKSPACE"] = tempfile.mkdtemp(prefix="tinyserve-test-workspace-")

import pytest  # noqa: E402
import torch  # noqa: E402

# The tiny model lives in the package (the exercise checkers run it too); the tests import it from here.
from tinyserve.models.tiny import make_tiny_model_dir, make_tiny_tokenizer  # noqa: E402, F401


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
