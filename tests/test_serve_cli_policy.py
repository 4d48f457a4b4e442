"""``python -m tinyserve.serve --policy``: the flag parses and reaches the engine's SchedulerConfig.

``main`` runs as the command line does, on the tiny random Llama, with uvicorn replaced by a
function that keeps the app it was given: the engine behind it is the one the flags built.
"""

from __future__ import annotations

import pytest

from tinyserve.config import POLICIES
from tinyserve.serve import cli


def engine_from_flags(monkeypatch, model_dir, *flags: str):
    """The LLMEngine ``main`` builds from ``flags`` (no server is started)."""
    built = {}

    def keep_engine(engine, name, settings=None):
        built["engine"] = engine
        return object()

    monkeypatch.setattr(cli, "create_app", keep_engine)
    monkeypatch.setattr(cli.uvicorn, "run", lambda app, **options: None)
    cli.main(["--model", str(model_dir), "--device", "cpu", "--max-model-len", "128", "--num-gpu-blocks", "16",
              "--log-level", "warning", *flags])
    return built["engine"]


def test_policy_flag_parses_with_the_configs_choices():
    p = cli.parser()
    assert p.parse_args([]).policy == "vllm"
    for policy in POLICIES:
        assert p.parse_args(["--policy", policy]).policy == policy
    with pytest.raises(SystemExit):
        p.parse_args(["--policy", "fcfs"])


def test_feature_switches_are_unset_on_or_off():
    p = cli.parser()
    args = p.parse_args([])
    assert args.enable_prefix_caching is None and args.enable_chunked_prefill is None
    args = p.parse_args(["--enable-prefix-caching", "--no-enable-chunked-prefill"])
    assert args.enable_prefix_caching is True and args.enable_chunked_prefill is False
    options = cli.engine_options(p.parse_args(["--policy", "orca"]))
    assert options["policy"] == "orca"
    assert "enable_prefix_caching" not in options and "enable_chunked_prefill" not in options  # the policy decides


def test_policy_and_switches_reach_the_engines_scheduler_config(monkeypatch, tiny_model_dir):
    engine = engine_from_flags(monkeypatch, tiny_model_dir, "--policy", "orca", "--enable-chunked-prefill")
    assert engine.scheduler_config.policy == "orca"
    assert engine.scheduler_config.enable_chunked_prefill is True
    assert engine.cache_config.enable_prefix_caching is False
    engine = engine_from_flags(monkeypatch, tiny_model_dir)
    assert engine.scheduler_config.policy == "vllm" and engine.scheduler_config.enable_chunked_prefill is False


def test_v1_turns_both_features_on_unless_told_otherwise(monkeypatch, tiny_model_dir):
    engine = engine_from_flags(monkeypatch, tiny_model_dir, "--policy", "v1")
    assert engine.scheduler_config.policy == "v1"
    assert engine.scheduler_config.enable_chunked_prefill is True and engine.cache_config.enable_prefix_caching is True
    engine = engine_from_flags(monkeypatch, tiny_model_dir, "--policy", "v1", "--no-enable-prefix-caching")
    assert engine.cache_config.enable_prefix_caching is False



def test_no_enforce_eager_compiles_every_size_before_the_server_answers(monkeypatch, tiny_model_dir, capfd):
    """``--no-enforce-eager`` reaches ModelConfig and the graphs of every capture size exist
    before uvicorn is called, each announced on stderr; without the flag a CPU engine is eager."""
    engine = engine_from_flags(monkeypatch, tiny_model_dir, "--no-enforce-eager", "--max-num-seqs", "4",
                               "--dtype", "float32")
    assert engine.model_config.enforce_eager is False
    graphs = engine.executor.decode_graphs
    assert sorted(graphs.compile_seconds) == [1, 2, 4]
    err = capfd.readouterr().err
    assert all(f"compiling the decode step for batch size {s}" in err for s in (1, 2, 4))
    engine = engine_from_flags(monkeypatch, tiny_model_dir)
    assert engine.model_config.enforce_eager is None and engine.executor.decode_graphs is None
    assert "enforce_eager" not in cli.engine_options(cli.parser().parse_args([]))
