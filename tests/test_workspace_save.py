"""The workspace saves exactly what was checked and contains what it loads (issue 35, item 4):
imports are not definitions (the alias case), helpers beside the answer, clear refusals, the
package's own object refused at load, validation of the components without a checker, and a
module that raises SystemExit or KeyboardInterrupt, or changes tinyserve, while it is imported.

Every test runs on a fresh TINYSERVE_WORKSPACE under tmp_path."""

from __future__ import annotations

import pytest

from tinyserve import workspace as ws
from tinyserve.block_manager import BlockSpaceManager
from tinyserve.sampler import Sampler
from tinyserve.scheduler import Scheduler

# Chapter 04's skeleton imports the package's Scheduler under its own name and subclasses it.
ALIASED_ROUND = ("from tinyserve.scheduler import Scheduler\n\n\n"
                 "class MyOrcaRound(Scheduler):\n"
                 "    def _schedule_mixed(self):\n"
                 "        return super()._schedule_mixed()\n")
# Chapter 03's cell: the reader's class and a helper function beside it.
WITH_HELPER = ("def _needs(table, n_blocks):\n    return len(table) < n_blocks\n\n\n"
               "LIMIT = 3\n\n\n"
               "class MyBlockSpaceManager(PackageBlockSpaceManager):\n"
               "    def can_append_slot(self, seq_group):\n"
               "        return super().can_append_slot(seq_group)\n")


@pytest.fixture(autouse=True)
def workspace(tmp_path, monkeypatch):
    root = tmp_path / "ws"
    monkeypatch.setenv("TINYSERVE_WORKSPACE", str(root))
    return root


@pytest.fixture
def shell():
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    ws.register_magic(shell)
    return shell


# -- what is saved ----------------------------------------------------------------------------


def test_an_imported_name_is_not_the_readers_definition(workspace):
    ws.save("orca_round", ALIASED_ROUND, quiet=True)
    assert (workspace / "orca_round.py").read_text().rstrip().endswith("Scheduler = MyOrcaRound  # the name "
                                                                       "tinyserve.workspace loads")
    cls = ws.load("orca_round", strict=True)
    assert cls is not Scheduler and cls.__name__ == "MyOrcaRound"
    assert cls.__module__ == "_tinyserve_workspace.orca_round" and issubclass(cls, Scheduler)
    scheduler, report = ws.build_scheduler()
    assert report["orca_round"] == "yours" and type(scheduler).__name__ == "MyOrcaRound"


def test_aliased_rounds_of_chapters_04_and_13_join_into_one_scheduler(workspace):
    ws.save("orca_round", ALIASED_ROUND, quiet=True)
    ws.save("v1_round", "from tinyserve.scheduler import Scheduler\n\n\nclass MyV1Round(Scheduler):\n"
                        "    def _schedule_v1(self):\n        return super()._schedule_v1()\n", quiet=True)
    scheduler, report = ws.build_scheduler(chapter=13)
    assert report["orca_round"] == report["v1_round"] == "yours" and not report.notes
    assert [b.__name__ for b in type(scheduler).__bases__] == ["MyOrcaRound", "MyV1Round"]


def test_the_magic_saves_the_object_its_checker_passed(shell, workspace, monkeypatch):
    import dataclasses

    import tinyserve.exercises.ch04 as ch04

    checked = []
    monkeypatch.setattr(ch04, "check_record_for_test", lambda cls: checked.append(cls) or True, raising=False)
    orca = dataclasses.replace(ws.COMPONENTS["orca_round"], check="tinyserve.exercises.ch04:check_record_for_test")
    monkeypatch.setitem(ws.COMPONENTS, "orca_round", orca)
    assert shell.run_cell("%%workspace orca_round 4\n" + ALIASED_ROUND).success
    assert [c.__name__ for c in checked] == ["MyOrcaRound"]
    loaded = ws.load("orca_round", strict=True)
    assert loaded.__name__ == "MyOrcaRound" and loaded is not Scheduler


def test_a_helper_function_constants_and_imports_beside_the_class_are_saved_with_it(workspace):
    ws.save("block_manager", "from collections import Counter\n" + WITH_HELPER, quiet=True)
    cls = ws.load("block_manager", strict=True)
    assert cls.__name__ == "MyBlockSpaceManager" and issubclass(cls, BlockSpaceManager)
    module = __import__("sys").modules[cls.__module__]
    assert module._needs([1], 2) is True and module.LIMIT == 3


def test_the_fixed_name_wins_and_a_function_component_takes_the_one_public_function(workspace):
    ws.save("block_manager", WITH_HELPER + "\n\nclass BlockSpaceManager(MyBlockSpaceManager):\n    pass\n", quiet=True)
    assert ws.load("block_manager").__name__ == "BlockSpaceManager"
    ws.save("victim", "def _tokens(g):\n    return 0\n\n\ndef newest(running):\n    return running[-1]\n", quiet=True)
    assert ws.load("victim").__name__ == "newest"


