"""The default model's first-run conversion says what it is doing (issue 34 §6).

On a terminal a bar with the stage's name; anywhere else (a notebook, a pipe, a test log) one line
per stage. ``ensure_default_model`` is run with a fake conversion step, so these tests need neither
the weights package nor the two minutes a real conversion takes.
"""

from __future__ import annotations

import fcntl
import io
import json
import threading

import pytest

from tinyserve.models import default_model as dm


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_off_a_terminal_it_prints_one_line_per_stage_and_the_time():
    out = io.StringIO()
    with dm.ConversionProgress(out) as progress:
        for name in dm.STAGES:
            progress.stage(name)
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert len(lines) == len(dm.STAGES) + 2 and lines[0].startswith("Converting SmolLM2")
    for i, (line, name) in enumerate(zip(lines[1:], dm.STAGES), 1):
        assert line.startswith(f"  [{i}/{len(dm.STAGES)}] {name} (")
    assert lines[-1].startswith("  done in ")


def test_on_a_terminal_it_draws_a_bar_named_by_the_stage_that_ends_full():
    out = Terminal()
    with dm.ConversionProgress(out) as progress:
        for name in dm.STAGES:
            progress.stage(name)
    text = out.getvalue()
    assert "\r" in text and "[1/" not in text  # redrawn in place, no stage lines
    for name in dm.STAGES:
        assert name in text
    final = text.split("\r")[-1]
    assert "100%" in final and final.rstrip().endswith("done") and final.endswith("\n")


def test_a_failed_conversion_does_not_say_done_and_an_unknown_stage_is_refused():
    out = io.StringIO()
    with pytest.raises(RuntimeError), dm.ConversionProgress(out) as progress:
        progress.stage("loading transformers")
        raise RuntimeError("disk full")
    assert "done" not in out.getvalue()
    with pytest.raises(ValueError, match="unknown stage"), dm.ConversionProgress(io.StringIO()) as progress:
        progress.stage("compiling")


def test_ensure_default_model_reports_the_conversion_once(tmp_path, monkeypatch, capsys):
    gguf = tmp_path / dm.GGUF_NAME
    gguf.write_bytes(b"GGUF")
    monkeypatch.setenv("TINYSERVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(dm, "find_gguf", lambda: gguf)
    calls = []

    def fake_convert(source, out, progress):
        calls.append(source)
        for name in dm.STAGES:
            progress.stage(name)
        (out / "tinyserve.json").write_text(json.dumps({"format": dm.CONVERSION_FORMAT}))

    monkeypatch.setattr(dm, "_convert_gguf", fake_convert)
    path = dm.ensure_default_model()
    err = capsys.readouterr().err  # stderr is no terminal here: one line per stage
    assert path == tmp_path / "cache" / dm.DEFAULT_MODEL and calls == [gguf]
    assert f"[{len(dm.STAGES)}/{len(dm.STAGES)}]" in err and "done in" in err
    assert dm.ensure_default_model() == path and calls == [gguf]
    assert capsys.readouterr().err == ""  # converted already: nothing to say


def test_waiting_for_another_process_converting_says_so(tmp_path, capsys):
    lock = tmp_path / "lock"
    with open(lock, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # as another process converting would
        threading.Timer(0.3, fcntl.flock, (held, fcntl.LOCK_UN)).start()
        with dm._lock(lock):
            pass
    assert "Waiting for another process" in capsys.readouterr().err
