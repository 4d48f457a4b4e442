"""Chapter 06 and 07 views: marked K/V through real swaps, the split-x layout, the paged run."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from tinyserve import presets, sim  # noqa: E402
from tinyserve.block import Device  # noqa: E402
from tinyserve.cache_engine import CacheEngine  # noqa: E402
from tinyserve.config import CacheConfig  # noqa: E402
from tinyserve.lab import cache_sizing, marked_cache, paged_run  # noqa: E402
from tinyserve.viz import attention, cache  # noqa: E402
from tinyserve.viz.figures import REGISTRY  # noqa: E402


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def gids(ax, prefix: str) -> list:
    return [a for a in list(ax.patches) + list(ax.texts) if (a.get_gid() or "").startswith(prefix)]


# -- chapter 06: marked K/V -------------------------------------------------------------------------


def test_marks_round_trip_through_a_real_cache():
    engine = CacheEngine(CacheConfig(block_size=3, num_gpu_blocks=8, num_cpu_blocks=0), 3, 2, 4, torch.float32, "cpu")
    tables = {0: [5, 1], 4: [2, 7]}
    lens = {0: 6, 4: 4}
    for owner, table in tables.items():
        marked_cache.write_marked(engine, owner, table, 0, lens[owner])
    marks = marked_cache.read_marks(engine.gpu_cache[0][0])
    for owner, table in tables.items():
        for p in range(lens[owner]):
            assert marks[table[p // 3]][p % 3] == (owner, p)
    assert marks[7][1:] == [None, None] and marks[0] == [None] * 3  # never written
    # Every element of a written block is distinct, values are minus keys, layers differ.
    k0, v0 = engine.gpu_cache[0]
    k2 = engine.gpu_cache[2][0]
    assert k0[5].unique().numel() == k0[5].numel()
    assert torch.equal(v0, -k0)
    assert not torch.equal(k0[5], k2[5])


@pytest.fixture(scope="module")
def seed_frames():
    return marked_cache.seed_cache_rounds(18)


def test_seed_frames_follow_the_simulator(seed_frames):
    """The MarkingWorker drives the real Scheduler; its block tables and swaps are the sim's."""
    p = presets.seed_rounds("swap")
    records = sim.simulate(p.requests, p.scheduler_config, p.cache_config)
    assert len(seed_frames) == len(records) == 18
    for frame, rec in zip(seed_frames, records):
        assert frame.gpu_tables == rec.block_tables
        assert frame.cpu_tables == rec.cpu_block_tables
        assert bool(frame.swapped_out) == bool(rec.swapped_out)
        assert bool(frame.swapped_in) == bool(rec.swapped_in)
    assert seed_frames[2].swapped_out == {2: 0} and seed_frames[11].swapped_in == {0: 1}


