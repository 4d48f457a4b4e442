"""The reader's code run contained (tinyserve.workspace.contain, .served): "your engine so far"
and the capstone bound each round in time and name the component that did not return, turn
whatever the reader's code raises (SystemExit and KeyboardInterrupt too) into the verdict's
problem line, check the answers the package relies on (a victim that is not one of the groups it
was given), and measure "your parts": the calls each of them served, against counts taken
independently on the package's own run.

Every test runs on a fresh TINYSERVE_WORKSPACE under tmp_path; the scheduler-only chapters
(02–05) wherever a model is not needed, the tiny Llama where it is."""

from __future__ import annotations

import signal
import threading
from pathlib import Path

import pytest

from tinyserve import presets
from tinyserve import workspace as ws
from tinyserve.block import BlockAllocator
from tinyserve.block_manager import BlockSpaceManager
from tinyserve.scheduler import Scheduler
from tinyserve.sim import simulate
from tinyserve.workspace import contain

SOLUTIONS = Path(__file__).resolve().parents[1] / "chapters" / "solutions"
SHORT_S = 0.5  # the bound the looping tests run under

# A vLLM round whose decode phase never ends (prefill rounds return before it).
LOOPING_DECODE = ("class Scheduler(PackageScheduler):\n"
                  "    def _decode_running(self, out, budget):\n"
                  "        while True:\n"
                  "            try:\n"
                  "                pass\n"
                  "            except Exception:  # swallows what it can: the timeout is not an Exception\n"
                  "                pass\n")


