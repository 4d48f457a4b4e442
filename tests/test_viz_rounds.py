"""The round drawings and what they are computed from: per-round states, static batching, the
preemption sweep. Expected values are worked out by hand from the presets' definitions."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from tinyserve import presets, sim  # noqa: E402
from tinyserve.lab.batching import preemption_sweep, random_requests, static_batching  # noqa: E402
from tinyserve.lab.records import finish_rounds, idle_slots, recomputed_tokens, request_states  # noqa: E402
from tinyserve.viz import figures, rounds, style  # noqa: E402


def run(preset):
    return sim.simulate(preset.requests, preset.scheduler_config, preset.cache_config)


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def test_states_of_the_seed_rounds_under_swap():
    states = request_states(run(presets.seed_rounds("swap")))
    assert states[0] == {"s0": "prefill", "s1": "prefill", "s2": "waiting"}
    # Round 2 prefills s2 alone; s0 and s1 hold their blocks but compute nothing.
    assert states[1] == {"s0": "idle", "s1": "idle", "s2": "prefill"}
    assert states[2] == {"s0": "decode", "s1": "decode", "s2": "preempted"}
    assert states[3] == {"s0": "decode", "s1": "decode", "s2": "swapped"}


def test_states_of_the_seed_rounds_under_recompute():
    states = request_states(run(presets.seed_rounds("recompute")))
    assert states[2]["s2"] == "preempted"
    assert states[3]["s2"] == "waiting"  # back in waiting, not swapped


def test_mixed_rounds_tell_prefill_from_decode():
    states = request_states(run(presets.orca_example("orca")))
    assert states[1] == {"A": "decode", "B": "decode", "C": "decode", "D": "prefill"}
    assert states[2] == {"A": "decode", "B": "decode", "C": "decode", "D": "decode", "E": "prefill"}


def test_finish_rounds_of_a_to_e():
    # Orca: C is prefilled in round 1 (its first token) and needs 4 more rounds.
    assert finish_rounds(run(presets.orca_example("orca"))) == {"C": 5, "D": 9, "A": 10, "E": 14, "B": 15}
    # vLLM: the prefill-only rounds 2 and 3 pause A, B, C, so each of them ends 2 rounds later.
    vllm = finish_rounds(run(presets.orca_example("vllm")))
    assert (vllm["A"], vllm["B"], vllm["C"]) == (12, 17, 7)


def test_static_batching_of_a_to_e():
    records = static_batching(presets.orca_example().requests, max_batch_size=5)
    # Batch 1 = A, B, C (rounds 1-15, as long as B); batch 2 = D, E (rounds 16-27, as long as E).
    assert finish_rounds(records) == {"C": 5, "A": 10, "B": 15, "D": 23, "E": 27}
    assert [r.phase for r in records].count("prefill") == 2
    assert records[15].batch == ["D", "E"]
    # Idle slot-rounds: A 11-15, C 6-15, D 24-27.
    assert idle_slots(records) == 5 + 10 + 4
    with pytest.raises(ValueError):
        static_batching([], 0)


def test_static_batching_respects_the_batch_size_and_gaps():
    reqs = [sim.Request("a", 2, 3, 1), sim.Request("b", 2, 1, 1), sim.Request("c", 2, 2, 6)]
    records = static_batching(reqs, max_batch_size=1)
    # a runs 1-3, b runs 4, nothing arrives in round 5, c runs 6-7.
    assert [r.batch for r in records] == [["a"], ["a"], ["a"], ["b"], [], ["c"], ["c"]]
    assert records[4].phase == "idle"


def test_no_idle_slots_under_orca_and_some_under_vllm():
    assert idle_slots(run(presets.orca_example("orca"))) == 0
    # Rounds 2 and 3 prefill D and E alone: A, B, C idle twice, D once.
    assert idle_slots(run(presets.orca_example("vllm"))) == 3 + 4


def test_recomputed_tokens():
    assert recomputed_tokens(run(presets.orca_example("orca")), presets.orca_example().requests) == 0
    p = presets.seed_rounds("recompute")
    records = run(p)
    # Every prefill after the first one of a request recomputes its prompt and what it produced so far.
    again = [(r.round, rid, r.chunk_sizes[rid]) for r in records for rid in r.batch
             if r.phase == "prefill" and r.round > 2]
    assert again and recomputed_tokens(records, p.requests) == sum(n for *_, n in again)
    assert recomputed_tokens(run(presets.seed_rounds("swap")), p.requests) == 0


def test_timeline_draws_one_cell_per_present_request():
    records = run(presets.seed_rounds("swap"))
    fig = rounds.draw_timeline(records, legend=False)
    cells = [p for p in fig.axes[0].patches]
    assert len(cells) == sum(len(s) for s in request_states(records))
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert texts.count(style.FINISH_MARK) == 3
    assert texts.count(style.SWAP_IN_MARK) == 2


def test_round_drawing_shows_queues_and_block_tables():
    records = run(presets.seed_rounds("swap"))
    r3 = records[2]
    # Round 3: s0 and s1 have two GPU blocks each, s2 is swapped out to one CPU block.
    assert [len(r3.block_tables[k]) for k in ("s0", "s1")] == [2, 2] and len(r3.cpu_block_tables["s2"]) == 1
    fig = rounds.draw_round(r3)
    texts = " | ".join(t.get_text() for t in fig.axes[0].texts)
    for key in ("s0", "s1"):
        assert f"{key}: GPU {r3.block_tables[key]}" in texts
    assert f"s2: CPU {r3.cpu_block_tables['s2']}" in texts
    # Every GPU block is drawn with its owner's name inside.
    owners = [t.get_text() for t in fig.axes[0].texts if t.get_text() in ("s0", "s1", "s2")]
    assert owners.count("s0") >= 3 and owners.count("s1") >= 3  # chip in running + two pool cells
    assert "GPU blocks: 0 of 4 free" in texts and "CPU swap blocks: 3 of 4 free" in texts
    assert "preempted s2" in texts and "swapped (1)" in texts


def test_sweep_shows_the_watermark_cuts_preemptions():
    reqs = random_requests()
    results = preemption_sweep(reqs, gpu_blocks=[24, 40, 56], watermarks=[0.0, 0.2])
    total = {wm: sum(row["preemptions"] for row in rows) for wm, rows in results.items()}
    assert total[0.2] < total[0.0]
    assert all(row["ignored"] == 0 for rows in results.values() for row in rows)
    # Check one cell against a direct run of the simulator.
    from tinyserve.config import CacheConfig, SchedulerConfig

    direct = sim.simulate(reqs, SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=16, max_model_len=256,
                                                preemption_mode="recompute"),
                          CacheConfig(block_size=4, num_gpu_blocks=40, num_cpu_blocks=160, watermark=0.2))
    assert results[0.2][1]["rounds"] == len(direct)
    assert results[0.2][1]["preemptions"] == sum(len(r.preempted) for r in direct)


@pytest.mark.parametrize("name", ["04_static_vs_iteration", "04_orca_vs_vllm_timeline", "05_seed_rounds_blocks",
                                  "05_recompute_vs_swap", "05_watermark_sweep"])
def test_registered_figures_render(name, tmp_path):
    fig = figures.draw(name)
    path = figures.save(fig, name, tmp_path)
    assert path.stat().st_size > 10_000
