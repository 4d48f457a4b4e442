"""Chapter 01-03 drawings and measurements: they run on live objects and show what they claim."""

from __future__ import annotations

import random

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from tinyserve import presets, sim  # noqa: E402
from tinyserve.block import BlockAllocator, Device  # noqa: E402
from tinyserve.block_manager import BlockSpaceManager  # noqa: E402
from tinyserve.lab import block_snapshot, block_stories, kv_memory  # noqa: E402
from tinyserve.sequence import SamplingParams, Sequence, SequenceGroup, SequenceStatus  # noqa: E402
from tinyserve.viz import blocks, kv_cache, slots  # noqa: E402
from tinyserve.viz.figures import REGISTRY, draw  # noqa: E402


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def by_gid(ax, key: str) -> list:
    """Artists whose gid starts with ``key`` when it ends with ":" (a family), else equals it."""
    artists = list(ax.patches) + list(ax.texts)
    if key.endswith(":"):
        return [a for a in artists if (a.get_gid() or "").startswith(key)]
    return [a for a in artists if a.get_gid() == key]


def text_of(ax, gid: str) -> str:
    (t,) = by_gid(ax, gid)
    return t.get_text()


# -- chapter 01: sizes and fragmentation ------------------------------------------------------------


def test_kv_bytes_per_token_of_the_book_models():
    s, llama = kv_memory.MODELS["SmolLM2-135M"], kv_memory.MODELS["Llama-2-7B"]
    assert kv_memory.kv_bytes_per_token(s.num_layers, s.num_kv_heads, s.head_dim, 2) == 23_040  # 22.5 KiB
    assert kv_memory.kv_bytes_per_token(llama.num_layers, llama.num_kv_heads, llama.head_dim, 2) == 512 * 1024
    rows = {(r["model"], r["dtype"]): r for r in kv_memory.kv_table(context=2048)}
    assert rows[("Llama-2-7B", "float16")]["MiB_per_seq"] == 1024
    assert rows[("SmolLM2-135M", "float32")]["bytes_per_token"] == 2 * 23_040


def test_first_fit_arena_places_runs_at_the_lowest_hole_that_fits():
    rng = random.Random(1)
    arena = kv_memory.FirstFitArena(64)
    taken = [False] * 64
    for step in range(500):
        if arena.runs and rng.random() < 0.45:
            owner = rng.choice(list(arena.runs))
            start, n = arena.runs[owner]
            taken[start:start + n] = [False] * n
            arena.release(owner)
            continue
        n = rng.randint(1, 12)
        lowest = next((s for s in range(64 - n + 1) if not any(taken[s:s + n])), None)
        placed = arena.reserve(step, n)
        assert placed == (lowest is not None)
        if placed:
            assert arena.runs[step] == (lowest, n)
            taken[lowest:lowest + n] = [True] * n
        holes = arena.holes()
        assert sum(holes) == taken.count(False)


@pytest.fixture(scope="module")
def fragmentation():
    reqs = kv_memory.fragmentation_workload(num_requests=60, max_model_len=256, seed=3, arrival_rate=1.0)
    return reqs, kv_memory.measure_fragmentation(reqs, arena_slots=1024, max_model_len=256, block_size=16)


def test_fragmentation_accounts_for_every_slot_at_every_step(fragmentation):
    _, results = fragmentation
    for r in results.values():
        total = r.used + r.internal + r.external + r.free
        assert (total == r.arena_slots).all(), r.scheme
        assert (r.used >= 0).all() and (r.internal >= 0).all() and (r.external >= 0).all() and (r.free >= 0).all()
        assert r.running[-1] >= 1 and (r.running >= 0).all()
        assert abs(sum(r.shares().values()) - 1) < 1e-9


def test_paging_wastes_less_than_a_block_per_sequence(fragmentation):
    _, results = fragmentation
    paged = results["paged"]
    assert (paged.internal < 16 * paged.running).all()
    assert paged.per_seq_internal_max < 16
    assert (paged.external == 0).all()
    assert paged.extra["leaked_blocks"] == 0


def test_contiguous_reservation_wastes_at_least_as_much_as_paging(fragmentation):
    _, results = fragmentation
    paged = results["paged"].shares(only_when_waiting=True)
    for scheme in ("max_len", "max_tokens"):
        s = results[scheme].shares(only_when_waiting=True)
        assert s["internal"] + s["external"] >= paged["internal"] + paged["external"]
        assert results[scheme].waste_of_reserved() > results["paged"].waste_of_reserved()
    # Equal max_model_len reservations tile the arena: every hole fits the next one.
    assert (results["max_len"].external == 0).all()
    assert results["max_len"].running.max() == 1024 // 256