def test_every_live_slot_holds_its_owners_token_after_every_round(seed_frames):
    """The invariant the swaps must keep: wherever a block table points, the cache holds that
    sequence's K/V for that position, GPU or CPU, even after blocks were reused by others."""
    checked = 0
    for frame in seed_frames:
        for pool, tables in ((frame.gpu, frame.gpu_tables), (frame.cpu, frame.cpu_tables)):
            for rid, table in tables.items():
                for p in range(frame.lens[rid]):
                    assert pool[table[p // 5]][p % 5] == (int(rid[1:]), p), (frame.round, rid, p)
                    checked += 1
    assert checked > 200


def test_swap_round_trip_on_marked_tensors_is_bit_for_bit():
    sched, engine = marked_cache.seed_scheduler(), marked_cache.seed_cache_engine()
    worker = marked_cache.MarkingWorker(engine)
    saved = None
    for n in range(1, 13):
        metas, out = sched.schedule()
        worker.apply_cache_orders(out)
        if n == 12:
            (cpu_block, gpu_block), = out.blocks_to_swap_in.items()
            for (k, v), (k0, v0) in zip(engine.gpu_cache, saved):
                assert torch.equal(k[gpu_block], k0) and torch.equal(v[gpu_block], v0)
        worker.write(metas)
        marked_cache.finish_round(sched, out)
        if n == 2:
            saved = [(k[2].clone(), v[2].clone()) for k, v in engine.gpu_cache]
    assert saved is not None


def test_draw_pools_fades_stale_bytes(seed_frames):
    frame = seed_frames[2]  # round 3: GPU block 2 went from s2 to s1
    fig = cache.draw_pools(frame)
    ax = fig.axes[0]
    cells = {a.get_gid(): a for a in gids(ax, "slot:")}
    assert len(cells) == (4 + 4) * 5
    assert cells["slot:GPU:2:0"].get_alpha() == 1.0  # s1's token 5, live
    assert cells["slot:GPU:2:1"].get_alpha() == 0.25  # s2's old token 1, stale
    assert cells["slot:CPU:0:1"].get_alpha() == 1.0  # s2's token 1, swapped out, live
    texts = {a.get_gid(): a.get_text() for a in gids(ax, "pos:")}
    assert texts["pos:GPU:2:0"] == "5" and texts["pos:CPU:0:2"] == "2"
    assert "swap_out GPU block 2→CPU block 0" in ax.get_title(loc="left")
    labels = [t.get_text() for t in ax.texts]
    assert "block 2 (s1)" in labels and not any(t.startswith("GPU 2") for t in labels)


def test_swap_figure_is_registered_and_draws_four_rounds(seed_frames):
    assert {"06_swap_pools", "06_split_x_layout", "06_copy_on_write", "06_memory_budget"} <= set(REGISTRY)
    fig = cache.fig_swap_pools(seed_frames)
    titles = [ax.get_title(loc="left") for ax in fig.axes]
    assert [t.split(":")[0] for t in titles] == [f"after round {r}" for r in cache.SWAP_FIGURE_ROUNDS]


def test_copy_on_write_story_copies_the_shared_block_before_the_writes():
    story = marked_cache.copy_on_write_story(block_size=4, prompt_len=6)
    assert story.appended == {"r.0": (1, 2), "r.1": None} and story.copies == {1: [2]}
    assert story.before.gpu_tables == {"r.0": [0, 1], "r.1": [0, 1]}
    assert story.after.gpu_tables == {"r.0": [0, 2], "r.1": [0, 1]}
    marks = marked_cache.read_marks(story.engine.gpu_cache[0][0])
    # Both samples read the whole prompt (owner 0) and then their own token (owners 1 and 2).
    for owner, table in ((1, [0, 2]), (2, [0, 1])):
        seen = [marks[table[p // 4]][p % 4] for p in range(7)]
        assert seen == [(0, p) for p in range(6)] + [(owner, 6)]
    for k, v in story.engine.gpu_cache:  # every layer, K and V: the copy is exact
        assert torch.equal(k[2, :2], k[1, :2]) and torch.equal(v[2, :2], v[1, :2])
    fig = cache.fig_copy_on_write(story)
    assert "share blocks 0, 1" in fig.axes[0].get_title(loc="left")


def test_memory_budget_figure_splits_the_device():
    gib = 2**30
    fig = cache.fig_memory_budget(total=40 * gib, used=10 * gib, activation=gib, shape=(32, 8, 128),
                                  dtype=torch.bfloat16, utilization=0.9)
    ax = fig.axes[0]
    widths = {p.get_gid(): p.get_width() for p in ax.patches if (p.get_gid() or "").startswith("part:")}
    block = 16 * 2 * 32 * 8 * 128 * 2
    blocks = (int(40 * gib * 0.9) - 10 * gib - gib) // block
    assert widths["part:KV cache"] == pytest.approx(blocks * block / gib)
    assert widths["part:headroom (1 − utilization)"] == pytest.approx(4.0, abs=1e-6)
    assert f"{blocks:,} blocks" in ax.get_title(loc="left")
    assert sum(widths.values()) <= 40


def test_pretend_gpu_runs_the_cuda_sizing_rule():
    total, free = 24 * 2**30, 20 * 2**30
    with cache_sizing.pretend_gpu(total, free):
        got = CacheEngine.profile_num_gpu_blocks(16, 30, 3, 64, torch.bfloat16, 0.8, 2**30)
    assert got == (int(total * 0.8) - (total - free) - 2**30) // (16 * 23_040)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA"):
            CacheEngine.profile_num_gpu_blocks(16, 30, 3, 64, torch.bfloat16)


def test_block_bytes_rows():
    rows = cache_sizing.block_bytes_rows({"smol": (30, 3, 64), "7b": (32, 32, 128)}, (torch.float32, torch.bfloat16))
    got = {(r["model"], r["dtype"]): r["block_bytes"] for r in rows}
    assert got[("smol", "bfloat16")] == 16 * 23_040
    assert got[("7b", "float32")] == 16 * 2 * 32 * 32 * 128 * 4
    assert all(r["per_token"] * 16 == r["block_bytes"] for r in rows)


# -- chapter 06: the split-x key layout --------------------------------------------------------------


def test_split_x_sizes():
    dtypes = (torch.float32, torch.float16, torch.bfloat16, torch.int8)
    assert [cache_sizing.split_x(d) for d in dtypes] == [4, 8, 8, 16]


@pytest.mark.parametrize("shape,x", [((3, 4, 2, 8), 4), ((2, 16, 3, 64), 8), ((1, 1, 1, 16), 16)])
def test_split_x_offsets_match_the_rearranged_tensor(shape, x):
    nb, bs, heads, head_dim = shape
    keys = torch.randn(shape)
    split = cache_sizing.to_split_x(keys, x)
    assert split.shape == (nb, heads, head_dim // x, bs, x) and split.is_contiguous()
    assert torch.equal(cache_sizing.from_split_x(split), keys)
    flat, flat_split = keys.flatten(), split.flatten()
    seen = set()
    for b in range(nb):
        for t in range(bs):
            for h in range(heads):
                for d in range(head_dim):
                    p = cache_sizing.plain_offset(b, t, h, d, bs, heads, head_dim)
                    s = cache_sizing.split_x_offset(b, t, h, d, bs, heads, head_dim, x)
                    assert flat[p] == keys[b, t, h, d] == flat_split[s]
                    seen.add(s)
    assert seen == set(range(keys.numel()))


def test_split_x_needs_a_whole_number_of_pieces():
    with pytest.raises(ValueError, match="multiple"):
        cache_sizing.to_split_x(torch.zeros(1, 2, 1, 6), 4)


def test_split_x_drawing_outlines_one_run_against_scattered_runs():
    fig = cache.draw_split_x(block_size=4, num_heads=2, head_dim=8, x=4)
    plain_ax, split_ax = fig.axes

    def hot(ax):
        return sorted(int(a.get_gid().split(":")[1]) for a in gids(ax, "elem:") if a.get_gid().endswith(":hot"))

    assert hot(split_ax) == list(range(16))
    assert hot(plain_ax) == [t * 16 + i for t in range(4) for i in range(4)]
    assert len(gids(plain_ax, "elem:")) == len(gids(split_ax, "elem:")) == 64
    assert "one contiguous run" in split_ax.get_title(loc="left")
    assert "4 separate runs" in plain_ax.get_title(loc="left")


# -- chapter 07: PagedRun and the token -> slot drawing ----------------------------------------------


@pytest.fixture(scope="module")
def tiny_run(tiny_loaded):
    torch.manual_seed(0)
    run = paged_run.PagedRun(tiny_loaded.model, block_size=3, num_blocks=12)
    # Not the pad token (id 2): its embedding is all zeros, and so would its K/V be.
    prompts = {"s0": [5, 9, 13, 3, 7], "s1": [4, 4, 8], "s2": [30, 31]}
    logits = {}
    out = run.step({"s0": prompts["s0"], "s1": prompts["s1"]})
    out.update(run.step({"s2": prompts["s2"]}))
    for s, row in out.items():
        logits[s] = [row]
    for _ in range(3):
        out = run.step({s: [int(rows[-1].argmax())] for s, rows in logits.items()})
        for s, row in out.items():
            logits[s].append(row)
    return run, prompts, logits


def test_paged_run_hands_out_blocks_and_slots_in_order(tiny_run):
    run, prompts, _ = tiny_run
    # FIFO allocator: s0 takes 0,1; s1 takes 2; s2 takes 3; decodes take new blocks as they cross.
    assert run.tables["s0"][:2] == [0, 1] and run.tables["s1"][0] == 2 and run.tables["s2"][0] == 3
    for s in prompts:
        assert len(run.tokens[s]) == len(prompts[s]) + 3
        mine = [w for w in run.writes if w.seq == s]
        assert [w.position for w in mine] == list(range(len(run.tokens[s])))
        assert [w.token_id for w in mine] == run.tokens[s]
        for w in mine:
            assert w.slot == run.tables[s][w.position // 3] * 3 + w.position % 3
            assert w.prefill == (w.step <= 2)
    assert len({w.slot for w in run.writes}) == len(run.writes)  # no slot written twice


def test_paged_run_cache_holds_exactly_the_recorded_slots(tiny_run):
    run, _, _ = tiny_run
    recorded = sorted(w.slot for w in run.writes)
    for k_cache, v_cache in run.engine.gpu_cache:
        for c in (k_cache, v_cache):
            assert (c.abs().sum(dim=(2, 3)) != 0).flatten().nonzero().flatten().tolist() == recorded


def test_paged_run_logits_match_transformers(tiny_run, tiny_model_dir):
    from transformers import LlamaForCausalLM as HFLlama

    run, prompts, logits = tiny_run
    hf = HFLlama.from_pretrained(str(tiny_model_dir), dtype=torch.float32, attn_implementation="eager").eval()
    for s in prompts:
        with torch.no_grad():
            want = hf(torch.tensor([run.tokens[s]])).logits[0, len(prompts[s]) - 1:]
        torch.testing.assert_close(torch.stack(logits[s]), want, atol=1e-4, rtol=0)


def test_prepare_builds_the_metadata_by_hand(tiny_loaded):
    run = paged_run.PagedRun(tiny_loaded.model, block_size=4, num_blocks=8)
    ids, positions, meta = run.prepare({"a": [1, 2, 3, 4, 5], "b": [6, 7]})
    assert ids.tolist() == [1, 2, 3, 4, 5, 6, 7] and positions.tolist() == [0, 1, 2, 3, 4, 0, 1]
    assert meta.slot_mapping.tolist() == [0, 1, 2, 3, 4, 8, 9]
    assert meta.block_tables.tolist() == [[0, 1], [2, 0]]  # padded with 0
    assert meta.context_lens.tolist() == [5, 2] and meta.query_start_loc.tolist() == [0, 5, 7]
    ids, positions, meta = run.prepare({"a": [9], "b": [8]})
    assert positions.tolist() == [5, 2] and meta.slot_mapping.tolist() == [5, 10] and meta.is_decode
    assert run.allocator.device == Device.GPU and run.allocator.get_num_free_blocks() == 5


def test_token_slot_drawing_shows_every_write(tiny_run, tiny_loaded):
    run, _, _ = tiny_run
    fig = attention.draw_token_slots(run.writes, run.block_size, run.engine.num_gpu_blocks, tiny_loaded.tokenizer,
                                     tables=run.tables)
    top, bottom = fig.axes
    tokens = gids(top, "token:")
    assert len(tokens) == len(run.writes)
    slots = {a.get_gid(): a for a in gids(bottom, "slot:") if hasattr(a, "get_hatch")}
    used_blocks = max(w.slot for w in run.writes) // 3 + 1
    assert len(slots) == used_blocks * 3
    for w in run.writes:
        assert (slots[f"slot:{w.slot}"].get_hatch() is None) == w.prefill
    texts = " ".join(t.get_text() for t in top.texts)
    assert all(f"block table {run.tables[s]}" in texts for s in run.tables)


def test_token_label():
    class Tok:
        def decode(self, ids):
            return {1: " name", 2: "supercalifragilistic", 3: "\n", 4: "\x13"}[ids[0]]

    assert attention.token_label(Tok(), 1) == "·name"
    assert attention.token_label(Tok(), 2) == "superc…"
    assert attention.token_label(Tok(), 3) == "⏎"
    assert attention.token_label(Tok(), 4) == "#4"  # a control character has no glyph
    assert attention.token_label(None, 42) == "42"
    assert "07_token_slots" in REGISTRY


def test_show_points_a_decorated_method_at_its_own_file():
    """Chapter 06 shows Worker.execute_model, which torch.inference_mode wraps."""
    from tinyserve.viz.source import show
    from tinyserve.worker import Worker

    view = show(Worker.execute_model)
    assert "tinyserve/worker.py:" in repr(view).splitlines()[0]
    assert "def execute_model" in view.code
