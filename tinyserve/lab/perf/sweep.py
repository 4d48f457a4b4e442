"""Reading the throughput sweep (``benchmarks/sweep.py``): ratios per cell, and the targets.

A *cell* is one workload shape: prompt lengths, output lengths and the most sequences running.
Each row of ``throughput_sweep.csv`` is one system in one cell. Issue 17 set three targets for
tinyserve (every schedule) against transformers, as medians of three runs:

- at least 1.3x static ``generate`` where output lengths are mixed (8-64 or 8-128 tokens);
- at least 1.0x static ``generate`` where every request wants the same length (uniform-64);
- at least 2x ``generate_batch`` everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

OURS = ("tinyserve", "tinyserve-orca", "tinyserve-chunked")
BASELINES = ("generate", "generate_batch")
SCHEDULES = {"tinyserve": "vllm policy", "tinyserve-orca": "orca policy", "tinyserve-chunked": "chunked prefill",
             "tinyserve-compiled": "vllm, compiled"}
COMPILED = "tinyserve-compiled"  # sweep.py --compiled: the vllm policy with compiled decode steps


def cell_key(row: dict) -> tuple[str, str, int]:
    return row["prompts"], row["outputs"], int(row["max_running"])


def by_cell(rows: list[dict]) -> dict[tuple[str, str, int], dict[str, dict]]:
    """``{cell: {system: row}}`` in the sweep's order."""
    cells: dict[tuple[str, str, int], dict[str, dict]] = {}
    for r in rows:
        cells.setdefault(cell_key(r), {})[r["system"]] = r
    return cells


def target(cell: tuple[str, str, int], baseline: str) -> float:
    """The speed-up over ``baseline`` that tinyserve should reach in ``cell``."""
    if baseline == "generate_batch":
        return 2.0
    return 1.0 if cell[1].startswith("uniform") else 1.3


def ratio_grid(rows: list[dict], baseline: str,
               systems: tuple[str, ...] = OURS) -> tuple[list[tuple[str, str, int]], list[list[float]]]:
    """The cells and ``[cell][system]`` ratios of tinyserve's median tokens/s to ``baseline``'s."""
    cells = by_cell(rows)
    grid = [[by[s]["tokens_per_s"] / by[baseline]["tokens_per_s"] for s in systems] for by in cells.values()]
    return list(cells), grid


@dataclass(frozen=True)
class Shortfall:
    """One schedule in one cell below its target against one baseline."""

    cell: tuple[str, str, int]
    schedule: str
    baseline: str
    ratio: float
    target: float


def shortfalls(rows: list[dict]) -> list[Shortfall]:
    """Every (cell, schedule, baseline) whose median ratio misses its target."""
    out = []
    for base in BASELINES:
        cells, grid = ratio_grid(rows, base)
        for cell, line in zip(cells, grid):
            out += [Shortfall(cell, s, base, v, target(cell, base)) for s, v in zip(OURS, line)
                    if v < target(cell, base)]
    return out


def work(row: dict, num_requests: int, output_tokens: int) -> dict[str, float]:
    """What a system's run computed: passes, prefill-only passes, rows per decoding pass, and the
    share of decoding rows that produced a token someone asked for (static batches also decode
    rows that are finished or padding). The first token of each request comes from its prefill."""
    wanted = output_tokens - num_requests
    decode_passes = row["forwards"] - row["prefill_forwards"]
    return dict(forwards=row["forwards"], prefill_forwards=row["prefill_forwards"],
                rows_per_pass=row["decode_rows"] / max(decode_passes, 1),
                useful=min(wanted / row["decode_rows"], 1.0) if row["decode_rows"] else 1.0)


