"""The front page (README.md) and the pages it links to (docs/*.md), read as a new reader meets them.

- The README's prose is at most 2,500 words, counted without tables, code, image lines and lines
  that hold only links (the operations manuals live in docs/, one link away).
- Its parts come in the order a new reader needs them: what it is and who it is for, a hero
  figure, "Start here" (``make lab``, then chapter 00), prerequisites, the two commands, the
  chapter table, a few full-width figures, one table of results.
- Every relative link and image in README.md and docs/*.md names a file of the repository.
- The chapter table links every chapter notebook; the Python version matches pyproject.toml.
- The results table, and the tables of docs/performance.md that test_benchmarks.py does not
  check, are the committed CSVs of benchmarks/results.
"""

from __future__ import annotations

import re
import struct
from pathlib import Path

import pytest

from tinyserve.lab import perf

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
CHAPTERS = sorted((ROOT / "chapters").glob("[0-9][0-9]_*.ipynb"))
MAX_PROSE_WORDS = 2500
# The README's second-level headings that must appear, in this order (others may sit between).
SECTIONS = ["Start here", "Prerequisites", "Two commands", "Chapters", "Figures", "Results"]
# GitHub shows a README about 880 px wide; a narrower PNG is shown at its own, smaller width.
MIN_FIGURE_PX = 800
# Makefile targets a reader never types: the others are named on the front page.
UNLISTED_TARGETS = {"venv", "lint", "clean", "screenshot"}

FENCE = re.compile(r"^```.*?^```[ \t]*$", re.M | re.S)
LINK = re.compile(r"!?\[([^\]]*)\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _without_code(text: str) -> str:
    return FENCE.sub("", re.sub(r"<!--.*?-->", "", text, flags=re.S))


def prose_words(markdown: str) -> int:
    """Words of running text: fenced code, HTML comments, table rows, image lines and lines that
    hold nothing but links (and list marks or punctuation) are left out; inline code counts."""
    words = 0
    for line in _without_code(markdown).splitlines():
        stripped = line.strip()
        if stripped.startswith("|") or stripped.startswith("!["):
            continue
        if not re.sub(r"[-*+>#\s.,;:·|]", "", LINK.sub("", stripped)):
            continue  # a link-only line (or blank)
        words += sum(1 for w in stripped.split() if re.search(r"\w", w))
    return words


def headings(markdown: str, level: int) -> list[tuple[int, str]]:
    """(line number, title) of each heading of that level outside code blocks."""
    lines = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), markdown).splitlines()
    mark = "#" * level + " "
    return [(i, line[len(mark):].strip()) for i, line in enumerate(lines) if line.startswith(mark)]


def section(markdown: str, title: str) -> str:
    """The text under the second-level heading ``title``, up to the next one."""
    lines = markdown.splitlines()
    starts = headings(markdown, 2)
    i = next((n for n, (_, t) in enumerate(starts) if t == title), None)
    assert i is not None, f"no section '## {title}'"
    end = starts[i + 1][0] if i + 1 < len(starts) else len(lines)
    return "\n".join(lines[starts[i][0] + 1:end])


def png_width(path: Path) -> int:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">I", head[16:20])[0]


def test_prose_words_leave_out_tables_code_images_and_link_lines():
    text = ("# Title here\n\nOne two three.\n\n```bash\nmake test  # not prose\n```\n\n| a | b |\n|---|---|\n"
            "\n![a figure](x.png)\n\n- [docs/a.md](docs/a.md)\n- [docs/a.md](docs/a.md): four five `six`\n")
    assert prose_words(text) == 2 + 3 + 4


def test_readme_prose_is_at_most_2500_words():
    words = prose_words(README.read_text())
    assert words <= MAX_PROSE_WORDS, f"README.md has {words} prose words, more than {MAX_PROSE_WORDS}"


def test_readme_sections_come_in_the_reader_s_order():
    text = README.read_text()
    lines = text.splitlines()
    assert lines[0] == "# tinyserve" and len(headings(text, 1)) == 1
    titles = [t for _, t in headings(text, 2)]
    assert all(s in titles for s in SECTIONS), f"missing sections: {[s for s in SECTIONS if s not in titles]}"
    assert [t for t in titles if t in SECTIONS] == SECTIONS, titles
    # What it is, then who it is for, then the hero figure, all before "Start here".
    start = dict((t, i) for i, t in headings(text, 2))["Start here"]
    intro = lines[1:start]
    who = next(i for i, line in enumerate(intro) if line.startswith("**Who it is for.**"))
    first_image = next(i for i, line in enumerate(intro) if line.startswith("!["))
    assert any(line.strip() for line in intro[:who]), "no 'what it is' paragraph before 'who it is for'"
    assert who < first_image, "the hero figure comes after what it is and who it is for"


def test_start_here_opens_the_lab_then_chapter_00():
    start = section(README.read_text(), "Start here")
    assert "make lab" in start and "chapters/00_overview.ipynb" in start
    assert start.index("make lab") < start.index("chapters/00_overview.ipynb")


