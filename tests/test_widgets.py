"""The book's widgets of chapters 03, 04, 05, 08 and 13, driven headlessly: every control is swept over
its whole range and what the widget shows is checked against numbers computed here, from the
real objects, without the widget (or the lab module it draws from)."""

from __future__ import annotations

import pytest
import torch
from test_policy_runs import drive
from test_stepper import PNG_MAGIC, assert_stays_put, data_step, fields, picture

from tinyserve import presets, sim
from tinyserve.block import Device
from tinyserve.config import CacheConfig, SchedulerConfig
from tinyserve.lab.block_ops import BLOCK_STORY, play_block_script
from tinyserve.lab.kernel_walk import walk_sequence_blocks
from tinyserve.lab.policy_runs import budget, policy_preset, three_policies
from tinyserve.lab.records import recomputed_tokens
from tinyserve.lab.whatif import WhatIfSettings, explore, whatif_workload
from tinyserve.viz.kernel_walk import KernelWalkStepper
from tinyserve.viz.whatif import MODES, WhatIfExplorer
from tinyserve.viz.widgets_blocks import BlockOpsStepper
from tinyserve.viz.widgets_orca import PolicyStepper


def sweep_slider(slider):
    values, v = [], slider.min
    while v <= slider.max + 1e-9:
        values.append(round(v, 6))
        v += slider.step
    return values


# -- chapter 03: the block manager, one operation at a time ------------------------------------


def manager_states(script=BLOCK_STORY):
    """After each operation: every live sequence's (device, blocks, ref counts) and the free counts,
    read from the manager itself."""
    states = []

    def observe(bm, seqs, op):
        tables = {}
        for label, seq in seqs.items():
            blocks = bm.block_tables.get(seq.seq_id)
            tables[label] = ((blocks[0].device.name, [b.block_number for b in blocks], [b.ref_count for b in blocks])
                             if blocks else None)
        states.append((op, tables, bm.get_num_free_gpu_blocks(), bm.get_num_free_cpu_blocks()))

    play_block_script(script, observe=observe)
    return states


def test_block_stepper_shows_the_manager_after_every_operation():
    stepper = BlockOpsStepper()
    states = manager_states()
    assert stepper.slider.max == len(BLOCK_STORY) == len(states)
    images = []
    for value in range(1, stepper.slider.max + 1):
        stepper.slider.value = value
        f = fields(stepper.view.value)
        op, tables, free_gpu, free_cpu = states[value - 1]
        assert f["operation"] == BLOCK_STORY[value - 1] == op.line
        assert f["returned"] == f"<code>{op.result}</code>"
        for label, table in tables.items():
            if table is None:
                assert f[label] == "no blocks"
            else:
                device, numbers, refs = table
                assert f[label] == f"{device} [" + ", ".join(f"{n} (ref {r})" for n, r in zip(numbers, refs)) + "]"
        assert f["free GPU"].startswith(f"{free_gpu} of 8")
        assert f["free CPU"].startswith(f"{free_cpu} of 4")
        png, alt, _ = picture(stepper.view.value)
        assert alt == f"{value}. {BLOCK_STORY[value - 1]}"
        images.append(png)
    assert all(a != b for a, b in zip(images, images[1:])), "every operation changes the drawing"
    for value in range(stepper.slider.max - 1, 0, -1):
        stepper.prev_button.click()
        assert data_step(stepper.view.value) == value


def test_block_story_does_what_chapter_03_says():
    """Hand-written facts of the story: fork shares, append copies on write once, swaps move
    distinct blocks, and freeing everything leaves every block free with ref count 0."""
    states = {op.line: (op, tables, g, c) for op, tables, g, c in manager_states()}
    _, t, _, _ = states["fork A.0 A.1"]
    assert t["A.0"] == t["A.1"] and t["A.0"][2] == [2, 2]
    op, t, _, _ = states["append A.0"]
    src, dst = eval(op.result)  # (src, dst): A.0 left the shared block for a copy
    assert src in t["A.1"][1] and dst in t["A.0"][1] and src != dst
    assert "copy-on-write" in op.meaning
    op, t, _, _ = states["append A.1"]
    assert op.result == "None" and t["A.1"][2] == [2, 1]  # its last block is its own now
    op, t, _, _ = states["append B"]
    assert op.result == "None" and len(t["B"][1]) == 2   # a 5th token starts a new block
    op, t, _, c = states["swap_out A"]
    assert len(eval(op.result)) == 3 and c == 1 and t["A.0"][0] == "CPU" and t["A.0"][1][0] == t["A.1"][1][0]
    op, t, _, c = states["swap_in A"]
    assert c == 4 and t["A.0"][0] == "GPU" and t["A.0"][2] == [2, 1]
    _, t, g, c = states["free B"]
    assert (g, c) == (8, 4) and all(v is None for v in t.values())