@pytest.mark.parametrize("source, answer, message", [
    ("class A(PackageBlockSpaceManager):\n    pass\n\n\nclass B(A):\n    pass\n", None,
     r"your block_manager must define BlockSpaceManager .*it defines A, B: name your answer BlockSpaceManager, "
     r"or pass answer="),
    ("from tinyserve.block_manager import BlockSpaceManager\n", None, r"must define BlockSpaceManager"),
    ("from tinyserve.block_manager import BlockSpaceManager as Mine\n", "Mine",
     r"Mine is imported, not defined in it \(the package's"),
    ("if True:\n    class Mine(PackageBlockSpaceManager):\n        pass\n", "Mine", r"not defined at the top level"),
    ("%time x = 1\nclass Mine(PackageBlockSpaceManager):\n    pass\n", None,
     r"your block_manager cannot be saved: line 1: %time x = 1 is IPython"),
])
def test_what_cannot_be_saved_is_refused_naming_the_component(workspace, source, answer, message):
    with pytest.raises(ValueError, match=message):
        ws.save("block_manager", source, answer=answer)
    assert not (workspace / "block_manager.py").exists()


def test_a_lambda_answer_is_refused():
    with pytest.raises(ValueError, match=r"your victim cannot be saved: choose_victim is a lambda; write it with def"):
        ws.save("victim", "choose_victim = lambda running: running[-1]\n")


def test_the_magic_refuses_shell_lines_before_the_cell_runs(shell, workspace, capsys):
    shell.user_ns.pop("ran", None)
    assert not shell.run_cell("%%workspace victim 5\n!ls\nran = True\ndef choose_victim(r):\n    return r[0]\n").success
    assert "ran" not in shell.user_ns and not (workspace / "victim.py").exists()


def test_the_magic_does_not_save_a_cell_with_no_answer_or_the_packages(shell, workspace, capsys):
    assert shell.run_cell("%%workspace victim 5\nx = 1\n").success
    out = capsys.readouterr().out
    assert "✗ your victim must define choose_victim" in out and "not saved" in out
    assert shell.run_cell("%%workspace victim 5\nfrom tinyserve.preemption import preempt_newest\n"
                          "choose_victim = preempt_newest\n").success
    out = capsys.readouterr().out
    assert "is the package's tinyserve.preemption.preempt_newest, not a function you wrote" in out
    assert not (workspace / "victim.py").exists()


# -- what is loaded ---------------------------------------------------------------------------


def _write(workspace, module: str, text: str) -> None:
    workspace.mkdir(parents=True, exist_ok=True)
    (workspace / module).write_text(text)


def test_the_packages_object_under_the_readers_name_is_refused_at_load(workspace, capsys):
    _write(workspace, "orca_round.py", "from tinyserve.scheduler import Scheduler\n")
    assert ws.load("orca_round") is None
    assert "your orca_round.py's Scheduler is the package's tinyserve.scheduler.Scheduler, not a class you wrote" \
        in capsys.readouterr().out
    with pytest.raises(ws.WorkspaceError, match="is the package's tinyserve.scheduler.Scheduler"):
        ws.load("orca_round", strict=True)
    _, report = ws.build_scheduler()
    assert report["orca_round"] == "package's"


@pytest.mark.parametrize("text, message", [
    ("def choose_victim():\n    return None\n",
     r"your victim \(choose_victim in victim.py\) takes \(\), but the package calls choose_victim\(running\)"),
    ("choose_victim = 3\n", r"your victim \(choose_victim in victim.py\) must be a function called as "
                            r"choose_victim\(running\), got int 3"),
    ("class choose_victim:\n    pass\n", r"is a class, but the package calls choose_victim\(running\)"),
])
def test_a_victim_policy_is_validated_at_load(workspace, text, message):
    _write(workspace, "victim.py", text)
    with pytest.raises(ws.WorkspaceError, match=message):
        ws.load("victim", strict=True)


def test_an_admission_rule_is_validated_at_load(workspace):
    _write(workspace, "admission.py", "def can_admit(group, budget):\n    return True\n")
    with pytest.raises(ws.WorkspaceError, match=r"your admission \(can_admit in admission.py\) takes "
                                                r"\(group, budget\), but the package calls "
                                                r"can_admit\(group, budget, block_manager\)"):
        ws.load("admission", strict=True)
    # A callable object with the right call is fine, and so are defaults and *args.
    _write(workspace, "admission.py", "class Rule:\n    def __call__(self, group, budget, manager, extra=0):\n"
                                      "        return True\n\n\ncan_admit = Rule()\n")
    assert ws.load("admission", strict=True)(1, 2, 3) is True
    _write(workspace, "admission.py", "def can_admit(*args):\n    return True\n")
    assert ws.load("admission", strict=True) is not None