def test_prerequisites_name_python_memory_disk_time_and_threads():
    prereq = section(README.read_text(), "Prerequisites")
    needed = re.search(r'^requires-python\s*=\s*"([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    version = re.fullmatch(r">=\s*(\d+\.\d+)", needed).group(1)
    assert f"Python {version} or newer" in prereq, f"pyproject.toml says {needed}"
    for item in ("**Memory:**", "**Disk:**", "**Time:**", "OMP_WAIT_POLICY=PASSIVE"):
        assert item in prereq, item


def test_two_commands_and_the_other_targets():
    text = README.read_text()
    commands = section(text, "Two commands")
    block = FENCE.search(commands)
    assert block and "make test" in block.group(0) and "make demo" in block.group(0)
    makefile = (ROOT / "Makefile").read_text()
    phony = re.search(r"^\.PHONY:(.*)$", makefile, re.M).group(1).split()
    flat = " ".join(commands.split())
    missing = [t for t in phony if t not in UNLISTED_TARGETS and not re.search(rf"make {re.escape(t)}(?![\w-])", flat)]
    assert not missing, f"the README does not name these Makefile targets: {missing}"


def test_chapter_table_links_every_chapter():
    table = section(README.read_text(), "Chapters")
    rows = [line for line in table.splitlines() if line.startswith("|")]
    for path in CHAPTERS:
        assert any(f"](chapters/{path.name})" in row for row in rows), f"{path.name} is not in the chapter table"


def test_figures_are_full_width_one_per_row():
    text = README.read_text()
    hero = re.search(r"^!\[[^\]]*\]\(([^)]+)\)", text, re.M).group(1)
    figures = LINK.findall(section(text, "Figures"))
    shown = [target for _, target in figures if target.endswith(".png")]
    assert 3 <= len(shown) <= 4, shown
    assert not any("![" in line for line in text.splitlines() if line.lstrip().startswith("|")), \
        "a figure inside a table is shown a fraction of the page wide"
    for target in [hero, *shown]:
        assert png_width(ROOT / target) >= MIN_FIGURE_PX, f"{target} is narrower than {MIN_FIGURE_PX} px"


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_and_images_resolve(page: Path):
    text = re.sub(r"`[^`\n]*`", "", _without_code(page.read_text()))
    targets = [t for _, t in LINK.findall(text)]
    assert targets or page != README
    for target in targets:
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = (page.parent / target.split("#")[0]).resolve()
        assert path.is_relative_to(ROOT) and path.is_file(), f"{page.name}: {target} names no file of the repository"


def test_readme_links_the_pages_the_front_page_left_out():
    text = README.read_text()
    for name in ("performance.md", "serving.md", "package.md"):
        assert f"](docs/{name})" in text, name


def test_sample_outputs_say_which_dtype_printed_them():
    """Greedy text differs between float32 and bfloat16 (dtype "auto" picks bf16 on some CPUs), so
    a quoted output names its dtype: the README's example prints, and the capstone's run."""
    dtypes = ("float32", "bfloat16")
    for block in FENCE.findall(README.read_text()):
        lines = block.splitlines()
        prints = [i for i, line in enumerate(lines) if line.startswith("print(")]
        if prints:
            shown = [line for line in lines[prints[-1] + 1:] if line.startswith("#")]
            assert shown and all(any(d in line for d in dtypes) for line in shown), block
    capstone = (ROOT / "docs" / "your_engine.md").read_text()
    before = capstone[:capstone.index("your parts: ")]
    paragraph = before[:before.rindex("```")].rstrip().rsplit("\n\n", 1)[-1]
    assert any(d in paragraph for d in dtypes), paragraph


# -- the numbers, against benchmarks/results ----------------------------------------------------

def _headline(name: str) -> dict[str, dict[str, dict]]:
    by_workload: dict[str, dict[str, dict]] = {}
    for row in perf.read_results(name):
        if row["experiment"] == "headline":
            by_workload.setdefault(row["workload"], {})[row["system"]] = row
    return by_workload


def _workload_label(row: dict) -> str:
    kind = row["workload"].split("-")[0]
    if row["min_out"] == row["max_out"]:
        return f"{kind}: {row['num_requests']} requests × {row['min_out']} tokens out"
    return f"{kind}: {row['num_requests']} requests, {row['min_out']}–{row['max_out']} tokens out"


@pytest.mark.parametrize(("name", "dtype"), [("throughput", "float32"), ("throughput_bfloat16", "bfloat16")])
def test_results_table_is_the_committed_throughput(name: str, dtype: str):
    import json

    results = " ".join(section(README.read_text(), "Results").split())
    for systems in _headline(name).values():
        tok = systems["tinyserve"]["tokens_per_s"]
        gen, batch = systems["generate"], systems["generate_batch"]
        row = (f"| {_workload_label(systems['tinyserve'])} | {dtype} | {tok:.1f} | {tok / gen['tokens_per_s']:.2f}× | "
               f"{tok / batch['tokens_per_s']:.2f}× | "
               f"{systems['tinyserve-orca']['tokens_per_s'] / gen['tokens_per_s']:.2f}× | "
               f"{gen['same_outputs_as_tinyserve']:.0%} |")
        assert row in results, row
    assert json.loads((perf.RESULTS_DIR / f"{name}_machine.json").read_text())["machine"] in results


def test_results_prose_gives_the_sweeps_range():
    from tinyserve.lab.perf.sweep import by_cell

    results = " ".join(section(README.read_text(), "Results").split())
    for name, dtype in (("throughput_sweep_bfloat16", "bfloat16"), ("throughput_sweep", "float32")):
        ratios = [c["tinyserve"]["tokens_per_s"] / c["generate"]["tokens_per_s"]
                  for c in by_cell(perf.read_results(name)).values()]
        span = f"{min(ratios):.2f}–{max(ratios):.2f}×"
        assert re.search(re.escape(span) + r"[^.;]*? in " + dtype, results), (name, span)


def test_performance_doc_first_table_is_the_committed_throughput():
    doc = (ROOT / "docs" / "performance.md").read_text()
    for systems in _headline("throughput").values():
        gen, batch = systems["generate"]["tokens_per_s"], systems["generate_batch"]["tokens_per_s"]
        for system in ("tinyserve", "tinyserve-orca"):
            tok = systems[system]["tokens_per_s"]
            if system == "tinyserve-orca" and systems[system]["workload"].startswith("uniform"):
                continue  # the doc gives the uniform workload's orca ratios in prose
            cells = f"| {tok:.1f} tok/s | {tok / gen:.2f}× | {tok / batch:.2f}× |"
            assert cells in doc, (system, cells)


def test_performance_doc_latency_table_is_the_committed_serving_run():
    doc = (ROOT / "docs" / "performance.md").read_text()
    rows = perf.read_results("serving")
    rates = sorted({r["rate"] for r in rows})
    assert "| policy | " + " | ".join(f"{r:g} req/s" for r in rates) + " | peak out tok/s |" in doc
    for policy in dict.fromkeys(r["policy"] for r in rows):
        mine = sorted((r for r in rows if r["policy"] == policy), key=lambda r: r["rate"])
        cells = " | ".join(f"{r['ttft_p50_s']:.2f} s / {r['itl_p50_s']:.2f} s / {r['goodput_req_per_s']:.2f}"
                           for r in mine)
        line = f"| {policy} | {cells} | {max(r['output_tok_per_s'] for r in mine):.1f} |"
        assert line in doc, line


def test_compiled_step_numbers_are_the_committed_runs():
    """The README's and docs/performance.md's compiled-step numbers are benchmarks/compiled_step.py's
    committed results: the step table row by row, the workload ratios and the compile times."""
    readme = " ".join(section(README.read_text(), "Results").split())
    doc = (ROOT / "docs" / "performance.md").read_text()
    steps = perf.read_results("compiled_step")
    for r in steps:
        row = (f"| {r['batch']} | {r['graph_size']} | {r['eager_ms']:.1f} ms | {r['compiled_ms']:.1f} ms | "
               f"{r['transformers_ms']:.1f} ms | {r['compiled_vs_eager']:.2f}× | "
               f"{r['compiled_vs_transformers']:.2f}× | {r['roofline_share']:.0%} |")
        assert row in doc, row
    at16 = {r["batch"]: r for r in steps}[16]
    assert (f"{at16['compiled_ms']:.1f} ms compiled against {at16['eager_ms']:.1f} ms eager and "
            f"{at16['transformers_ms']:.1f} ms for transformers' forward") in readme
    work = {r["system"]: r for r in perf.read_results("compiled_step_workload")}
    ratios = (f"{work['tinyserve-compiled']['vs_generate']:.2f}× static `generate` compiled, "
              f"{work['tinyserve-eager']['vs_generate']:.2f}× eager")
    assert ratios in readme, ratios
    assert (f"eager {work['tinyserve-eager']['vs_generate']:.2f}×, compiled "
            f"{work['tinyserve-compiled']['vs_generate']:.2f}×") in " ".join(doc.split())
    from tinyserve.lab.perf.sweep import COMPILED, by_cell

    cells = by_cell(perf.read_results("throughput_sweep_bfloat16_compiled"))
    gains = [by[COMPILED]["tokens_per_s"] / by["tinyserve"]["tokens_per_s"] for by in cells.values()]
    span = f"{min(gains):.2f}–{max(gains):.2f}× the eager engine's tokens per second"
    assert span in readme and span in " ".join(doc.split()), span
    short = cells[("short", "8-64", 16)]
    assert (f"{short[COMPILED]['x_generate']:.2f}× `generate` in the short-prompt 8–64 cell against the eager "
            f"engine's {short['tinyserve']['x_generate']:.2f}×") in " ".join(doc.split())
    times = {r["run"]: r["compile_s"] for r in perf.read_results("compiled_step_compile")}
    assert f"{times['first']:.0f} s ({times['cached']:.0f} s from the disk cache)" in readme
    assert f"{times['first']:.1f} s, and {times['cached']:.1f} s from" in " ".join(doc.split())