def test_block_script_refusals_and_bad_lines():
    # Swap space of one block cannot take A's two blocks: refused, shown, nothing changes.
    stepper = BlockOpsStepper(["allocate A", "swap_out A"], requests={"A": (6, 1)}, num_cpu_blocks=1, draw=False)
    stepper.next_button.click()
    f = fields(stepper.view.value)
    assert f["returned"] == "<code>False</code>" and "refused" in f and f["A"].startswith("GPU")
    with pytest.raises(ValueError, match="line 2 'fork A B'"):
        BlockOpsStepper(["allocate A", "fork A B"], requests={"A": (4, 1)}, draw=False)
    with pytest.raises(ValueError, match="line 1 'grow A'"):
        play_block_script(["grow A"])


# -- chapter 04: orca and vllm, round by round -------------------------------------------------


def test_policy_stepper_sweeps_both_runs():
    run = lambda p: sim.simulate(p.requests, p.scheduler_config, p.cache_config)  # noqa: E731
    orca, vllm = run(presets.orca_example("orca")), run(presets.orca_example("vllm"))
    stepper = PolicyStepper(orca, vllm)
    assert stepper.slider.max == max(len(orca), len(vllm)) == 17
    images = []
    for value in range(1, 18):
        stepper.slider.value = value
        view = stepper.view.value
        for name, records in (("orca", orca), ("vllm", vllm)):
            text = view.split(f"<b>{name}</b>: ", 1)[1]
            if value > len(records):
                assert text.startswith(f"done: every request finished by round {len(records)}")
                continue
            r = records[value - 1]
            assert text.startswith(f"round {value} · {r.phase}")
            # No preemption in this workload: a batch member prefills iff it never ran before.
            before = {rid for q in records[:value - 1] for rid in q.batch}
            col = fields(text.split('<div class="tinyserve-column"', 1)[0])
            assert col["prefill"] == (", ".join(f"{rid} ({r.chunk_sizes[rid]})" for rid in r.batch
                                                if rid not in before) or "—")
            assert col["decode"] == (", ".join(rid for rid in r.batch if rid in before) or "—")
        images.append(picture(view)[0])
    assert len(set(images)) == 17
    # Hand-written: round 2 under vllm prefills D alone while A, B and C sit idle.
    stepper.slider.value = 2
    vllm_text = fields(stepper.view.value.split("<b>vllm</b>", 1)[1])
    assert (vllm_text["prefill"], vllm_text["decode"], vllm_text["idle in running"]) == ("D (4)", "—", "A, B, C")


# -- chapter 13: v0.4's vllm, orca and v1, round by round ----------------------------------------


def columns(view: str) -> list[dict[str, str]]:
    """The stepper's columns, one dict of label -> text each."""
    text = view.split('<img', 1)[0]
    return [fields(col) for col in text.split('<div class="tinyserve-column"')[1:]]


