"""Not on trust (issue 35, item 3): while a checker runs, the package's own implementation of the
component it checks is unavailable to the reader's code (``tinyserve.exercises.guard``), so a
wrapper around it fails with a clear message, while the checker's own reference runs and every
chapter's solution still pass; ``%%workspace`` runs every check under it.

Every test runs on a fresh TINYSERVE_WORKSPACE under tmp_path."""

from __future__ import annotations

import functools
import runpy
from pathlib import Path

import pytest

import tinyserve.attention.reference as reference
from tinyserve import presets
from tinyserve import workspace as ws
from tinyserve.exercises.ch07 import check_attention_backend
from tinyserve.exercises.guard import PackageCalled, unavailable
from tinyserve.scheduler import Scheduler
from tinyserve.sim import simulate

SOLUTIONS = Path(__file__).resolve().parents[1] / "chapters" / "solutions"
# Chapter 07's first cells import the reference; a two-line backend that calls it.
WRAPPER_BACKEND = ("from tinyserve.attention.reference import paged_attention, store_kv\n\n\n"
                   "class AttentionBackend:\n"
                   "    def store_kv(self, key, value, k_cache, v_cache, slot_mapping):\n"
                   "        store_kv(key, value, k_cache, v_cache, slot_mapping)\n\n"
                   "    def forward(self, q, k_cache, v_cache, meta, scale):\n"
                   "        return paged_attention(q, k_cache, v_cache, meta, scale)\n")


@pytest.fixture(autouse=True)
def workspace(tmp_path, monkeypatch):
    root = tmp_path / "ws"
    monkeypatch.setenv("TINYSERVE_WORKSPACE", str(root))
    return root


@functools.cache
def solutions(chapter: int) -> dict:
    return runpy.run_path(str(SOLUTIONS / f"ch{chapter:02d}.py"))


def defined(source: str, name: str, module: str = "readers_cell"):
    namespace = {"__name__": module}
    exec(compile(source, f"<{module}>", "exec"), namespace)
    return namespace[name]


def seed_run(cls) -> list:
    preset = presets.seed_rounds("swap")
    scheduler = cls(preset.scheduler_config, preset.cache_config)
    return simulate(preset.requests, preset.scheduler_config, preset.cache_config, scheduler=scheduler)


# -- the guard --------------------------------------------------------------------------------


def test_a_wrapper_backend_fails_with_the_clear_message(capsys):
    wrapper = defined(WRAPPER_BACKEND, "AttentionBackend")
    with unavailable("attention", wrapper) as guard:
        assert check_attention_backend(wrapper) is False
    out = capsys.readouterr().out
    assert "raised PackageCalled: you called the package's paged_attention; this exercise is yours to write" in out
    assert guard.calls and set(guard.calls) == {
        "you called the package's store_kv; this exercise is yours to write",
        "you called the package's paged_attention; this exercise is yours to write"}
    # Everything is back: the module, and the names the reader's cell bound before the check.
    assert wrapper.forward.__globals__["paged_attention"] is reference.paged_attention
    assert not hasattr(reference.paged_attention, "__wrapped__")


def test_the_chapters_backend_passes_under_the_guard_and_the_package_still_runs_inside_it():
    solution = solutions(7)["PagedAttentionBackend"]
    with unavailable("attention", solution) as guard:
        assert check_attention_backend(solution, num_cases=4) is True
        # The package's own reference, called from package code, runs as always.
        backend = reference.TorchBackend()
        assert callable(backend.forward) and guard.calls == []


def test_a_round_that_only_inherits_the_packages_fails_and_the_packages_scheduler_runs():
    inherited = defined("from tinyserve.scheduler import Scheduler as PackageScheduler\n\n\n"
                        "class R(PackageScheduler):\n    pass\n", "R")
    want = seed_run(Scheduler)
    with unavailable("scheduler_round", inherited) as guard:
        with pytest.raises(PackageCalled, match=r"you called the package's Scheduler._schedule_vllm; "
                                                r"this exercise is yours to write"):
            seed_run(inherited)
        facts = [(r.batch, r.preempted, r.block_tables) for r in seed_run(Scheduler)]
        assert facts == [(r.batch, r.preempted, r.block_tables) for r in want]
    assert guard.calls == ["you called the package's Scheduler._schedule_vllm; this exercise is yours to write"]
    assert len(seed_run(inherited)) == len(want)  # after the guard: the package's round again


def test_super_and_a_name_bound_in_the_class_body_are_blocked_too():
    source = ("from tinyserve.scheduler import Scheduler as PackageScheduler\n\n\n"
              "class BySuper(PackageScheduler):\n    def _schedule_vllm(self):\n"
              "        return super()._schedule_vllm()\n\n\n"
              "class ByName(PackageScheduler):\n    _schedule_vllm = PackageScheduler._schedule_vllm\n")
    for name in ("BySuper", "ByName"):
        cls = defined(source, name)
        with unavailable("scheduler_round", cls) as guard, pytest.raises(PackageCalled):
            seed_run(cls)
        assert guard.calls and "Scheduler._schedule_vllm" in guard.calls[0]
    assert vars(cls)["_schedule_vllm"] is Scheduler._schedule_vllm  # the class body's name, put back