def test_every_request_runs_to_completion_in_every_scheme(fragmentation):
    reqs, results = fragmentation
    # Each step, every running sequence gains one token; so the sum over steps of the running
    # count is the number of tokens generated, which must cover every request's output at least
    # once (paging may regenerate tokens of preempted requests).
    wanted = sum(r.output_len for r in reqs)
    for r in results.values():
        if r.preemptions == 0:
            assert r.running.sum() == wanted, r.scheme
        else:
            assert r.running.sum() > wanted, r.scheme


def test_fragmentation_figure_draws_one_bar_per_scheme(fragmentation):
    _, results = fragmentation
    fig = kv_cache.draw_fragmentation(results)
    bars_ax, lines_ax = fig.axes[:2]
    assert len(bars_ax.patches) == 3 * 4  # four states per scheme
    assert len(lines_ax.lines) == 3


# -- chapters 02 and 03: block tables -------------------------------------------------------------


def live_manager():
    """Two requests on a tiny manager; A is forked into two samples and both have decoded."""
    bm = BlockSpaceManager(block_size=4, num_gpu_blocks=10, num_cpu_blocks=6, watermark=0.0)
    a = Sequence(0, None, list(range(6)), 4)
    b = Sequence(1, None, list(range(3)), 4)
    ga = SequenceGroup("A", [a], SamplingParams(n=2, temperature=1.0), 0.0)
    gb = SequenceGroup("B", [b], SamplingParams(), 0.0)
    bm.allocate(ga)
    bm.allocate(gb)
    a.status = b.status = SequenceStatus.RUNNING
    child = a.fork(2)
    ga.add(child)
    bm.fork(a, child)
    return bm, ga, gb, a, child, b


def test_draw_block_tables_shows_every_block_arrow_and_ref_count():
    bm, ga, gb, a, child, b = live_manager()
    ax = blocks.draw_block_tables(bm, [ga, gb])
    assert len(by_gid(ax, "phys:GPU:")) == 10 and len(by_gid(ax, "phys:CPU:")) == 6
    assert len(by_gid(ax, "logical:")) == a.n_blocks + child.n_blocks + b.n_blocks
    arrows = by_gid(ax, "arrow:")
    assert len(arrows) == sum(len(bm.get_block_table(s)) for s in (a, child, b))
    for block in bm.gpu_allocator.blocks:
        refs = by_gid(ax, f"ref:GPU:{block.block_number}")
        if block.ref_count:
            assert [t.get_text() for t in refs] == [f"ref {block.ref_count}"]
        else:
            assert refs == []
    # Forked samples share their blocks: both first logical blocks point at the same cell.
    assert "ref 2" in text_of(ax, f"ref:GPU:{bm.get_block_table(a)[0]}")
    tip = {a_.get_gid(): a_.xy for a_ in arrows}
    assert tip["arrow:A.0:0"] == tip["arrow:A.1:0"]
    free = text_of(ax, "free:GPU")
    assert free.endswith(" ".join(str(b.block_number) for b in bm.gpu_allocator.free_blocks))
    assert f"({bm.get_num_free_gpu_blocks()}," in free


def test_snapshot_is_detached_and_shows_copy_on_write_and_swap():
    bm, ga, gb, a, child, b = live_manager()
    seqs = {"A.0": a, "A.1": child, "B": b}
    before = block_snapshot.snapshot(bm, seqs, "before")
    a.append_token_id(7)
    child.append_token_id(8)
    cow = bm.append_slot(a)
    assert cow is not None
    after = block_snapshot.snapshot(bm, seqs, "after")
    assert before.seqs[0].table != after.seqs[0].table  # the copy got a new block
    assert after.seqs[0].table[-1] == ("GPU", cow[1])
    assert before.ref_counts["GPU"][cow[0]] == 2 and after.ref_counts["GPU"][cow[0]] == 1
    mapping = bm.swap_out(ga)
    swapped = block_snapshot.snapshot(bm, seqs, "swapped", note=f"{mapping}")
    assert {dev for s in swapped.seqs[:2] for dev, _ in s.table} == {"CPU"}
    fig = blocks.draw_block_table_history([before, after, swapped])
    assert [ax.get_title(loc="left") for ax in fig.axes] == ["before", "after", "swapped"]
    swapped_ax = fig.axes[2]
    assert len(by_gid(swapped_ax, "ref:CPU:")) == len(mapping)
    assert any(str(mapping) in t.get_text() for t in swapped_ax.texts)


