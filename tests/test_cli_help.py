"""``--help`` of ``python -m tinyserve`` and ``python -m tinyserve.serve`` (issue 34 §6).

Each answers before torch, transformers or the web stack is imported (checked through
``sys.modules`` in a fresh interpreter, not with a clock), gives every option a help text and its
default, shows examples, has no RST markup, and groups the server's options.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys

import pytest

import tinyserve.__main__ as demo
from tinyserve.serve import cli

COMMANDS = {"tinyserve": demo.parser, "tinyserve.serve": cli.parser}
HEAVY = ("torch", "transformers", "fastapi", "starlette", "uvicorn", "pydantic", "numpy", "safetensors",
         "matplotlib", "tqdm", "httpx", "h11")

# Run the command's --help as `python -m` would, then list what it imported.
PROBE = """
import json, runpy, sys
sys.argv = [{module!r}, "--help"]
try:
    runpy.run_module({module!r}, run_name="__main__", alter_sys=True)
except SystemExit as e:
    code = e.code
print("@@modules@@" + json.dumps([sorted(sys.modules), code]))
"""


@pytest.mark.parametrize("module", list(COMMANDS))
def test_help_prints_before_anything_heavy_is_imported(module):
    done = subprocess.run([sys.executable, "-c", PROBE.format(module=module)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    helptext, _, tail = done.stdout.partition("@@modules@@")
    modules, code = json.loads(tail)
    assert code == 0 and helptext.startswith(f"usage: python -m {module}")
    loaded = {m.split(".")[0] for m in modules}
    assert not loaded & set(HEAVY), sorted(loaded & set(HEAVY))


def expanded_help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """The help text ``--help`` prints for ``action``, defaults filled in."""
    formatter = parser._get_formatter()
    return formatter._expand_help(action) if action.help else ""


@pytest.mark.parametrize("module", list(COMMANDS))
def test_every_option_has_a_help_text_and_its_default(module):
    p = COMMANDS[module]()
    options = [a for a in p._actions if not isinstance(a, argparse._HelpAction)]
    assert len(options) >= (29 if module == "tinyserve.serve" else 14)
    for action in options:
        text = expanded_help(p, action)
        assert len(text.split()) >= 3, f"{action.option_strings} has no help"
        assert "default" in text, f"{action.option_strings}: {text!r} does not say its default"
        assert "(default: None)" not in text, f"{action.option_strings}: say in words what None means"
        if "default" not in action.help:  # the formatter appended the real value
            assert text.endswith(f"(default: {action.default})"), text


def example_commands(helptext: str, module: str) -> list[list[str]]:
    """The arguments of each ``python -m module ...`` line under "examples:"."""
    examples = helptext[helptext.index("\nexamples:\n"):].replace("\\\n", " ")
    commands = []
    for line in examples.splitlines():
        words = shlex.split(line, comments=True)
        while words and "=" in words[0]:  # an environment variable set for the command
            words.pop(0)
        if words[:3] == ["python", "-m", module]:
            commands.append(words[3:])
    return commands


@pytest.mark.parametrize("module", list(COMMANDS))
def test_help_is_plain_text_with_examples_that_parse(module):
    p = COMMANDS[module]()
    text = p.format_help()
    for markup in ("``", ":func:", ":class:", ".. ", ":ref:"):
        assert markup not in text, markup
    commands = example_commands(text, module)
    assert len(commands) >= 3 and any(commands)
    for argv in commands:
        p.parse_args(argv)  # exits (failing the test) if an example names a flag or value that is wrong


def test_the_servers_options_are_grouped():
    p = cli.parser()
    groups = {g.title: {a.dest for a in g._group_actions} for g in p._action_groups}
    for title, members in {"model": {"model", "served_model_name", "device", "dtype"},
                           "engine": {"block_size", "num_gpu_blocks", "max_num_seqs", "policy",
                                      "enable_prefix_caching", "enable_chunked_prefill"},
                           "limits and protection": {"api_key", "allowed_host", "max_connections",
                                                     "header_timeout", "stall_timeout", "max_messages"},
                           "logging": {"log_level"}}.items():
        assert members <= groups[title], (title, members - groups[title])
    # Nothing is left in argparse's catch-all group but --help itself.
    assert groups["options"] == {"help"}


def test_help_never_shows_the_api_key_from_the_environment(monkeypatch):
    monkeypatch.setenv("TINYSERVE_API_KEY", "hunter2-secret")
    p = cli.parser()
    assert p.parse_args([]).api_key == "hunter2-secret"
    assert "hunter2-secret" not in p.format_help()


def test_log_levels_are_uvicorns():
    from uvicorn.config import LOG_LEVELS

    assert set(cli.LOG_LEVELS) == set(LOG_LEVELS)
