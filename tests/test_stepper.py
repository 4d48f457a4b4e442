"""The RoundStepper, driven headlessly: click through every round and back, sweep the slider over
every value, and check that the text it displays matches the records it was given."""

from __future__ import annotations

import dataclasses
import re

import pytest

from tinyserve import presets, sim
from tinyserve.viz.stepper import RoundStepper

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run(preset):
    return sim.simulate(preset.requests, preset.scheduler_config, preset.cache_config)


PRESETS = {
    "seed_swap": lambda: run(presets.seed_rounds("swap")),
    "seed_recompute": lambda: run(presets.seed_rounds("recompute")),
    "orca_example": lambda: run(presets.orca_example("orca")),
    "orca_example_vllm": lambda: run(presets.orca_example("vllm")),
}


def fields(html: str) -> dict[str, str]:
    """What a reader sees in one of the stepper's HTML panels, as label -> text."""
    return {label: value for label, value in re.findall(r"<div><b>(.*?)</b>: (.*?)</div>", html)}


def shown(ids: list[str]) -> str:
    return ", ".join(ids) if ids else "—"


def assert_shows(stepper: RoundStepper, record: sim.RoundRecord) -> None:
    summary, queues = fields(stepper.summary.value), fields(stepper.queues_html.value)
    assert summary["round"] == str(record.round)
    assert summary["phase"] == record.phase
    assert summary["batch"] == shown(record.batch)
    assert summary["preempted"] == shown(record.preempted)
    assert summary["swapped out"] == shown(record.swapped_out)
    assert summary["swapped in"] == shown(record.swapped_in)
    assert summary["finished"] == shown(record.finished)
    assert queues == {"waiting": shown(record.waiting), "running": shown(record.running),
                      "swapped": shown(record.swapped)}
    assert stepper.record is record
    assert stepper.prev_button.disabled == (record.round == 1)
    assert stepper.next_button.disabled == (record is stepper.records[-1])


@pytest.mark.parametrize("name", PRESETS)
def test_next_through_every_round_then_prev_back(name):
    records = PRESETS[name]()
    stepper = RoundStepper(records, draw=False)
    assert stepper.slider.min == 1 and stepper.slider.max == len(records)
    assert_shows(stepper, records[0])
    for record in records[1:]:
        stepper.next_button.click()
        assert_shows(stepper, record)
    for record in reversed(records[:-1]):
        stepper.prev_button.click()
        assert_shows(stepper, record)


@pytest.mark.parametrize("name", PRESETS)
def test_slider_sweep_over_every_round(name):
    records = PRESETS[name]()
    stepper = RoundStepper(records, draw=False)
    for value in list(range(len(records), 0, -1)) + list(range(1, len(records) + 1)):
        stepper.slider.value = value
        assert_shows(stepper, records[value - 1])


def test_buttons_stop_at_the_ends():
    records = PRESETS["seed_swap"]()
    stepper = RoundStepper(records, draw=False)
    stepper.prev_button.click()  # already at round 1
    assert stepper.slider.value == 1
    assert_shows(stepper, records[0])
    stepper.slider.value = len(records)
    stepper.next_button.click()
    stepper.next_button.click()
    assert stepper.slider.value == len(records)
    assert_shows(stepper, records[-1])


def test_seed_rounds_as_the_story_tells_them():
    """Spot checks written out by hand, independent of the records' own fields."""
    stepper = RoundStepper(PRESETS["seed_swap"](), draw=False)
    s, q = fields(stepper.summary.value), fields(stepper.queues_html.value)
    assert (s["phase"], s["batch"], q["waiting"]) == ("prefill", "s0, s1", "s2")
    stepper.next_button.click()
    s = fields(stepper.summary.value)
    assert (s["phase"], s["batch"]) == ("prefill", "s2")
    stepper.next_button.click()
    s, q = fields(stepper.summary.value), fields(stepper.queues_html.value)
    assert (s["phase"], s["batch"], s["preempted"], s["swapped out"]) == ("decode", "s0, s1", "s2", "s2")
    assert (q["running"], q["swapped"]) == ("s0, s1", "s2")

    stepper = RoundStepper(PRESETS["seed_recompute"](), draw=False)
    stepper.slider.value = 3
    q = fields(stepper.queues_html.value)
    assert (q["waiting"], q["swapped"]) == ("s2", "—")


def test_play_drives_the_slider():
    records = PRESETS["orca_example"]()
    stepper = RoundStepper(records, draw=False)
    stepper.play.value = 4
    assert stepper.slider.value == 4
    assert_shows(stepper, records[3])


def test_drawing_follows_every_round():
    records = PRESETS["seed_swap"]()
    stepper = RoundStepper(records)
    images = [bytes(stepper.image.value)]
    for value in range(2, len(records) + 1):
        stepper.slider.value = value
        images.append(bytes(stepper.image.value))
    assert all(img.startswith(PNG_MAGIC) for img in images)
    # The drawing changes whenever what it draws changes (round 3 preempts, so 2 and 3 differ).
    assert images[1] != images[2]
    assert stepper.figure.axes[0].get_title(loc="left") == f"round {len(records)} · {records[-1].phase}"


def test_engine_records_show_the_produced_text():
    records = PRESETS["seed_swap"]()
    records[0] = dataclasses.replace(records[0], tokens={"s0": " Dustin", "s1": " bright"})
    stepper = RoundStepper(records, draw=False)
    assert "Dustin" in fields(stepper.summary.value)["produced"]
    assert "bright" in fields(stepper.summary.value)["produced"]
    stepper.next_button.click()
    assert "produced" not in fields(stepper.summary.value)


def test_ignored_requests_are_listed():
    from tinyserve.config import CacheConfig, SchedulerConfig

    records = sim.simulate([sim.Request("long", 40, 2), sim.Request("ok", 4, 2)],
                           SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=4, max_model_len=32),
                           CacheConfig(block_size=4, num_gpu_blocks=16, num_cpu_blocks=4, watermark=0.0))
    stepper = RoundStepper(records, draw=False)
    assert fields(stepper.summary.value)["ignored"] == "long"


def test_display_text_survives_stripped_widget_state():
    records = PRESETS["seed_swap"]()
    stepper = RoundStepper(records, draw=False)
    bundle = stepper._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle
    assert bundle["text/plain"].startswith(f"RoundStepper over {len(records)} rounds")


def test_empty_records_are_refused():
    with pytest.raises(ValueError):
        RoundStepper([])