def test_a_package_subclass_of_the_readers_class_still_serves_it_by_inheritance():
    """A checker's counting subclass (a class made in tinyserve) does not launder the package's
    method; a class that holds it on purpose (a checker composing parts) may run it."""
    inherited = defined("from tinyserve.scheduler import Scheduler as PackageScheduler\n\n\n"
                        "class R(PackageScheduler):\n    pass\n", "R")
    maker = {"__name__": "tinyserve.exercises.fake_checker"}
    exec("def counting(cls):\n    return type('Counting', (cls,), {})\n\n"
         "def composed(cls, package, names):\n"
         "    return type('only_yours', (cls,), {m: getattr(package, m) for m in names})\n",
         maker)
    with unavailable("scheduler_round", inherited) as guard:
        with pytest.raises(PackageCalled):
            seed_run(maker["counting"](inherited))
        # The checker's composition holds every part of the round: the package's, on purpose.
        names = [entry.rpartition(".")[2] for entry in ws.COMPONENTS["scheduler_round"].own]
        assert seed_run(maker["composed"](inherited, Scheduler, names))
    assert len(guard.calls) == 1


def test_everything_is_restored_when_the_check_raises():
    before = (reference.paged_attention, vars(reference.TorchBackend)["forward"], Scheduler._schedule_vllm)
    wrapper = defined(WRAPPER_BACKEND, "AttentionBackend")
    with pytest.raises(ZeroDivisionError), unavailable("attention", wrapper):
        assert reference.paged_attention is not before[0]
        raise ZeroDivisionError
    assert (reference.paged_attention, vars(reference.TorchBackend)["forward"], Scheduler._schedule_vllm) == before


@pytest.mark.parametrize("name", [c.name for c in ws.COMPONENTS.values() if c.check])
def test_every_chapters_solution_passes_its_checker_under_the_guard(name, capsys):
    from tinyserve.workspace.magic import checker_of

    comp = ws.COMPONENTS[name]
    answer = solutions(comp.chapter)[comp.answer]
    with unavailable(comp, answer) as guard:
        ok = checker_of(comp)(answer)
    assert guard.calls == [] and ok is True, capsys.readouterr().out[-2000:]


def test_every_own_entry_names_a_function_or_method_of_the_package():
    import importlib

    for comp in ws.COMPONENTS.values():
        for entry in comp.own:
            module, _, qualname = entry.partition(":")
            if "triton" in module:
                continue  # Triton's modules need Triton; tests/test_triton_paged.py covers them on a GPU
            owner = importlib.import_module(module)
            for part in qualname.split("."):
                owner = getattr(owner, part)
            assert callable(owner), entry


# -- %%workspace runs every check under it ----------------------------------------------------


@pytest.fixture
def shell():
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    ws.register_magic(shell)
    return shell


def test_the_magic_refuses_a_wrapper_and_saves_the_real_backend(shell, workspace, capsys):
    assert shell.run_cell("%%workspace attention 7\n" + WRAPPER_BACKEND).success
    out = capsys.readouterr().out
    assert "you called the package's" in out and "not saved" in out
    assert not (workspace / "attention.py").exists()
    assert shell.user_ns["paged_attention"] is reference.paged_attention  # the notebook's name, put back
    solution = (SOLUTIONS / "ch07.py").read_text()
    cell = f"%%workspace attention 7\n{solution}\nAttentionBackend = PagedAttentionBackend\n"
    assert shell.run_cell(cell).success
    assert ws.load("attention", strict=True).__name__ == "PagedAttentionBackend"


def test_the_packages_own_object_as_the_answer_is_refused_at_once():
    from tinyserve.model_runner import prepare_inputs

    with pytest.raises(PackageCalled, match=r"your answer is the package's tinyserve.model_runner.prepare_inputs; "
                                            r"this exercise is yours to write"):
        with unavailable("input_builder", prepare_inputs):
            pass
    with pytest.raises(PackageCalled, match=r"your answer is the package's tinyserve.attention.reference.TorchBackend"):
        with unavailable("attention", reference.TorchBackend()):
            pass


@pytest.mark.parametrize("cell", [
    "class R(PackageScheduler):\n    pass\n",
    "class VllmRound(PackageScheduler):\n    def _schedule_vllm(self):\n        return super()._schedule_vllm()\n",
])
def test_the_magic_refuses_a_round_that_runs_the_packages(shell, workspace, capsys, cell):
    shell.run_cell("from tinyserve.scheduler import Scheduler as PackageScheduler\n")
    assert shell.run_cell("%%workspace scheduler_round 5\n" + cell).success
    out = capsys.readouterr().out
    assert "✗ your scheduler_round: you called the package's Scheduler._schedule_vllm; " \
           "this exercise is yours to write; it is not saved" in out
    assert not (workspace / "scheduler_round.py").exists()