def decompose(cell_rows: dict[str, dict], ours: str, baseline: str) -> dict[str, float]:
    """Split ``ours``'s speed-up over ``baseline`` into two factors whose product it is: how many
    more forward passes the baseline made, and how much longer each of them took (median run)."""
    def ms_per_pass(r: dict) -> float:
        return 1000 * r["output_tokens"] / r["tokens_per_s"] / r["forwards"]

    a, b = cell_rows[ours], cell_rows[baseline]
    return dict(ratio=a["tokens_per_s"] / b["tokens_per_s"], passes=b["forwards"] / a["forwards"],
                pass_cost=ms_per_pass(b) / ms_per_pass(a), ms_ours=ms_per_pass(a), ms_base=ms_per_pass(b))


def _runs(row: dict) -> str:
    return f"{row['min_tokens_per_s']:.0f}–{row['max_tokens_per_s']:.0f}"


def explain_cell(cell: tuple[str, str, int], rows: list[dict], matmul_share: float) -> str:
    """Why the schedules that miss a target in ``cell`` miss it, from the sweep's own counts:
    for each baseline, every missing schedule's two factors (``decompose``) and the spread of the
    runs, then the fact that sets those factors in this cell.

    ``matmul_share`` is the part of tinyserve's decode step spent in matmuls (section 11.10): the
    baseline runs the same matmuls, so it bounds how much cheaper tinyserve's pass can be."""
    cells = by_cell(rows)[cell]
    missed = [s for s in shortfalls(rows) if s.cell == cell]
    n, out_tokens = cells["tinyserve"]["num_requests"], cells["tinyserve"]["output_tokens"]
    text = []
    for base in BASELINES:
        mine = [s for s in missed if s.baseline == base]
        if not mine:
            continue
        parts = []
        for s in mine:
            d = decompose(cells, s.schedule, base)
            parts.append(f"{SCHEDULES[s.schedule]} {d['ratio']:.2f}× = {d['passes']:.2f}× the passes "
                         f"({cells[base]['forwards']} against {cells[s.schedule]['forwards']}) × "
                         f"{d['pass_cost']:.2f}× the time per pass ({d['ms_base']:.0f} against {d['ms_ours']:.0f} ms; "
                         f"runs {_runs(cells[s.schedule])} against {_runs(cells[base])} tok/s)")
        text.append(f"Below {mine[0].target:g}× {base}: " + "; ".join(parts) + ".")
        if base == "generate":
            useful = work(cells["generate"], n, out_tokens)["useful"]
            text.append(f"Static batching spent {1 - useful:.0%} of its decoding rows on finished or padded "
                        "requests" + (", so continuous batching had little waste to remove." if useful > 0.9
                                      else "."))
        else:
            d = decompose(cells, "tinyserve-orca", base)
            # Mean context of a request halfway through its output (what a decode pass attends to).
            context = (cells["tinyserve"]["prompt_tokens"] + out_tokens / 2) / n
            passes = "about even" if 0.9 <= d["passes"] <= 1.1 else f"{d['passes']:.2f}× the orca policy's"
            text.append(f"generate_batch's passes are {passes}; its attention reads up to {cell[2]} × "
                        f"{context:.0f} keys per query where tinyserve reads about {context:.0f}; and with "
                        f"everything but the matmuls free, the orca policy would reach at most "
                        f"{d['passes'] * d['ms_base'] / (matmul_share * d['ms_ours']):.2f}×.")
    vllm, orca = cells["tinyserve"], cells["tinyserve-orca"]
    if any(s.schedule == "tinyserve" for s in missed) and vllm["prefill_forwards"] > orca["prefill_forwards"]:
        text.append(f"The vllm policy ran {vllm['prefill_forwards']} passes of prompts alone, the orca policy "
                    f"{orca['prefill_forwards']}.")
    return " ".join(text)