@pytest.mark.parametrize("preset", ["seed", "orca_example"])
def test_three_policy_stepper_sweeps_every_round(preset):
    """Every round of all three runs, against a run of the Scheduler made here (test_policy_runs.drive):
    who prefilled (with the tokens it brought) and who decoded is read off the scheduler's own
    is_prompt, not off the records."""
    runs = three_policies(preset)
    names = ("vllm", "orca", "v1")
    draw = preset == "seed"  # the text of both; the pictures of one (drawing every round is slow)
    stepper = PolicyStepper(runs["vllm"], runs["orca"], runs["v1"], names=names, budget=budget(preset), draw=draw)
    driven = {}
    for name in names:
        p = policy_preset(preset, name)
        driven[name] = drive(p.requests, p.scheduler_config, p.cache_config)[0]
        assert len(driven[name]) == len(runs[name])
    n = max(len(run) for run in runs.values())
    assert stepper.slider.max == n and stepper.num_steps == n
    images = []
    for value in range(1, n + 1):
        stepper.slider.value = value
        view = stepper.view.value
        cols = columns(view)
        assert len(cols) == 3 and data_step(view) == value
        for name, col in zip(names, cols):
            rounds = driven[name]
            if value > len(rounds):
                assert col == {name: f"done: every request finished by round {len(rounds)}"}
                continue
            r = rounds[value - 1]
            assert col[name].startswith(f"round {value} · ")
            assert col["prefill"] == (", ".join(f"{rid} ({k})" for rid, k, prompt in r["members"] if prompt) or "—")
            assert col["decode"] == (", ".join(rid for rid, _, prompt in r["members"] if not prompt) or "—")
            assert col["tokens in batch"] == f"{r['tokens']} of {budget(preset)}"
            scheduled = {rid for rid, *_ in r["members"]}
            assert col["idle in running"] == (", ".join(x for x in r["running"] if x not in scheduled) or "—")
            assert col["preempted"] == (", ".join(r["preempted"]) or "—")
            assert col["waiting"] == (", ".join(r["waiting"]) or "—")
            assert col["finished"] == (", ".join(r["finished"]) or "—")
            assert ("swapped" in col) == any(q.swapped for q in runs[name])  # only a run that swapped shows it
        if draw:
            png, alt, _ = picture(view)
            assert alt == f"round {value}"
            images.append(png)
    assert len(set(images)) == (n if draw else 0), "every round changes the drawing"
    for value in range(n - 1, 0, -1):
        stepper.prev_button.click()
        assert data_step(stepper.view.value) == value
    stepper.next_button.click()
    assert data_step(stepper.view.value) == 2


def test_three_policy_stepper_hand_written_rounds_and_saved_view():
    runs = three_policies("seed")
    stepper = PolicyStepper(runs["vllm"], runs["orca"], runs["v1"], names=("vllm", "orca", "v1"), budget=10,
                            draw=False)  # the saved view is drawn all the same
    # Round 2: v0.4 prefills s2 alone while s0 and s1 sit idle; orca and v1 decode s0 and s1.
    stepper.slider.value = 2
    vllm, orca, v1 = columns(stepper.view.value)
    assert (vllm["prefill"], vllm["decode"], vllm["idle in running"]) == ("s2 (3)", "—", "s0, s1")
    assert (orca["decode"], orca["waiting"]) == (v1["decode"], v1["waiting"]) == ("s0, s1", "s2")
    # Round 3: v0.4 preempts s2 (swapped out); v1 preempts nobody, s2 still waits for blocks.
    stepper.slider.value = 3
    vllm, orca, v1 = columns(stepper.view.value)
    assert (vllm["preempted"], vllm["swapped"]) == ("s2", "s2") and (v1["preempted"], v1["waiting"]) == ("—", "s2")
    # Round 9: v1's s1 comes back with its prompt block cached and prefills beside s2.
    stepper.slider.value = 9
    v1 = columns(stepper.view.value)[2]
    assert (v1["prefill"], v1["tokens in batch"]) == ("s1 (6), s2 (3)", "9 of 10")
    # The last round: orca and v1 finished two rounds before v0.4.
    stepper.slider.value = stepper.slider.max
    vllm, orca, v1 = columns(stepper.view.value)
    assert vllm["finished"] == "s2" and orca == {"orca": "done: every request finished by round 16"}
    # The key rounds: the first ones, the preemptions and every run's end; the saved view shows the last.
    assert stepper.key_steps() == [0, 1, 2, 3, 6, 15, 17]
    bundle = stepper._repr_mimebundle_()
    assert picture(bundle["text/html"])[0].startswith(PNG_MAGIC)
    assert "application/vnd.jupyter.widget-view+json" in bundle
    assert bundle["text/plain"] == "▶ run the cell to step through the 18 rounds; the picture shows round 18"