@pytest.fixture(autouse=True)
def workspace(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "ws"
    monkeypatch.setenv("TINYSERVE_WORKSPACE", str(root))
    return root


@pytest.fixture
def short_bound(monkeypatch):
    monkeypatch.setattr(contain, "ROUND_TIMEOUT_S", SHORT_S)
    monkeypatch.setattr(contain, "STEP_TIMEOUT_S", SHORT_S)


def _package_rounds(policy: str = "vllm"):
    preset = presets.seed_rounds("swap", policy=policy)
    return simulate(preset.requests, preset.scheduler_config, preset.cache_config)


def _first_decode_round() -> int:
    return next(r.round for r in _package_rounds() if r.phase == "decode")


def _victim_offers() -> list[int]:
    """How many groups the package's scheduler offers choose_victim, call by call, on s0/s1/s2."""
    offers: list[int] = []

    def newest(running):
        offers.append(len(running))
        return running[-1]

    preset = presets.seed_rounds("swap")
    scheduler = Scheduler(preset.scheduler_config, preset.cache_config, choose_victim=newest)
    simulate(preset.requests, preset.scheduler_config, preset.cache_config, scheduler=scheduler)
    return offers


# -- bounded ----------------------------------------------------------------------------------


def test_a_looping_round_is_stopped_and_named_with_its_round(short_bound):
    ws.save("scheduler_round", LOOPING_DECODE, quiet=True)
    previous = signal.signal(signal.SIGALRM, signal.SIG_IGN)
    # A timer may already run (pytest-timeout's, under make test): the bound must give it back,
    # less the time spent, and leave no timer of its own when there was none.
    before = signal.getitimer(signal.ITIMER_REAL)[0]
    try:
        v = ws.your_engine_so_far(5, quiet=True)
        assert signal.getsignal(signal.SIGALRM) is signal.SIG_IGN  # the handler before the run is back
        after = signal.getitimer(signal.ITIMER_REAL)[0]
        assert (after == 0.0) if before == 0.0 else (0.0 < after <= before), (before, after)
    finally:
        signal.signal(signal.SIGALRM, previous)
    want = (f"your scheduler_round (_decode_running) did not return within {SHORT_S:g} s in round "
            f"{_first_decode_round()} (a loop that never ends?)")
    assert not v.ok and want in v.verdict, v.verdict
    assert v.packages == _package_rounds()  # the package's run beside it is whole
    assert len(v.yours) == _first_decode_round() - 1  # the rounds before the loop are shown


def test_a_loop_in_a_part_the_package_calls_names_that_part(short_bound):
    ws.save("victim", "def choose_victim(running):\n    while True:\n        pass\n", quiet=True)
    v = ws.your_engine_so_far(5, quiet=True)
    assert not v.ok and f"your victim (choose_victim) did not return within {SHORT_S:g} s in round" in v.verdict


def test_off_the_main_thread_the_run_is_unbounded_and_still_contained(monkeypatch):
    # Signals reach the main thread only: a slow victim (slower than the bound) finishes there.
    monkeypatch.setattr(contain, "ROUND_TIMEOUT_S", 0.05)
    ws.save("victim", "import time\n\ndef choose_victim(running):\n    time.sleep(0.2)\n    return running[-1]\n",
            quiet=True)
    verdicts = []
    thread = threading.Thread(target=lambda: verdicts.append(ws.your_engine_so_far(5, quiet=True)))
    thread.start()
    thread.join(60)
    assert verdicts and verdicts[0].ok, verdicts and verdicts[0].verdict
    assert not ws.your_engine_so_far(5, quiet=True).ok  # in the main thread the same victim is stopped


def test_a_looping_step_on_the_model_is_stopped_and_named(short_bound, tiny_loaded):
    ws.save("engine_step", "class LLMEngine(PackageEngine):\n    def step(self):\n        while True:\n"
                           "            pass\n", quiet=True)
    v = ws.your_engine_so_far(9, model=tiny_loaded, quiet=True)
    assert not v.ok and f"your engine_step (step) did not return within {SHORT_S:g} s in round 1" in v.verdict


# -- contained --------------------------------------------------------------------------------


@pytest.mark.parametrize("raised", ["SystemExit(3)", "KeyboardInterrupt()", "RuntimeError('oops')"])
def test_anything_a_round_raises_is_the_verdicts_problem(raised):
    ws.save("scheduler_round", "class Scheduler(PackageScheduler):\n    def _schedule_vllm(self):\n"
                               f"        raise {raised}\n", quiet=True)
    v = ws.your_engine_so_far(5, quiet=True)  # returns: SystemExit would end pytest, KeyboardInterrupt stop it
    name = raised.split("(")[0]
    assert not v.ok and f"your run raised {name}" in v.verdict, v.verdict
    assert "(in round 1) while your scheduler_round (_schedule_vllm) was running" in v.verdict
    assert v.packages == _package_rounds()


def test_system_exit_while_a_part_is_built_or_imported_is_a_report(capsys):
    ws.save("allocator", "class BlockAllocator:\n    def __init__(self, device, block_size, num_blocks):\n"
                         "        raise SystemExit(3)\n", quiet=True)
    v = ws.your_engine_so_far(2, quiet=True)
    assert not v.ok and "your run raised SystemExit: 3 (before the first round) while your allocator" in v.verdict
    ws.save("allocator", "raise SystemExit(4)\n\nclass BlockAllocator:\n    pass\n", quiet=True)
    v = ws.your_engine_so_far(2, quiet=True)  # returns, whether load reports it or the run does
    assert "SystemExit" in v.verdict + capsys.readouterr().out


def test_the_capstone_reports_a_step_that_raises_and_keeps_the_packages_tokens(tiny_loaded):
    ws.save("engine_step", "class LLMEngine(PackageEngine):\n    def step(self):\n"
                           "        raise KeyboardInterrupt\n", quiet=True)
    result = ws.capstone(tiny_loaded, quiet=True)
    assert not result.ok and len(result.problems) == 3
    assert all("your run raised KeyboardInterrupt (in round 1) while your engine_step (step) was running" in p
               for p in result.problems), result.problems
    assert result.rows and all(r.packages and not r.yours for r in result.rows)
    assert result.to_json()["calls"]["engine_step"] == 0 and result.report.served() == []


# -- checked ----------------------------------------------------------------------------------


def test_a_victim_that_returns_none_is_named_with_what_it_must_return():
    ws.save("victim", "def choose_victim(running):\n    return None\n", quiet=True)
    v = ws.your_engine_so_far(5, quiet=True)
    n = _victim_offers()[0]
    want = f"your victim (choose_victim) returned None; it must return one of the {n} groups it was given"
    assert not v.ok and want in v.verdict, v.verdict
    assert "AttributeError" not in v.verdict


def test_an_admission_rule_that_returns_no_bool_is_named():
    ws.save("admission", "def can_admit(group, budget, block_manager):\n    return 'yes'\n", quiet=True)
    v = ws.your_engine_so_far(5, quiet=True)
    assert not v.ok and "your admission (can_admit) returned 'yes'; it must return True or False (in round 1)" \
        in v.verdict, v.verdict


def test_a_block_manager_answer_of_the_wrong_kind_is_named():
    ws.save("block_manager", "class BlockSpaceManager(PackageBlockSpaceManager):\n"
                             "    def can_allocate(self, seq_group):\n        return True\n", quiet=True)
    v = ws.your_engine_so_far(3, quiet=True)
    assert not v.ok and "your block_manager (can_allocate) returned True; it must return an AllocStatus" in v.verdict


def test_a_step_that_returns_no_list_is_named(tiny_loaded):
    ws.save("engine_step", "class LLMEngine(PackageEngine):\n    def step(self):\n        super().step()\n",
            quiet=True)
    v = ws.your_engine_so_far(9, model=tiny_loaded, quiet=True)
    assert not v.ok and "your engine_step (step) returned None; it must return the list of this step's " \
                        "RequestOutputs (in round 1)" in v.verdict, v.verdict


# -- measured ---------------------------------------------------------------------------------


def test_the_solutions_rounds_are_counted_and_said(capsys):
    ws.save_solutions(SOLUTIONS, chapters=[4, 5])
    v = ws.your_engine_so_far(4)
    out = capsys.readouterr().out
    orca = len(_package_rounds("orca"))  # each orca round runs OrcaRound's _schedule_mixed
    assert v.ok and v.report.calls["orca_round"] == orca
    assert f"your orca_round ran {orca} rounds" in out and "your parts: orca_round" in out
    v = ws.your_engine_so_far(5)
    out = capsys.readouterr().out
    assert v.ok and v.report.calls["scheduler_round"] == len(_package_rounds("vllm"))
    assert v.report.calls.get("orca_round", 0) == 0 and "orca_round" in v.report.yours()
    assert "orca_round" not in v.report.served()
    assert "your orca_round is saved but ran 0 rounds here: this workload uses policy='vllm'" in out
    assert "your parts: scheduler_round\n" in out  # the unused one is not listed as serving


def test_the_allocators_blocks_are_counted_as_the_package_allocates_them():
    allocations = []

    class Counting(BlockAllocator):
        def allocate(self):
            allocations.append(1)
            return super().allocate()

    preset = presets.seed_rounds("swap")
    cc = preset.cache_config
    manager = BlockSpaceManager(cc.block_size, cc.num_gpu_blocks, cc.num_cpu_blocks, cc.watermark, allocator=Counting)
    simulate(preset.requests, preset.scheduler_config, cc,
             scheduler=Scheduler(preset.scheduler_config, cc, block_manager=manager))
    ws.save_solutions(SOLUTIONS, chapters=[2])
    v = ws.your_engine_so_far(2, quiet=True)
    assert v.ok and v.report.calls["allocator"] == len(allocations) > 0
    assert f"your allocator allocated {len(allocations)} blocks" in str(v.report)


def test_the_readers_engine_class_runs_the_steps_and_they_are_counted(tiny_loaded):
    ws.save("engine_step", "class LLMEngine(PackageEngine):\n    def step(self):\n        return super().step()\n",
            quiet=True)
    engine, report = ws.build_engine(tiny_loaded)
    assert type(engine).__module__ == "_tinyserve_workspace.engine_step" and report["engine_step"] == "yours"
    v = ws.your_engine_so_far(9, model=tiny_loaded, quiet=True)
    assert v.ok, v.verdict
    assert v.report.calls["engine_step"] == len(v.packages) > 0
    assert f"your engine_step ran {len(v.packages)} steps" in str(v)
    assert ws.your_engine_so_far(8, model=tiny_loaded, quiet=True).report.get("engine_step") == "package's"


def test_a_step_that_never_finishes_the_requests_is_stopped_after_a_bounded_number_of_rounds(tiny_loaded):
    ws.save("engine_step", "class LLMEngine(PackageEngine):\n    def step(self):\n        return []\n", quiet=True)
    v = ws.your_engine_so_far(9, model=tiny_loaded, quiet=True)
    limit = 4 * len(v.packages) + 20  # so_far.ROUND_LIMIT_FACTOR times the package's rounds, and 20
    assert not v.ok and f"your run did not finish within {limit} rounds: requests that never finish? " \
                        f"(in round {limit})" in v.verdict, v.verdict
    assert v.report.calls["engine_step"] == limit