def test_a_round_must_subclass_the_packages_scheduler(workspace):
    _write(workspace, "scheduler_round.py", "class Scheduler:\n    pass\n")
    with pytest.raises(ws.WorkspaceError, match=r"your scheduler_round \(Scheduler in scheduler_round.py\) must be a "
                                                r"class that subclasses tinyserve.scheduler.Scheduler"):
        ws.load("scheduler_round", strict=True)
    _write(workspace, "attention.py", "AttentionBackend = object()\n")
    with pytest.raises(ws.WorkspaceError, match=r"your attention .* is an object without store_kv, forward"):
        ws.load("attention", strict=True)


@pytest.mark.parametrize("raised", ["SystemExit(3)", "KeyboardInterrupt()"])
def test_an_exit_or_interrupt_while_importing_is_reported_not_raised(workspace, capsys, raised):
    _write(workspace, "victim.py", f"def choose_victim(running):\n    return running[-1]\n\n\nraise {raised}\n")
    assert ws.load("victim") is None
    name = raised.split("(")[0]
    assert f"your victim in {workspace / 'victim.py'} failed to import: {name}" in capsys.readouterr().out
    with pytest.raises(ws.WorkspaceError, match=f"failed to import: {name}.*line 5"):
        ws.load("victim", strict=True)
    scheduler, report = ws.build_scheduler()  # the build goes on with the package's
    assert report["victim"] == "package's"


def test_a_component_that_patches_the_package_when_imported_is_undone_and_refused(workspace, capsys):
    import tinyserve.sampler as sampler_module

    call, apply_min_p = Sampler.__call__, sampler_module.apply_min_p
    _write(workspace, "sampler.py",
           "import tinyserve.sampler\nfrom tinyserve.sampler import Sampler as PackageSampler\n\n\n"
           "def broken(self, logits, requests):\n    return [[0] for _ in requests]\n\n\n"
           "PackageSampler.__call__ = broken\ntinyserve.sampler.apply_min_p = None\n"
           "tinyserve.sampler.EXTRA = 1\n\n\n"
           "class Sampler(PackageSampler):\n    pass\n")
    with pytest.raises(ws.WorkspaceError) as raised:
        ws.load("sampler", strict=True)
    message = str(raised.value)
    assert message.startswith("your sampler.py ")
    for change in ("replaced tinyserve.sampler.Sampler.__call__", "replaced tinyserve.sampler.apply_min_p",
                   "added tinyserve.sampler.EXTRA"):
        assert change in message
    assert "when imported; undone: a component may subclass the package's classes, not change them" in message
    assert Sampler.__call__ is call and sampler_module.apply_min_p is apply_min_p
    assert not hasattr(sampler_module, "EXTRA")
    assert ws.load("sampler") is None and "replaced tinyserve.sampler.Sampler.__call__" in capsys.readouterr().out
    assert Sampler.__call__ is call  # undone again on the second load


def test_a_plain_llm_after_a_patching_component_samples_as_before(workspace):
    import torch

    from tinyserve.sampler import SampleRequest
    from tinyserve.sampling_params import SamplingParams

    logits = torch.tensor([[0.0, 3.0, 1.0]])
    request = SampleRequest(params=SamplingParams(temperature=0.0), num_samples=1, prompt_token_ids=[],
                            output_token_ids=[], generator=None)
    before = Sampler(0)(logits, [request])
    _write(workspace, "sampler.py", "from tinyserve.sampler import Sampler as P\n"
                                    "P.__call__ = lambda self, logits, requests: [[7]]\nSampler = P\n")
    assert ws.load("sampler") is None
    assert Sampler(0)(logits, [request]) == before == [[1]]


def test_the_package_engine_never_reads_the_workspace():
    """A plain LLM() or LLMEngine cannot pick up a reader's part: they do not even import the workspace."""
    import subprocess
    import sys

    code = ("import sys, tinyserve, tinyserve.llm, tinyserve.engine, tinyserve.serve\n"
            "print(sorted(m for m in sys.modules if m.startswith(('tinyserve.workspace', '_tinyserve_workspace'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_docstring_line_that_starts_with_a_percent_sign_is_python(workspace):
    ws.save("victim", 'def choose_victim(running):\n    """The newest:\n    % of the time, all of it."""\n'
                      '    return running[-1]\n', quiet=True)
    assert ws.load("victim", strict=True)([1, 2]) == 2