def test_policy_stepper_keeps_two_runs_and_refuses_bad_arguments():
    runs = three_policies("orca_example")
    two = PolicyStepper(runs["orca"], runs["vllm"], draw=False)
    assert two.names == ("orca", "vllm") and len(columns(two.view.value)) == 2
    assert "of" not in fields(two.view.value)["tokens in batch"]  # no budget given, none shown
    assert two.key_steps() == [0, 1, 2, 3, 14, 16]  # chapter 04's key rounds, as before
    per_run = PolicyStepper(runs["orca"], runs["v1"], names=("a", "b"), budget=(64, None), draw=False)
    a, b = columns(per_run.view.value)
    assert a["tokens in batch"].endswith(" of 64") and "of" not in b["tokens in batch"]
    with pytest.raises(ValueError, match="names"):
        PolicyStepper(runs["vllm"], runs["orca"], runs["v1"], draw=False)
    with pytest.raises(ValueError, match="names"):
        PolicyStepper(runs["vllm"], runs["orca"], names=("x",), draw=False)
    with pytest.raises(ValueError, match="at least two"):
        PolicyStepper(runs["vllm"], names=("x",), draw=False)
    with pytest.raises(ValueError, match="non-empty"):
        PolicyStepper(runs["vllm"], [], draw=False)
    with pytest.raises(ValueError, match="budget"):
        PolicyStepper(runs["vllm"], runs["orca"], budget=(1, 2, 3), draw=False)


# -- chapter 05: the what-if explorer ----------------------------------------------------------


def independent_counts(requests, settings: WhatIfSettings):
    records = sim.simulate(list(requests),
                           SchedulerConfig(max_num_batched_tokens=settings.max_num_batched_tokens,
                                           max_num_seqs=settings.max_num_seqs, max_model_len=settings.max_model_len,
                                           preemption_mode=settings.preemption_mode),
                           CacheConfig(block_size=settings.block_size, num_gpu_blocks=settings.num_gpu_blocks,
                                       num_cpu_blocks=settings.cpu_factor * settings.num_gpu_blocks,
                                       watermark=settings.watermark))
    return records, len(records), sum(len(r.preempted) for r in records)


def test_whatif_sweeps_every_control():
    explorer = WhatIfExplorer(draw=False)
    requests = whatif_workload()
    sweeps = [(explorer.gpu_blocks, sweep_slider(explorer.gpu_blocks)),
              (explorer.watermark, sweep_slider(explorer.watermark)),
              (explorer.token_budget, sweep_slider(explorer.token_budget)),
              (explorer.mode, list(MODES))]
    seen = 0
    for control, values in sweeps:
        start = control.value
        for value in values:
            control.value = value
            s = explorer.settings
            assert (s.num_gpu_blocks, s.watermark, s.max_num_batched_tokens, s.preemption_mode) == (
                explorer.gpu_blocks.value, round(explorer.watermark.value, 2), explorer.token_budget.value,
                MODES[explorer.mode.value])
            records, rounds, preemptions = independent_counts(requests, s)
            f = fields(explorer.view.value)
            assert f["rounds to finish"].startswith(f"{rounds} (")
            assert f["preemptions"] == str(preemptions)
            again = int(f["tokens computed again"])
            out_blocks, in_blocks = map(int, f["blocks swapped out / in"].split(" / "))
            ignored = [rid for r in records for rid in r.ignored]
            assert f["ignored (dropped unfinished)"] == dropped_text(records)
            if preemptions == 0:
                assert again == 0 and out_blocks == in_blocks == 0
            if s.preemption_mode == "recompute":
                assert out_blocks == 0
            if s.preemption_mode == "swap" and not ignored:
                assert again == 0 and out_blocks == in_blocks  # all that left came back
            if not ignored and preemptions and s.preemption_mode != "swap":
                # viz.rounds counts every token prefilled again, including at most one per
                # re-prefill that is new work (the token the re-prefill samples): a bound.
                assert 0 < again <= recomputed_tokens(records, requests) <= again + preemptions
            seen += 1
        control.value = start
    assert seen == sum(len(v) for _, v in sweeps)