def test_history_in_columns_and_the_registered_figures():
    fig = blocks.draw_block_table_history(block_stories.block_manager_story(), ncols=2)
    assert sum(1 for ax in fig.axes if ax.get_title(loc="left")) == 6
    for name in ("01_fragmentation", "01_kv_sizes", "03_block_table_history"):
        assert isinstance(draw(name), plt.Figure)


def test_sequence_tables_from_an_allocator_alone():
    alloc = BlockAllocator(Device.GPU, 4, 8)
    seq = Sequence(0, None, list(range(10)), 4)
    table = [alloc.allocate() for _ in range(seq.n_blocks)]
    ax = blocks.draw_sequence_tables(alloc, {"s0": (seq, table)})
    assert len(by_gid(ax, "logical:s0:")) == 3 and len(by_gid(ax, "arrow:s0:")) == 3
    assert len(by_gid(ax, "phys:")) == 8 and len(by_gid(ax, "ref:GPU:")) == 3


def test_a_waiting_sequence_is_drawn_without_blocks():
    bm, *_ = live_manager()
    waiting = Sequence(9, None, list(range(5)), 4)
    ax = blocks.draw_block_tables(bm, {"new": waiting})
    assert len(by_gid(ax, "logical:new:")) == 2 and by_gid(ax, "arrow:new:") == []
    # The blocks of the sequences we did not name still show as held.
    assert len(by_gid(ax, "ref:GPU:")) == bm.num_total_gpu_blocks - bm.get_num_free_gpu_blocks()


def test_draw_pool_from_round_records():
    p = presets.seed_rounds("swap")
    for rec in sim.simulate(p.requests, p.scheduler_config, p.cache_config):
        ax = blocks.draw_pool(rec.block_tables, rec.num_gpu_blocks, title="GPU")
        assert len(by_gid(ax, "phys:GPU:")) == rec.num_gpu_blocks
        held = {n for t in rec.block_tables.values() for n in t}
        assert {t.get_gid() for t in by_gid(ax, "ref:GPU:")} == {f"ref:GPU:{n}" for n in held}
        assert f"({rec.free_gpu_blocks})" in text_of(ax, "free:GPU")
        plt.close(ax.figure)
    cpu = blocks.draw_pool({"s2": [0, 1]}, 4, title="CPU", ref_counts={0: 1, 1: 3})
    assert text_of(cpu, "ref:CPU:1") == "ref 3"
    with pytest.raises(ValueError, match="outside a pool"):
        blocks.draw_pool({"s0": [5]}, 4)


def test_draw_slots_puts_every_token_in_its_slot():
    alloc, live = block_stories.seed_tables_example()
    tables = {k: [b.block_number for b in t] for k, (_, t) in live.items()}
    lens = {k: s.get_len() for k, (s, _) in live.items()}
    ax = slots.draw_slots(tables, lens, alloc.num_blocks, alloc.block_size)
    assert len(by_gid(ax, "slot:")) == alloc.num_blocks * alloc.block_size
    assert len(by_gid(ax, "token:")) == sum(lens.values())
    for name, table in tables.items():
        for pos in range(lens[name]):
            # Independent of slot_for: the block holding logical block pos // 4, at offset pos % 4.
            slot = table[pos // 4] * 4 + pos % 4
            (cell,) = by_gid(ax, f"slot:{slot}")
            (token,) = by_gid(ax, f"token:{name}:{pos}")
            x, y = token.get_position()
            assert cell.contains_point(ax.transData.transform((x, y)))
    with pytest.raises(ValueError, match="holds only"):
        slots.draw_slots({"s0": [0]}, {"s0": 5}, 4, 4)


def test_chapter_two_example_scatters_tables_and_reuses_freed_blocks():
    alloc, live = block_stories.seed_tables_example()
    assert set(live) == {"s0", "s2"}  # s1 finished and gave its blocks back
    assert [b.block_number for b in live["s0"][1]] == [0, 1, 6, 2]
    assert alloc.get_num_free_blocks() == 8 - sum(len(t) for _, t in live.values())
    assert {"02_block_tables", "02_slot_mapping"} <= set(REGISTRY)
