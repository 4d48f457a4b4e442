"""The architecture is the table of contents: each module imports only from the layers above it.

Module-level imports must respect the order strictly. A function-level import may reach one
layer down only where listed in LAZY_ALLOWED, with the reason. Modules of one layer may import
each other, but never in a circle (tests/test_import_cycles.py).
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "tinyserve"

LAYERS = [
    ["config"],
    ["sequence", "sampling_params", "guided_params"],
    ["block", "block_manager", "prefix_cache"],
    # The Scheduler class and its parts (split_prefill, v1_round, preemption, refusals, postprocess),
    # what a round decides (scheduler_outputs), and what runs it without a model.
    ["scheduler", "scheduler_outputs", "split_prefill", "v1_round", "preemption", "refusals", "postprocess", "sim",
     "presets", "recording"],
    ["cache_engine"],
    ["attention"],
    ["models"],
    ["model_runner", "closed_schema", "grammar", "constraints", "sampler", "logprobs", "beam_search", "graphs",
     "worker", "detokenizer"],
    ["outputs", "engine", "llm", "__main__"],
    ["parallel"],
    ["serve"],
    ["lab"],  # matplotlib-free models and measurements that viz draws
    ["viz", "exercises", "workspace"],
]
# LLM(tensor_parallel_size>1) starts the parallel executor, which is built on the engine's parts.
LAZY_ALLOWED = {("engine", "parallel")}


def layer_of(module: str) -> int:
    top = module.split(".")[1] if module.startswith("tinyserve.") else module
    for i, names in enumerate(LAYERS):
        if top in names:
            return i
    raise AssertionError(f"tinyserve.{top} is not placed in a layer (add it to LAYERS in tests/test_layers.py)")


def module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path):
    tree = ast.parse(path.read_text())
    top_level = set(map(id, tree.body))
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        for n in names:
            if n == "tinyserve" or n.startswith("tinyserve."):
                yield n, id(node) in top_level


def test_every_module_respects_the_layer_order():
    problems = []
    for path in sorted(PKG.rglob("*.py")):
        mod = module_name(path)
        if mod == "tinyserve":
            continue
        mine = layer_of(mod)
        for imported, at_top in imports(path):
            if imported == "tinyserve":
                continue
            theirs = layer_of(imported)
            if theirs <= mine:
                continue
            pair = (mod.split(".")[1], imported.split(".")[1])
            if not at_top and pair in LAZY_ALLOWED:
                continue
            problems.append(f"{mod} (layer {mine}) imports {imported} (layer {theirs})")
    assert not problems, "\n".join(problems)