def dropped_text(records) -> str:
    """What the explorer must say about the requests the scheduler dropped, read off the rounds:
    one that was in a batch before the round it was dropped in ran; any other never did."""
    dropped = {rid: r.round for r in records for rid in r.ignored}
    ran = [rid for rid, when in dropped.items() if any(rid in r.batch for r in records if r.round < when)]
    never = [rid for rid in dropped if rid not in ran]
    parts = ([f"{', '.join(ran)} after running: back from preemption, too long for the whole cache"] if ran else []) + (
        [f"{', '.join(never)} never ran: its prompt is too long"] if never else [])
    return "; ".join(parts) or "—"


def test_whatif_says_the_dropped_requests_ran_as_the_picture_shows():
    """At 8 blocks (32 tokens) r0–r3 run, get preempted at 33 tokens, and come back by recompute as
    prompts of 33 tokens: more than the whole cache. The scheduler drops them, after rounds of
    running, and the view says so (not "can never run"); the picture draws those rounds."""
    explorer = WhatIfExplorer(draw=False)
    explorer.gpu_blocks.value = 8
    records = explorer.outcome.records
    f = fields(explorer.view.value)
    assert f["ignored (dropped unfinished)"] == (
        "r0, r1, r2, r3 after running: back from preemption, too long for the whole cache") == dropped_text(records)
    assert "never" not in explorer.view.value
    for rid in ("r0", "r1", "r2", "r3"):
        rounds_run = sum(rid in r.batch for r in records)
        assert rounds_run >= 10, f"{rid} ran {rounds_run} rounds before it was dropped"
    # A prompt over max_model_len (48) is refused at admission: that one never ran.
    huge = WhatIfExplorer(requests=[*whatif_workload(), sim.Request("huge", 60, 4, 2)], draw=False)
    f = fields(huge.view.value)
    assert f["ignored (dropped unfinished)"] == "huge never ran: its prompt is too long" == dropped_text(
        huge.outcome.records)
    assert not any("huge" in r.batch for r in huge.outcome.records)


def test_whatif_x_axis_stays_fixed_over_every_slider(monkeypatch):
    """Sweep each control over its whole range: the timeline's x-axis never changes, and every run
    fits in it. The text area keeps its height. (Each setting is drawn, not rendered to pixels.)"""
    import io

    from PIL import Image

    from tinyserve.viz import widget_view

    buf = io.BytesIO()
    Image.new("RGB", (4, 2), "white").save(buf, format="PNG")
    monkeypatch.setattr(widget_view, "render_png", lambda fig, dpi: buf.getvalue())
    explorer = WhatIfExplorer()
    xlim = explorer.figure.axes[-1].get_xlim()
    assert xlim == (0.5, explorer.max_rounds() + 0.5)
    longest = 0
    for control, values in [(explorer.gpu_blocks, sweep_slider(explorer.gpu_blocks)),
                            (explorer.watermark, sweep_slider(explorer.watermark)),
                            (explorer.token_budget, sweep_slider(explorer.token_budget)),
                            (explorer.mode, list(MODES))]:
        start = control.value
        for value in values:
            control.value = value
            assert explorer.outcome is not None
            assert [ax.get_xlim() for ax in explorer.figure.axes[:2]] == [xlim, xlim], (control.description, value)
            assert 'height:7.0em;' in explorer.view.value
            longest = max(longest, explorer.outcome.rounds)
        control.value = start
    assert longest <= explorer.max_rounds() and longest >= 2 * explorer.unconstrained.rounds


def test_whatif_axis_holds_random_settings_anywhere_in_the_range():
    """The axis comes from the edge of the ranges where the cache is smallest; settings drawn at
    random from the whole range (every control at once) never run longer."""
    import random

    explorer = WhatIfExplorer(draw=False)
    limit = explorer.max_rounds()
    gen = random.Random(34)
    for _ in range(60):
        s = explorer.base.but(num_gpu_blocks=gen.choice(sweep_slider(explorer.gpu_blocks)),
                              watermark=gen.choice(sweep_slider(explorer.watermark)),
                              max_num_batched_tokens=gen.choice(sweep_slider(explorer.token_budget)),
                              preemption_mode=gen.choice(list(MODES.values())))
        assert independent_counts(whatif_workload(), s)[1] <= limit, s


