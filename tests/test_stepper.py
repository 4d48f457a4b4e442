"""The RoundStepper, driven headlessly: click through every round and back, sweep the slider over
every value, play, and check that what it shows (one HTML value: text and picture) matches the
records it was given, that its picture is never stretched, and that its saved view is one key frame."""

from __future__ import annotations

import base64
import dataclasses
import html
import re

import pytest

from tinyserve import presets, sim
from tinyserve.viz.stepper import RoundStepper
from tinyserve.viz.widget_view import PIXEL_RATIO, TEXT_LINE_EM, png_size

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


def test_saved_view_is_a_key_frame_beside_the_widget():
    records = PRESETS["seed_swap"]()
    stepper = RoundStepper(records)
    bundle = stepper._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle
    still, alt, _ = picture(bundle["text/html"])
    assert still.startswith(PNG_MAGIC)
    keys = stepper.key_steps()
    assert 3 <= len(keys) <= 9 and keys[0] == 0 and keys[-1] == len(records) - 1
    assert [2, 7] == [k for k in keys if records[k].preempted]  # both preemptions of the story are key steps
    # The saved view shows one round: the first preemption (s2 swapped out in round 3).
    assert stepper.key_frame() == 2 and alt == "round 3"
    assert bundle["text/plain"] == (f"▶ run the cell to step through the {len(records)} rounds; "
                                    "the picture shows round 3")


def test_empty_records_are_refused():
    with pytest.raises(ValueError, match="records"):
        RoundStepper([])


# -- a layout that stays put -------------------------------------------------------------------

FONT_PX = 13        # JupyterLab's widget font size: one em of the text area
CONTROL_ROW_PX = 36  # one row of controls (play, buttons, slider; a toggle row)


def text_area(view: str) -> tuple[float, list[int]]:
    """The view's text area: its height in em, and how many lines each of its columns has."""
    m = re.search(r'<div class="tinyserve-text" style="([^"]*)">(.*?)</div></div>(?:<img|</div>$)', view, re.S)
    assert m, "the view has no text area"
    style, body = m.groups()
    assert "flex-wrap:nowrap" in style, "columns that wrap move the picture"
    height = float(re.search(r"height:([\d.]+)em;", style).group(1))
    cols = body.split('<div class="tinyserve-column"')[1:]
    return height, [len(re.findall(r"<div><b>", col)) for col in cols]


def layout_height_px(view: str) -> float:
    """The height of text and picture together, at FONT_PX (the picture at its CSS height)."""
    height, _ = text_area(view)
    m = re.search(r'<img [^>]*height="(\d+)"', view)
    return height * FONT_PX + (int(m.group(1)) if m else 0)


def assert_stays_put(stepper, max_height_px: int = 700) -> None:
    """Every step: one text-area height that holds every column's lines, one picture size, and
    controls, text and picture within ``max_height_px`` (what the browser test measures)."""
    heights, layouts = set(), set()
    for value in range(1, stepper.num_steps + 1):
        stepper.slider.value = value
        height, lines = text_area(stepper.view.value)
        assert max(lines) * TEXT_LINE_EM <= height, (value, lines, height)
        heights.add(height)
        layouts.add(layout_height_px(stepper.view.value))
    assert len(heights) == 1, f"the text area changes height: {sorted(heights)}"
    assert len(layouts) == 1, f"the layout changes height: {sorted(layouts)}"
    layout = layouts.pop()
    if not stepper.draw:  # the text alone was swept: every step's picture has one size (render_png)
        layout += png_size(stepper.png(0))[1] // PIXEL_RATIO
    rows = 1 + len(stepper.widget.children) - 2  # the play row and any extra control rows
    assert layout + rows * CONTROL_ROW_PX <= max_height_px, f"{layout:.0f} px of text and picture, {rows} rows"


def test_text_area_keeps_its_height_when_a_round_has_more_lines():
    """Round 1 of an engine's history has a "produced" line the other rounds lack, and a round
    with an ignored request another: the text area is as tall in every round, so the picture
    under it never moves."""
    records = PRESETS["seed_swap"]()
    records[0] = dataclasses.replace(records[0], tokens={"s0": " Dustin", "s1": " bright"}, ignored=["x"])
    stepper = RoundStepper(records)
    lines = [max(text_area(stepper.view.value)[1])]
    stepper.next_button.click()
    lines.append(max(text_area(stepper.view.value)[1]))
    assert lines[0] == lines[1] + 2
    assert_stays_put(stepper)
    assert text_area(stepper.view.value)[0] == pytest.approx((lines[0] + stepper.text_spare_lines) * TEXT_LINE_EM)


def test_icon_buttons_say_what_they_do():
    """Play's buttons are icons: the Play widget carries a tooltip naming them (the frontend puts
    it on the buttons' box only when the widget has no description). prev and next have theirs."""
    stepper = RoundStepper(PRESETS["seed_swap"](), draw=False)
    assert stepper.play.description == ""
    for word in ("play", "pause", "stop", "repeat"):
        assert word in stepper.play.tooltip
    assert stepper.prev_button.tooltip == "the previous round" and stepper.next_button.tooltip == "the next round"
