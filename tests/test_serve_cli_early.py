"""``python -m tinyserve.serve`` refuses the flags the model's ``config.json`` rules out before any
weights load (issue 36, N5): ``--max-model-len`` past the model's positions, a ``--block-size``
longer than the longest sequence, ``--num-gpu-blocks`` too few for one sequence, budgets the
scheduler refuses, a ``--model`` that is not a model. As argparse does: usage, the flag's name,
exit status 2.

The model here is the tiny Llama's ``config.json`` alone, no weights: reaching the loader would
fail differently. In-process, ``LLM`` (which loads the weights) is replaced by one that records
it was called; the verdicts are compared with the engine's own checks
(``CacheEngine.check_capacity``, ``check_max_model_len``, ``SchedulerConfig``).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from tinyserve.cache_engine import CacheEngine
from tinyserve.config import SchedulerConfig
from tinyserve.models.loader import check_max_model_len, read_hf_config
from tinyserve.serve import cli


@pytest.fixture(scope="module")
def config_only(tiny_model_dir, tmp_path_factory):
    """The tiny model's directory without its weights (and its max_position_embeddings)."""
    path = tmp_path_factory.mktemp("config-only")
    shutil.copy(tiny_model_dir / "config.json", path / "config.json")
    assert not list(path.glob("*.safetensors"))
    return path


@pytest.fixture(scope="module")
def positions(config_only) -> int:
    return json.loads((config_only / "config.json").read_text())["max_position_embeddings"]


def run_main(monkeypatch, capsys, model, *flags: str) -> tuple[int | None, str, list]:
    """``main``'s exit status (None when it got as far as building the engine), its stderr, and
    the calls that reached ``LLM``."""
    calls = []

    def llm(*args, **kwargs):
        calls.append((args, kwargs))
        raise RuntimeError("the weights would load now")

    monkeypatch.setattr(cli, "LLM", llm)
    monkeypatch.setattr(cli, "fit_open_files", lambda n: None)
    try:
        cli.main(["--model", str(model), "--device", "cpu", *flags])
    except SystemExit as e:
        return e.code, capsys.readouterr().err, calls
    except RuntimeError as e:
        assert "weights would load" in str(e)
        return None, capsys.readouterr().err, calls
    raise AssertionError("main returned without building an engine")


@pytest.mark.parametrize("flags,flag,words", [
    (["--num-gpu-blocks", "1"], "--num-gpu-blocks", "give at least 32 blocks"),
    (["--block-size", "100000"], "--block-size", "longer than the longest sequence (512 tokens"),
    (["--max-model-len", "100000"], "--max-model-len", "max_position_embeddings (512"),
    (["--max-model-len", "128", "--num-gpu-blocks", "7"], "--num-gpu-blocks", "112 tokens"),
    (["--max-model-len", "64", "--block-size", "128"], "--block-size", "64 tokens, --max-model-len"),
    (["--max-num-batched-tokens", "8"], "--max-num-batched-tokens", "smaller than --max-num-seqs (64)"),
])
def test_flags_the_config_refuses_exit_2_naming_the_flag_before_any_weights(monkeypatch, capsys, config_only,
                                                                             flags, flag, words):
    code, err, calls = run_main(monkeypatch, capsys, config_only, *flags)
    assert code == 2 and not calls
    assert "usage: python -m tinyserve.serve" in err
    assert f"error: argument {flag}:" in err or f"error: {flag}" in err
    assert words in err


def test_a_model_that_is_not_one_is_refused_by_name(monkeypatch, capsys, tmp_path):
    code, err, calls = run_main(monkeypatch, capsys, tmp_path / "nowhere", "--num-gpu-blocks", "64")
    assert code == 2 and not calls and "error: argument --model:" in err and "config.json" in err


@pytest.mark.parametrize("blocks,block_size,max_model_len", [
    (32, 16, None), (31, 16, None), (8, 16, 128), (7, 16, 128), (1, 512, None), (3, 5, 16), (4, 5, 16), (1, 16, 16),
])
def test_the_early_verdict_is_the_engines(monkeypatch, capsys, config_only, blocks, block_size, max_model_len):
    hf = read_hf_config(config_only)
    effective = max_model_len or hf.max_position_embeddings
    try:  # what the engine decides once the weights are in
        check_max_model_len(effective, hf)
        CacheEngine.check_capacity(blocks, block_size, effective)
        engine_accepts = True
    except ValueError:
        engine_accepts = False
    flags = ["--num-gpu-blocks", str(blocks), "--block-size", str(block_size), "--max-num-seqs", "8"]
    flags += ["--max-model-len", str(max_model_len)] if max_model_len else []
    code, err, calls = run_main(monkeypatch, capsys, config_only, *flags)
    if engine_accepts:
        assert code is None and len(calls) == 1, err  # through to the engine, with the flags as given
        assert calls[0][1]["num_gpu_blocks"] == blocks and calls[0][1]["block_size"] == block_size
    else:
        assert code == 2 and not calls and "--num-gpu-blocks" in err


def test_scheduler_budgets_agree_with_the_scheduler_config(monkeypatch, capsys, config_only, positions):
    for batched, seqs in ((8, 8), (7, 8), (600, 64), (63, 64)):
        try:
            SchedulerConfig(max_num_batched_tokens=batched, max_num_seqs=seqs, max_model_len=positions)
            accepts = True
        except ValueError:
            accepts = False
        code, err, calls = run_main(monkeypatch, capsys, config_only, "--max-num-batched-tokens", str(batched),
                                    "--max-num-seqs", str(seqs))
        assert (code is None and len(calls) == 1) if accepts else (code == 2 and not calls), (batched, seqs, err)


def test_the_command_line_refuses_in_a_subprocess_without_the_weights(config_only):
    # A real process: had it gone on to load, the missing weights would have failed it otherwise.
    done = subprocess.run([sys.executable, "-m", "tinyserve.serve", "--model", str(config_only), "--device", "cpu",
                           "--num-gpu-blocks", "1"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "error: argument --num-gpu-blocks: 1 blocks of 16 tokens" in done.stderr
    assert "Traceback" not in done.stderr