def test_whatif_redraws_and_saves():
    explorer = WhatIfExplorer()
    first = picture(explorer.view.value)[0]
    explorer.gpu_blocks.value = 12
    second = picture(explorer.view.value)[0]
    explorer.mode.value = "swap"
    third = picture(explorer.view.value)[0]
    assert len({first, second, third}) == 3
    bundle = explorer._repr_mimebundle_()
    assert picture(bundle["text/html"])[0].startswith(PNG_MAGIC)
    assert "application/vnd.jupyter.widget-view+json" in bundle
    assert bundle["text/plain"] == f"▶ run the cell to move the sliders; the picture shows {explorer.outcome.summary()}"


def test_whatif_shows_a_refused_setting():
    explorer = WhatIfExplorer(settings=WhatIfSettings(max_num_seqs=16), draw=False)
    explorer.token_budget.value = 8
    assert "max_num_batched_tokens" in fields(explorer.view.value)["not a valid setting"]
    explorer.token_budget.value = 32
    assert "preemptions" in fields(explorer.view.value)
    with pytest.raises(ValueError, match="watermark"):
        explore(whatif_workload(), WhatIfSettings(watermark=1.5))


# -- every stepper of the book stays put and fits a laptop's screen -------------------------------


def book_steppers():
    """The steppers as chapters 03, 04 and 13 build them (08's below, with its toggles)."""
    run = lambda p: sim.simulate(p.requests, p.scheduler_config, p.cache_config)  # noqa: E731
    seed, ae = three_policies("seed"), three_policies("orca_example")
    return {
        "03": lambda: BlockOpsStepper(draw=False),
        "04": lambda: PolicyStepper(run(presets.orca_example("orca")), run(presets.orca_example("vllm")), draw=False),
        "13 seed": lambda: PolicyStepper(seed["vllm"], seed["orca"], seed["v1"], names=("vllm", "orca", "v1"),
                                         budget=budget("seed"), draw=False),
        "13 A-E": lambda: PolicyStepper(ae["vllm"], ae["orca"], ae["v1"], names=("vllm", "orca", "v1"),
                                        budget=budget("orca_example"), draw=False),
    }


@pytest.mark.parametrize("name", ["03", "04", "13 seed", "13 A-E"])
def test_book_steppers_keep_their_layout_at_every_step(name):
    """BlockOpsStepper's text once took two columns or nine lines depending on the operation, and
    chapter 13's steppers were 808 and 924 px tall: now every step has one text height that
    holds its lines, and the whole widget fits in 700 px."""
    stepper = book_steppers()[name]()
    assert_stays_put(stepper)
    assert len({len(stepper.step_columns(i)) for i in range(stepper.num_steps)}) == 1  # columns never come and go


def test_kernel_walk_keeps_its_layout_for_every_program():
    q, k, v, tables, lens, scale = small_batch()
    stepper = KernelWalkStepper(q, k, v, tables, lens, scale, draw=False)
    heights = set()
    for seq in range(len(lens)):
        stepper.seq_toggle.value = seq
        for kv_head in range(2):
            stepper.head_toggle.value = kv_head
            assert_stays_put(stepper)
            heights.add(stepper.text_lines())
    assert len(heights) == 1, "the text area changes height with the program"


# -- chapter 08: one program's walk through its blocks -----------------------------------------