def summary_table(rows: list[dict]) -> str:
    """The table of ``docs/performance.md``: tinyserve's tokens/s and its ratios, one line per cell."""
    head = ["prompts", "outputs", "running", "tinyserve tok/s"]
    head += [f"{SCHEDULES[o]} ÷ {b}" for b in BASELINES for o in OURS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (p, o, n), cell in by_cell(rows).items():
        out = [p, o, str(n), f"{cell['tinyserve']['tokens_per_s']:.1f}"]
        for b in BASELINES:
            for ours in OURS:
                v = cell[ours]["tokens_per_s"] / cell[b]["tokens_per_s"]
                out.append(f"**{v:.2f}×**" if v < target((p, o, n), b) else f"{v:.2f}×")
        lines.append("| " + " | ".join(out) + " |")
    return "\n".join(lines)


# Each target: the baseline, what the line says of the cells, and which cells it covers; the
# factor itself comes from ``target``.
TARGET_GROUPS = (("generate", "with mixed output lengths", lambda cell: not cell[1].startswith("uniform")),
                 ("generate", "with uniform output lengths", lambda cell: cell[1].startswith("uniform")),
                 ("generate_batch", "", lambda cell: True))


def target_summary(rows: list[dict]) -> list[str]:
    """One line per target: how many (cell, schedule) pairs meet it, the range of their ratios and
    every pair that misses it (the list under the table in ``docs/performance.md`` and chapter 11)."""
    cells, missed, lines = by_cell(rows), shortfalls(rows), []
    for base, which, chosen in TARGET_GROUPS:
        pairs = [(c, s) for c in cells if chosen(c) for s in OURS]
        if not pairs:
            continue
        label = f"at least {target(pairs[0][0], base):.1f}× `{base}`" + (f" {which}" if which else "")
        ratios = [cells[c][s]["tokens_per_s"] / cells[c][base]["tokens_per_s"] for c, s in pairs]
        misses = [m for m in missed if m.baseline == base and chosen(m.cell)]
        line = (f"{label}: met by {len(pairs) - len(misses)} of {len(pairs)} schedule-cells "
                f"(ratios {min(ratios):.2f}–{max(ratios):.2f}×)")
        # Name the fewer side: the pairs that miss, or, where most miss, those that meet it.
        missing = {(m.cell, m.schedule) for m in misses}
        named = [(c, s) for c, s in pairs if ((c, s) in missing) == (2 * len(misses) <= len(pairs))]
        if named and len(named) < len(pairs):
            verb = "missed" if 2 * len(misses) <= len(pairs) else "reached"
            line += f"; {verb} by " + ", ".join(
                f"{SCHEDULES[s]} on {c[0]}/{c[1]}/{c[2]} {ratios[pairs.index((c, s))]:.2f}×" for c, s in named)
        lines.append(line + ".")
    return lines


def dtype_speedups(slow: list[dict], fast: list[dict]) -> dict[tuple[str, str, int], dict[str, float]]:
    """``{cell: {system: fast tok/s ÷ slow tok/s}}`` for the cells two sweeps share: what a
    dtype change (float32 to bfloat16, measured on one machine) did to each system."""
    a, b = by_cell(slow), by_cell(fast)
    return {c: {s: b[c][s]["tokens_per_s"] / a[c][s]["tokens_per_s"] for s in OURS + BASELINES}
            for c in a if c in b}


def dtype_table(slow: list[dict], fast: list[dict], names: tuple[str, str] = ("float32", "bfloat16")) -> str:
    """The table of ``dtype_speedups`` in ``docs/performance.md`` and chapter 11: tinyserve's tokens/s in both
    dtypes, then each system's speed-up from the change."""
    head = ["prompts", "outputs", "running", f"tinyserve {names[0]} tok/s", f"tinyserve {names[1]} tok/s"]
    head += [f"{s} ×" for s in OURS + BASELINES]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    a, b = by_cell(slow), by_cell(fast)
    for cell, ups in dtype_speedups(slow, fast).items():
        out = [*map(str, cell)] + [f"{rows[cell]['tinyserve']['tokens_per_s']:.1f}" for rows in (a, b)]
        lines.append("| " + " | ".join(out + [f"{ups[s]:.2f}×" for s in OURS + BASELINES]) + " |")
    return "\n".join(lines)
