"""The reader's workspace (tinyserve.workspace): saving and loading components, the %%workspace
cell magic, assembling a scheduler or an engine from the reader's parts, and "your engine so far".

Every test runs on a fresh TINYSERVE_WORKSPACE under tmp_path."""

from __future__ import annotations

import inspect
import subprocess
from pathlib import Path

import pytest

from tinyserve import workspace as ws
from tinyserve.block import BlockAllocator, Device

REPO = Path(__file__).resolve().parents[1]
# The package's own allocator under another name: a correct answer (saved with an alias line).
CORRECT = inspect.getsource(BlockAllocator).replace("class BlockAllocator", "class MyAllocator")
# A block whose last owner lets go never returns to the free list.
LEAKY = CORRECT.replace("            self.free_blocks.append(block)", "            pass  # leaks the block")
# A free list that hands out the newest free block first: other block numbers, the same rounds.
STACK = CORRECT.replace("self.free_blocks.popleft()", "self.free_blocks.pop()")


@pytest.fixture(autouse=True)
def workspace(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "ws"
    monkeypatch.setenv("TINYSERVE_WORKSPACE", str(root))
    return root


def test_the_answers_are_different_where_they_should_be():
    assert LEAKY != CORRECT and STACK != CORRECT


def test_the_workspace_is_the_environment_variable_or_a_folder_in_home(workspace, tmp_path, monkeypatch):
    assert ws.workspace_dir() == workspace
    assert not workspace.exists()
    assert ws.workspace_dir(create=True) == workspace and (workspace / "__init__.py").exists()
    monkeypatch.delenv("TINYSERVE_WORKSPACE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert ws.workspace_dir() == tmp_path / "home" / ".tinyserve" / "workspace"


# -- saving and loading -----------------------------------------------------------------------


def test_a_saved_component_loads_back_and_a_new_save_replaces_it_at_once(workspace):
    path = ws.save("victim", "def choose_victim(running):\n    return running[-1]\n", chapter=5)
    assert path == workspace / "victim.py"
    header = path.read_text().splitlines()[0]
    assert "victim" in header and "choose_victim" in header and "chapter 05" in header and "saved 20" in header
    assert ws.load("victim")([1, 2, 3]) == 3
    # Same length, same second: a bytecode cache keyed on mtime and size would return the old one.
    ws.save("victim", "def choose_victim(running):\n    return running[+0]\n", chapter=5)
    assert ws.load("victim")([1, 2, 3]) == 1
    assert ws.saved_components() == ["victim"]
    assert ws.load("allocator") is None
    assert ws.remove("victim") and ws.load("victim") is None


def test_a_class_under_another_name_is_loaded_by_the_components_fixed_name(workspace):
    ws.save("allocator", CORRECT, quiet=True)
    cls = ws.load("allocator")
    assert cls.__name__ == "MyAllocator"
    assert "BlockAllocator = MyAllocator" in (workspace / "allocator.py").read_text()
    a = cls(Device.GPU, 4, 3)
    assert [a.allocate().block_number for _ in range(3)] == [0, 1, 2]  # deque came from the prelude


def test_an_object_is_saved_with_its_source():
    from tinyserve.preemption import preempt_newest

    ws.save("victim", preempt_newest, quiet=True)
    assert ws.load("victim").__name__ == "preempt_newest"
    namespace: dict = {}
    exec("def f(running):\n    return running[0]\n", namespace)  # no file: inspect cannot find it
    with pytest.raises(ValueError, match="cannot find the source"):
        ws.save("victim", namespace["f"])


def test_a_bad_name_or_source_is_refused_and_nothing_is_written(workspace):
    with pytest.raises(ValueError, match=r"unknown workspace component 'alocator'.*allocator, block_manager"):
        ws.save("alocator", CORRECT)
    with pytest.raises(SyntaxError, match=r"your allocator does not compile: line 2"):
        ws.save("allocator", "class A:\n    def allocate(self)\n        pass\n")
    with pytest.raises(ValueError, match="must define BlockAllocator"):
        ws.save("allocator", "class A: pass\nclass B: pass\n")
    assert not workspace.exists() or sorted(p.name for p in workspace.iterdir()) == []


def test_a_module_that_fails_to_import_is_reported_with_its_file(workspace, capsys):
    ws.save("allocator", "x = 1\nclass BlockAllocator(Missing):\n    pass\n", quiet=True)
    assert ws.load("allocator") is None
    out = capsys.readouterr().out
    assert str(workspace / "allocator.py") in out and "NameError" in out and "package's allocator" in out
    with pytest.raises(ws.WorkspaceError, match=r"allocator\.py failed to import: NameError.*\(line \d+\)"):
        ws.load("allocator", strict=True)
    scheduler, report = ws.build_scheduler()  # the build goes on with the package's
    assert report["allocator"] == "package's" and type(scheduler.block_manager.gpu_allocator) is BlockAllocator
    with pytest.raises(ws.WorkspaceError):
        ws.build_scheduler(strict=True)


# -- the cell magic ---------------------------------------------------------------------------


@pytest.fixture
def shell():
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    ws.register_magic(shell)
    return shell


def test_the_magic_runs_the_cell_in_the_notebook_and_saves_it(shell, workspace):
    result = shell.run_cell("%%workspace victim 5\ndef newest(running):\n    return running[-1]\nran = True\n")
    assert result.success, result.error_in_exec
    assert shell.user_ns["ran"] is True and shell.user_ns["newest"]([4, 5]) == 5
    assert "chapter 05" in (workspace / "victim.py").read_text()
    assert ws.load("victim")([4, 5]) == 5


def test_a_cell_that_raises_or_a_bad_name_saves_nothing(shell, workspace):
    assert not shell.run_cell("%%workspace victim\ndef choose_victim(r):\n    return r[0]\n1 / 0\n").success
    assert not (workspace / "victim.py").exists()
    shell.user_ns.pop("ran", None)
    assert not shell.run_cell("%%workspace victims\nran = True\n").success
    assert "ran" not in shell.user_ns  # refused before the cell ran
    assert not shell.run_cell("%%workspace victim\ndef choose_victim(r)\n    return r\n").success
    assert not (workspace / "victim.py").exists()


def test_the_magic_saves_only_an_answer_that_passes_its_checker(shell, workspace, monkeypatch, capsys):
    import dataclasses

    verdicts = []

    def check_newest(fn):  # a stand-in checker: the newest running group is the victim
        verdicts.append(fn([1, 2, 3]) == 3)
        return verdicts[-1]

    import tinyserve.exercises.ch05 as ch05

    monkeypatch.setattr(ch05, "check_newest_for_test", check_newest, raising=False)
    victim = dataclasses.replace(ws.COMPONENTS["victim"], check="tinyserve.exercises.ch05:check_newest_for_test")
    monkeypatch.setitem(ws.COMPONENTS, "victim", victim)
    unwritten = "%%workspace victim 5\ndef choose_victim(running):\n    raise NotImplementedError\n"
    assert shell.run_cell(unwritten).success  # a skeleton runs; the chapter goes on
    assert not (workspace / "victim.py").exists() and "not saved" in capsys.readouterr().out
    assert shell.run_cell("%%workspace victim 5\ndef choose_victim(running):\n    return running[0]\n").success
    assert not (workspace / "victim.py").exists() and verdicts == [False]  # wrong: not saved either
    assert shell.run_cell("%%workspace victim 5\ndef newest(running):\n    return running[-1]\n").success
    assert (workspace / "victim.py").exists() and verdicts == [False, True]
    assert shell.run_cell(unwritten).success  # a later wrong answer leaves the saved one in place
    assert ws.load("victim")([1, 2, 3]) == 3


def test_the_readers_rounds_are_the_engines_scheduler_joined_into_one_class(workspace):
    from tinyserve.exercises.engine_runs import tiny

    for name, method in (("scheduler_round", "_schedule_vllm"), ("orca_round", "_schedule_mixed")):
        ws.save(name, f"class Mine(PackageScheduler):\n    calls = []\n\n    def {method}(self):\n"
                      f"        Mine.calls.append({method!r})\n        return super().{method}()\n", quiet=True)
    engine, report = ws.build_engine(tiny())
    assert {"scheduler_round", "orca_round"} <= set(report.yours())
    cls = type(engine.scheduler)
    assert cls.__name__ == "YourScheduler" and [b.__module__ for b in cls.__bases__] == [
        "_tinyserve_workspace.scheduler_round", "_tinyserve_workspace.orca_round"]
    assert engine.scheduler.block_manager.num_total_gpu_blocks == engine.cache_config.num_gpu_blocks
    v = ws.your_engine_so_far(9, model=tiny(), quiet=True)
    assert v.ok, v.verdict


def test_an_object_defined_in_a_cell_is_saved_from_the_cell(shell, workspace):
    # A notebook stores every cell in the history (In), which is where save finds it.
    assert shell.run_cell("class CellAllocator:\n    '''from a cell'''\n    pass\n", store_history=True).success
    assert shell.run_cell("from tinyserve import workspace\nworkspace.save('allocator', CellAllocator)").success
    assert "'''from a cell'''" in (workspace / "allocator.py").read_text()


def test_load_ipython_extension_registers_the_magic(shell):
    shell.magics_manager.magics["cell"].pop("workspace", None)
    ws.load_ipython_extension(shell)
    assert "workspace" in shell.magics_manager.magics["cell"]


# -- assembly and "your engine so far" --------------------------------------------------------


def test_with_nothing_written_every_part_is_the_packages():
    scheduler, report = ws.build_scheduler()
    assert set(report.values()) == {"package's"} and report.yours() == []
    assert list(report) == ["allocator", "block_manager", "admission", "orca_round", "scheduler_round", "victim"]


def test_the_readers_allocator_is_the_one_the_scheduler_uses():
    ws.save("allocator", STACK, quiet=True)
    scheduler, report = ws.build_scheduler()
    assert report["allocator"] == "yours" and report.yours() == ["allocator"]
    assert type(scheduler.block_manager.gpu_allocator).__name__ == "MyAllocator"
    assert type(scheduler.block_manager.cpu_allocator).__name__ == "MyAllocator"
    # A later chapter's view leaves out no earlier part; an earlier one leaves out later parts.
    assert ws.build_scheduler(chapter=1)[1]["allocator"] == "package's"


def test_a_readers_block_manager_that_takes_no_allocator_is_used_and_the_allocator_is_not():
    ws.save("allocator", CORRECT, quiet=True)
    ws.save("block_manager", "class BlockSpaceManager(PackageBlockSpaceManager):\n"
                             "    def __init__(self, block_size, num_gpu_blocks, num_cpu_blocks, watermark=0.01):\n"
                             "        super().__init__(block_size, num_gpu_blocks, num_cpu_blocks, watermark)\n",
            quiet=True)
    scheduler, report = ws.build_scheduler()
    assert report["block_manager"] == "yours" and report["allocator"] == "package's"
    assert "takes no allocator" in str(report)
    assert type(scheduler.block_manager).__module__ == "_tinyserve_workspace.block_manager"


def test_a_correct_allocator_gives_the_same_rounds(capsys):
    ws.save("allocator", CORRECT, quiet=True)
    v = ws.your_engine_so_far(2)
    assert v.ok and v.verdict.startswith("same rounds") and v.report.yours() == ["allocator"]
    assert v.yours and len(v.yours) == len(v.packages)
    out = capsys.readouterr().out
    assert "✓ same rounds" in out and "your parts: allocator" in out
    ws.save("allocator", STACK, quiet=True)  # other block numbers are not a difference
    assert ws.your_engine_so_far(3, quiet=True).ok


def test_a_leaking_allocator_gives_the_first_different_round():
    ws.save("allocator", LEAKY, quiet=True)
    v = ws.your_engine_so_far(3, quiet=True)
    assert not v.ok
    assert v.verdict.startswith("round 3: ")  # s2's block, swapped out in round 3, never comes back
    assert "same" not in v.verdict


def test_a_part_that_raises_is_reported_not_raised():
    ws.save("victim", "def choose_victim(running):\n    raise RuntimeError('oops')\n", quiet=True)
    v = ws.your_engine_so_far(5, quiet=True)
    assert not v.ok and "your run raised RuntimeError: oops (in round 3)" in v.verdict
    assert v.report["victim"] == "yours"


def test_the_engine_with_the_readers_allocator_gives_the_same_tokens():
    from tinyserve.exercises.engine_runs import tiny

    ws.save("allocator", CORRECT, quiet=True)
    engine, report = ws.build_engine(tiny())
    assert report["allocator"] == "yours" and report["sampler"] == "package's"
    assert type(engine.scheduler.block_manager.gpu_allocator).__name__ == "MyAllocator"
    v = ws.your_engine_so_far(9, model=tiny(), quiet=True)
    assert v.ok and v.verdict.startswith("same tokens"), v.verdict
    assert v.your_tokens == v.package_tokens and all(len(t) == 8 for t in v.package_tokens.values())


def test_the_engine_with_a_wrong_sampler_names_the_first_different_token():
    from tinyserve.exercises.engine_runs import tiny

    ws.save("sampler", "class Sampler:\n    def __init__(self, seed):\n        pass\n\n"
                       "    def __call__(self, logits, requests):\n"
                       "        return [[7] * r.num_samples for r in requests]\n", quiet=True)
    v = ws.your_engine_so_far(9, model=tiny(), quiet=True)
    assert v.report["sampler"] == "yours"
    assert not v.ok and "s0's token 1: 7 instead of" in v.verdict
    assert ws.your_engine_so_far(8, model=tiny(), quiet=True).ok  # chapter 9's sampler is not used before it


def test_running_the_workspace_writes_only_into_the_workspace(workspace):
    def status() -> set[str]:
        return set(subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=REPO,
                                  capture_output=True, text=True, check=True).stdout.splitlines())

    before = status()
    ws.save("allocator", CORRECT, quiet=True)
    ws.your_engine_so_far(3, quiet=True)
    assert status() == before
    assert sorted(p.name for p in workspace.iterdir() if p.is_file()) == ["__init__.py", "allocator.py"]