def small_batch(seed=0):
    """Three sequences in a shuffled pool of 8-token blocks; 4 query heads over 2 KV heads."""
    gen = torch.Generator().manual_seed(seed)
    lens, block_size, kv_heads, heads, dim = [37, 16, 5], 8, 2, 4, 16
    need = [-(-n // block_size) for n in lens]
    order = torch.randperm(sum(need) + 3, generator=gen).tolist()
    tables = [order[sum(need[:s]):sum(need[:s + 1])] for s in range(len(lens))]
    k = torch.randn(len(order), block_size, kv_heads, dim, generator=gen)
    v = torch.randn(len(order), block_size, kv_heads, dim, generator=gen)
    q = torch.randn(len(lens), heads, dim, generator=gen)
    return q, k, v, tables, lens, dim ** -0.5


def softmax_state(q, k, v, table, n, kv_head, heads, scale, block_size):
    """The online-softmax state after the first n tokens, computed all at once by slot."""
    pos = torch.arange(n)
    blocks, rows = torch.tensor(table)[pos // block_size], pos % block_size
    keys, vals = k[blocks, rows, kv_head], v[blocks, rows, kv_head]
    scores = (q[heads] @ keys.T) * scale
    m = scores.max(dim=1).values
    return m, torch.exp(scores - m[:, None]).sum(dim=1), torch.softmax(scores, dim=1) @ vals


def test_kernel_walk_stepper_sweeps_every_program_and_block():
    q, k, v, tables, lens, scale = small_batch()
    stepper = KernelWalkStepper(q, k, v, tables, lens, scale, seq=0, kv_head=0, draw=False)
    programs = 0
    for seq in range(len(lens)):
        stepper.seq_toggle.value = seq
        for kv_head in range(2):
            stepper.head_toggle.value = kv_head
            heads = [2 * kv_head, 2 * kv_head + 1]
            n_blocks = -(-lens[seq] // 8)
            assert stepper.slider.value == 1 and stepper.slider.max == n_blocks
            for value in range(1, n_blocks + 1):
                stepper.slider.value = value
                f = fields(stepper.view.value)
                assert f["block"] == f"{value} of {n_blocks}: logical L{value - 1} → physical block " \
                                     f"{tables[seq][value - 1]}"
                visit = stepper.walk.visits[value - 1]
                m, total, out = softmax_state(q[seq], k, v, tables[seq], min(8 * value, lens[seq]), kv_head, heads,
                                              scale, 8)
                torch.testing.assert_close(visit.m, m)
                torch.testing.assert_close(visit.l, total, rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(visit.output(), out, rtol=1e-5, atol=1e-5)
                assert f["m before → after"].endswith("[" + ", ".join(f"{float(x):.3g}" for x in m) + "]")
            assert "max |walk − reference.paged_decode_attention|" in stepper.view.value
            assert stepper.walk.max_error < 1e-5
            programs += 1
    assert programs == 6


def test_kernel_walk_pictures_follow_the_blocks():
    q, k, v, tables, lens, scale = small_batch(1)
    stepper = KernelWalkStepper(q, k, v, tables, lens, scale)
    images = [picture(stepper.view.value)[0]]
    for _ in range(stepper.slider.max - 1):
        stepper.next_button.click()
        images.append(picture(stepper.view.value)[0])
    assert len(set(images)) == len(images) == 5
    assert picture(stepper._repr_mimebundle_()["text/html"])[0].startswith(PNG_MAGIC)


def test_kernel_walk_refuses_bad_programs():
    q, k, v, tables, lens, scale = small_batch()
    with pytest.raises(ValueError, match="kv_head"):
        walk_sequence_blocks(q, k, v, tables, lens, scale, seq=0, kv_head=2)
    with pytest.raises(ValueError, match="seq"):
        walk_sequence_blocks(q, k, v, tables, lens, scale, seq=3)


def test_walk_reads_only_its_own_blocks():
    """Poison every slot outside the sequence's context with NaN: the walk must stay finite."""
    q, k, v, tables, lens, scale = small_batch(2)
    k2, v2 = torch.full_like(k, float("nan")), torch.full_like(v, float("nan"))
    for pos in range(lens[1]):
        b, r = tables[1][pos // 8], pos % 8
        k2[b, r], v2[b, r] = k[b, r], v[b, r]
    walk = walk_sequence_blocks(q, k2, v2, tables, lens, scale, seq=1, kv_head=1)
    assert torch.isfinite(walk.out).all()
    assert [visit.physical for visit in walk.visits] == tables[1] and Device.GPU.name == "GPU"
