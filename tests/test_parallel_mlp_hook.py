"""The hook for one's own tensor-parallel MLP (chapter 10): ``build_model(mlp=)`` and
``TensorParallelExecutor(mlp=)`` build every layer's MLP, on every rank, with the given class.

References are the package's own model: in one process the reader's MLP must give each rank's
partial output bit for bit like the package's ``LlamaMLP``; in a real 2-rank run (two processes,
gloo) the chapter's solution, loaded from a saved workspace, must give the greedy tokens of the
unsharded model, and a wrong MLP must not (so the ranks really used the class they were given).
"""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_model_dir
from safetensors.torch import load_file, save_file

from tinyserve import LLM, SamplingParams
from tinyserve.config import ModelConfig, ParallelConfig
from tinyserve.exercises.tp_mlp import ThreadGroup, WorkspaceMLP, generate_with_mlp, saved_mlp
from tinyserve.models.loader import build_model, random_state_dict
from tinyserve.models.tiny import make_tiny_tokenizer, tiny_config
from tinyserve.parallel import TensorParallelExecutor
from tinyserve.workspace import save

ROOT = Path(__file__).resolve().parents[1]
SOLUTION = runpy.run_path(str(ROOT / "chapters" / "solutions" / "ch10.py"))
ParallelMLP = SOLUTION["ParallelMLP"]
PROMPTS = ["Hello, my name is", "The future of AI is", "Paged attention keeps"]
CACHE = dict(block_size=4, num_gpu_blocks=160, num_cpu_blocks=0)


@pytest.fixture(scope="module")
def biased_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with MLP biases, randomized (transformers starts them at 0), so that a bias
    added on every rank instead of once would show."""
    path = make_tiny_model_dir(tmp_path_factory.mktemp("tiny-mlp-bias"), seed=5, num_key_value_heads=4,
                               mlp_bias=True)
    state = load_file(str(path / "model.safetensors"))
    gen = torch.Generator().manual_seed(5)
    for name, t in state.items():
        if name.endswith("bias"):
            state[name] = t + 0.3 * torch.randn(t.shape, generator=gen)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_build_model_mlp_hook_matches_package_rank_by_rank(tp_size: int) -> None:
    config = tiny_config(make_tiny_tokenizer(), num_key_value_heads=4, mlp_bias=True)
    state = random_state_dict(config, seed=1)
    x = torch.randn(5, config.hidden_size, generator=torch.Generator().manual_seed(0))
    for rank in range(tp_size):
        kwargs = dict(dtype=torch.float32, tp_rank=rank, tp_size=tp_size, all_reduce=lambda t: t,
                      attention_backend="torch")
        package = build_model(config, state, **kwargs)
        yours = build_model(config, state, mlp=ParallelMLP, **kwargs)
        for mine, theirs in zip(yours.layers, package.layers):
            assert isinstance(mine.mlp, ParallelMLP)
            assert torch.allclose(mine.mlp(x), theirs.mlp(x), atol=1e-6, rtol=0)
        # Nothing but the MLPs changed.
        assert torch.equal(yours.layers[0].self_attn.qkv_proj.weight, package.layers[0].self_attn.qkv_proj.weight)


def test_simulated_ranks_sum_to_the_unsharded_mlp() -> None:
    config = tiny_config(make_tiny_tokenizer(), num_key_value_heads=4)
    state = random_state_dict(config, seed=2)
    whole = build_model(config, state, dtype=torch.float32, attention_backend="torch")
    x = torch.randn(3, config.hidden_size, generator=torch.Generator().manual_seed(1))
    group = ThreadGroup(2)
    ranks = [build_model(config, state, dtype=torch.float32, tp_rank=r, tp_size=2, all_reduce=group.all_reduce_for(r),
                         attention_backend="torch", mlp=ParallelMLP) for r in range(2)]
    with torch.no_grad():
        outs = group.run(lambda r, _: ranks[r].layers[0].mlp(x))
        want = whole.layers[0].mlp(x)
    for out in outs:
        assert torch.allclose(out, want, atol=1e-5, rtol=1e-5)


def test_executor_refuses_an_mlp_it_cannot_send(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="mlp: .* must be picklable"):
        TensorParallelExecutor(ModelConfig(model=str(tiny_model_dir), device="cpu"),
                               ParallelConfig(tensor_parallel_size=2), mlp=lambda *a, **k: None)


def test_two_ranks_run_the_saved_mlp(biased_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TINYSERVE_WORKSPACE", str(tmp_path / "workspace"))
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in LLM(model=str(biased_dir), device="cpu", **CACHE).generate(
        PROMPTS, greedy)]
    save("parallel_mlp", (ROOT / "chapters" / "solutions" / "ch10.py").read_text(), answer="ParallelMLP", quiet=True)
    mlp = saved_mlp()
    assert isinstance(mlp, WorkspaceMLP)
    tokens, info = generate_with_mlp(biased_dir, mlp, PROMPTS, 8, tp_size=2, **CACHE)
    assert [i["rank"] for i in info] == [0, 1]
    assert tokens == expected
    # A saved MLP that adds down's bias on both ranks (twice in all) changes the tokens: the ranks used it.
    wrong = (ROOT / "tests" / "mistakes_ch10.py").read_text() + "\n\nParallelMLP = _BiasOnEveryRank\n"
    save("parallel_mlp", wrong, quiet=True)
    tokens, _ = generate_with_mlp(biased_dir, saved_mlp(), PROMPTS, 8, tp_size=2, **CACHE)
    assert tokens != expected
