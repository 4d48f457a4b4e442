"""The RoundStepper, driven headlessly: click through every round and back, sweep the slider over
every value, play, and check that what it shows (one HTML value: text and picture) matches the
records it was given, that its picture is never stretched, and that its saved view is a filmstrip."""

from __future__ import annotations

import base64
import dataclasses
import html
import re

import pytest

from tinyserve import presets, sim
from tinyserve.viz.stepper import RoundStepper
from tinyserve.viz.widget_view import PIXEL_RATIO, png_size

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run(preset):
    return sim.simulate(preset.requests, preset.scheduler_config, preset.cache_config)


PRESETS = {
    "seed_swap": lambda: run(presets.seed_rounds("swap")),
    "seed_recompute": lambda: run(presets.seed_rounds("recompute")),
    "orca_example": lambda: run(presets.orca_example("orca")),
    "orca_example_vllm": lambda: run(presets.orca_example("vllm")),
}


def fields(view: str) -> dict[str, str]:
    """What a reader sees in a widget's view, as label -> text."""
    return {html.unescape(label): html.unescape(value)
            for label, value in re.findall(r"<div><b>(.*?)</b>: (.*?)</div>", view)}


def picture(view: str) -> tuple[bytes, str, int]:
    """The view's picture: PNG bytes, alt text and the CSS width it is shown at."""
    m = re.search(r'<img src="data:image/png;base64,([^"]+)" alt="([^"]*)" width="(\d+)"', view)
    assert m, "the view has no picture"
    return base64.b64decode(m.group(1)), html.unescape(m.group(2)), int(m.group(3))


def data_step(view: str) -> int:
    return int(re.search(r'data-step="(\d+)"', view).group(1))


def shown(ids: list[str]) -> str:
    return ", ".join(ids) if ids else "—"


def assert_shows(stepper: RoundStepper, record: sim.RoundRecord) -> None:
    f = fields(stepper.view.value)
    assert f["round"] == str(record.round)
    assert f["phase"] == record.phase
    assert f["batch"] == shown(record.batch)
    assert f["preempted"] == shown(record.preempted)
    assert f["swapped out"] == shown(record.swapped_out)
    assert f["swapped in"] == shown(record.swapped_in)
    assert f["finished"] == shown(record.finished)
    assert (f["waiting"], f["running"], f["swapped"]) == (shown(record.waiting), shown(record.running),
                                                          shown(record.swapped))
    assert data_step(stepper.view.value) == record.round
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
    f = fields(stepper.view.value)
    assert (f["phase"], f["batch"], f["waiting"]) == ("prefill", "s0, s1", "s2")
    stepper.next_button.click()
    f = fields(stepper.view.value)
    assert (f["phase"], f["batch"]) == ("prefill", "s2")
    stepper.next_button.click()
    f = fields(stepper.view.value)
    assert (f["phase"], f["batch"], f["preempted"], f["swapped out"]) == ("decode", "s0, s1", "s2", "s2")
    assert (f["running"], f["swapped"]) == ("s0, s1", "s2")

    stepper = RoundStepper(PRESETS["seed_recompute"](), draw=False)
    stepper.slider.value = 3
    f = fields(stepper.view.value)
    assert (f["waiting"], f["swapped"]) == ("s2", "—")


def test_play_keeps_text_and_picture_on_one_round():
    """Play drives the slider; at every value the text, the picture's alt and the picture itself
    are those of one round (the picture is the one this round draws on its own)."""
    records = PRESETS["seed_swap"]()
    stepper = RoundStepper(records)
    for value in range(1, len(records) + 1):
        stepper.play.value = value
        assert stepper.slider.value == value
        assert_shows(stepper, records[value - 1])
        png, alt, _ = picture(stepper.view.value)
        assert alt == f"round {value}"
        assert png == stepper.png(value - 1)


def test_drawing_follows_every_round_and_is_never_stretched():
    records = PRESETS["seed_swap"]()
    stepper = RoundStepper(records)
    images = []
    for value in range(1, len(records) + 1):
        stepper.slider.value = value
        png, _, css_width = picture(stepper.view.value)
        assert png.startswith(PNG_MAGIC)
        # Rendered at PIXEL_RATIO x the size it is shown at: the browser only ever shrinks it.
        assert css_width * PIXEL_RATIO == png_size(png)[0]
        images.append(png)
    # The drawing changes whenever what it draws changes (round 3 preempts, so 2 and 3 differ),
    # and every step has the same size, so the page does not jump.
    assert images[1] != images[2]
    assert len({png_size(p) for p in images}) == 1
    assert stepper.figure.axes[0].get_title(loc="left") == f"round {len(records)} · {records[-1].phase}"


def test_engine_records_show_the_produced_text():
    records = PRESETS["seed_swap"]()
    records[0] = dataclasses.replace(records[0], tokens={"s0": " Dustin", "s1": " bright"})
    stepper = RoundStepper(records, draw=False)
    assert "Dustin" in fields(stepper.view.value)["produced"]
    assert "bright" in fields(stepper.view.value)["produced"]
    stepper.next_button.click()
    assert "produced" not in fields(stepper.view.value)


def test_ignored_requests_are_listed():
    from tinyserve.config import CacheConfig, SchedulerConfig

    records = sim.simulate([sim.Request("long", 40, 2), sim.Request("ok", 4, 2)],
                           SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=4, max_model_len=32),
                           CacheConfig(block_size=4, num_gpu_blocks=16, num_cpu_blocks=4, watermark=0.0))
    stepper = RoundStepper(records, draw=False)
    assert fields(stepper.view.value)["ignored"] == "long"


def test_saved_view_is_a_filmstrip_beside_the_widget():
    records = PRESETS["seed_swap"]()
    stepper = RoundStepper(records)
    bundle = stepper._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle
    still = base64.b64decode(bundle["image/png"])
    assert still.startswith(PNG_MAGIC)
    # Several rounds in one image: wider and taller than one round drawn at the same dpi.
    keys = stepper.key_steps()
    assert 3 <= len(keys) <= 9 and keys[0] == 0 and keys[-1] == len(records) - 1
    assert [2, 7] == [k for k in keys if records[k].preempted]  # both preemptions of the story are in it
    one = png_size(stepper.png(0, 64))
    sheet = png_size(still)
    assert sheet[0] > 2 * one[0] and sheet[1] > 2 * one[1]
    assert bundle["text/plain"].startswith(f"RoundStepper over {len(records)} rounds")
    assert "round 3" in bundle["text/plain"]


def test_empty_records_are_refused():
    with pytest.raises(ValueError, match="records"):
        RoundStepper([])
