"""``python -m tinyserve`` (``make demo``) tells the rounds briefly (issue 34 §6).

A run of identical quiet rounds is one line ("rounds 4–7: decode s0 s1 (×4)"); each preemption,
swap and finish has a line of its own, in colour only on a terminal without $NO_COLOR; the run
ends with a one-line summary. Checked on the simulator's record of the story and on a real run
of the tiny model.
"""

from __future__ import annotations

import io
import re

import pytest

import tinyserve.__main__ as demo
from tinyserve import presets, sim

LABEL = re.compile(r"^rounds? (\d+)(?:–(\d+))?:")
ANSI = re.compile(r"\033\[[0-9;]*m")
STORIES = [("vllm", "swap"), ("vllm", "recompute"), ("v1", "auto")]


def story_history(policy: str, mode: str, max_tokens: int = 16) -> list[sim.RoundRecord]:
    preset = presets.seed_rounds(mode, policy=policy, max_tokens=max_tokens)
    return sim.simulate(preset.requests, preset.scheduler_config, preset.cache_config)


def labelled_rounds(lines: list[str]) -> list[int]:
    """The round numbers the lines' labels cover, in order."""
    covered = []
    for line in lines:
        if m := LABEL.match(line):
            first, last = int(m[1]), int(m[2] or m[1])
            covered += range(first, last + 1)
    return covered


@pytest.mark.parametrize(("policy", "mode"), STORIES)
def test_only_identical_quiet_rounds_are_grouped_and_every_round_is_told_once(policy, mode):
    history = story_history(policy, mode)
    groups = demo.group_rounds(history)
    assert [r.round for g in groups for r in g] == [r.round for r in history]
    for g in groups:
        for r in g[1:]:
            assert demo._is_quiet(g[0]) and demo._is_quiet(r)
            assert (r.phase, r.batch, r.running) == (g[0].phase, g[0].batch, g[0].running)
    for a, b in zip(groups, groups[1:]):  # groups are as long as they can be
        assert not demo._same_kind(a[-1], b[0])
    assert max(len(g) for g in groups) >= 3  # 16 tokens each: long runs of the same decode

    lines = demo.describe_history(history)
    assert labelled_rounds(lines) == [r.round for r in history]
    for g in groups:
        label = next(line for line in lines if LABEL.match(line) and int(LABEL.match(line)[1]) == g[0].round)
        assert (f"(×{len(g)})" in label) == (len(g) > 1)
    text = "\n".join(lines)
    assert text.count("PREEMPTED") == sum(len(r.preempted) for r in history) > 0
    assert text.count("swapped out to CPU") == sum(len(r.swapped_out) for r in history)
    assert text.count("SWAPPED IN") == sum(len(r.swapped_in) for r in history)
    assert text.count("FINISHED") == sum(len(r.finished) for r in history) == 3
    assert not ANSI.search(text)
    # Far shorter than a full account of each round.
    assert len(lines) * 2 < sum(len(demo.describe_round(r).splitlines()) for r in history)


def test_colour_only_on_a_terminal_and_never_with_no_color(monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.setenv("TERM", "xterm-256color")
    assert demo.use_colour(Terminal()) and not demo.use_colour(io.StringIO())
    monkeypatch.setenv("NO_COLOR", "1")
    assert not demo.use_colour(Terminal())

    history = story_history("vllm", "swap")
    plain, coloured = demo.describe_history(history), demo.describe_history(history, colour=True)
    assert [ANSI.sub("", line) for line in coloured] == plain
    marked = [line for line in coloured if "PREEMPTED" in line or "FINISHED" in line or "SWAPPED IN" in line]
    assert marked and all(ANSI.search(line) for line in marked)


SUMMARY = re.compile(r"(\d+) requests, (\d+) tokens generated in (\d+) rounds, (\d+) preemptions "
                     r"\((\d+) swapped out, (\d+) swapped in\); ([\d.]+) s, ([\d.]+) tok/s, (\w+) on (\w+)")


def test_a_real_run_tells_every_round_and_ends_with_a_summary(tiny_model_dir):
    out = io.StringIO()
    args = demo.parser().parse_args(["--model", str(tiny_model_dir), "--device", "cpu", "--max-tokens", "6"])
    engine, outputs = demo.run(args, out=out)
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("Loading ")  # said before torch and the weights load
    assert labelled_rounds(lines) == [r.round for r in engine.history]
    m = SUMMARY.fullmatch(lines[-1])
    assert m, lines[-1]
    requests, tokens, rounds, preemptions, swapped_out, swapped_in = map(int, m.groups()[:6])
    assert requests == len(outputs) == 3
    assert tokens == sum(len(o.outputs[0].token_ids) for o in outputs)
    assert rounds == len(engine.history)
    assert preemptions == sum(len(r.preempted) for r in engine.history)
    assert (swapped_out, swapped_in) == (sum(len(r.swapped_out) for r in engine.history),
                                         sum(len(r.swapped_in) for r in engine.history))
    wall, rate = float(m[7]), float(m[8])  # printed to 0.01 s and 0.1 tok/s
    assert tokens / (wall + 0.005) - 0.05 <= rate <= tokens / max(wall - 0.005, 1e-9) + 0.05
    assert (m[9], m[10]) == ("float32", "cpu")  # tests run the CPU in float32 (conftest)
    # Each group's line names the text each request produced in its rounds.
    heads = {int(LABEL.match(line)[1]): line for line in lines if LABEL.match(line)}
    for g in demo.group_rounds(engine.history):
        for rid in g[0].batch:
            if text := "".join(r.tokens.get(rid, "") for r in g):
                assert f"{rid} {text!r}" in heads[g[0].round]
