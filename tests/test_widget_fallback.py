"""A widget's saved view, and the save hook that leaves only it in a saved notebook.

Every widget of the book carries, beside its live view, a static one: one key frame under a
caption that says to run the cell. The live view's model dies with the kernel, so a notebook
saved with it shows "Error displaying widget: model not found" when it is opened again; the
Jupyter server of the project's .venv drops it on every save (``make venv`` enables the server
extension), and ``make book`` drops it from the committed chapters. Checked here on the real
widgets, a real FileContentsManager and the .venv's own Jupyter configuration.
"""

from __future__ import annotations

import base64
import html
import importlib.util
import io
import json
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import nbformat
import pytest
from matplotlib.text import Text
from PIL import Image
from test_widgets import small_batch

from tinyserve import presets, sim
from tinyserve.lab.policy_runs import three_policies
from tinyserve.viz import widget_view as wv
from tinyserve.viz.kernel_walk import KernelWalkStepper
from tinyserve.viz.stepper import RoundStepper
from tinyserve.viz.whatif import WhatIfExplorer
from tinyserve.viz.widgets_blocks import BlockOpsStepper
from tinyserve.viz.widgets_orca import PolicyStepper

REPO = Path(__file__).resolve().parents[1]
VIEW = "application/vnd.jupyter.widget-view+json"
SHOWN_WIDTH = 900  # CSS pixels: the yardstick for the saved picture
MIN_PT = 8


def run(preset):
    return sim.simulate(preset.requests, preset.scheduler_config, preset.cache_config)


def policy3():
    runs = three_policies("seed")
    return PolicyStepper(runs["vllm"], runs["orca"], runs["v1"], names=("vllm", "orca", "v1"), budget=10)


WIDGETS = {
    "round_stepper": lambda: RoundStepper(run(presets.seed_rounds("swap"))),
    "block_ops": BlockOpsStepper,
    "policy_two_runs": lambda: PolicyStepper(run(presets.orca_example("orca")), run(presets.orca_example("vllm"))),
    "policy_three_runs": policy3,
    "whatif": WhatIfExplorer,
    "kernel_walk": lambda: KernelWalkStepper(*small_batch()),
}


def saved_view(bundle: dict) -> tuple[str, list[tuple[bytes, str, int]]]:
    """The saved view's caption (as text) and its pictures (PNG, alt, CSS width)."""
    page = bundle["text/html"]
    caption = re.search(r'<div class="tinyserve-caption"[^>]*>(.*?)</div>', page).group(1)
    pictures = [(base64.b64decode(b), html.unescape(a), int(w)) for b, a, w in
                re.findall(r'<img src="data:image/png;base64,([^"]+)" alt="([^"]*)" width="(\d+)"', page)]
    return html.unescape(re.sub(r"<[^>]+>", "", caption)), pictures


@pytest.mark.parametrize("name", WIDGETS)
def test_saved_view_is_one_legible_key_frame_under_a_caption(name):
    widget = WIDGETS[name]()
    bundle = widget._repr_mimebundle_()
    assert VIEW in bundle, "the live view is still there for a frontend with the kernel"
    caption, pictures = saved_view(bundle)
    assert caption.startswith("▶ run the cell")
    assert bundle["text/plain"] == caption
    if isinstance(widget, WhatIfExplorer):
        assert caption == f"▶ run the cell to move the sliders; the picture shows {widget.outcome.summary()}"
    else:
        n = widget.num_steps
        assert caption.startswith(f"▶ run the cell to step through the {n} {widget.noun}s; the picture shows ")
        assert caption.endswith(widget.step_title(widget.key_frame()))
    assert len(pictures) == 1, "one key frame, not a strip"
    png, alt, css_width = pictures[0]
    image = Image.open(io.BytesIO(png))
    dpi = image.info["dpi"][0]
    inches = image.width / dpi, image.height / dpi
    fig = widget.saved_figure()
    # One frame: no larger than the figure one step is drawn in (a strip of nine was 3 x 3 frames).
    assert inches[0] <= fig.get_figwidth() * 1.25 and inches[1] <= fig.get_figheight() * 1.1
    # Sharp and never stretched: about two pixels per CSS pixel, shown at most 900 wide.
    assert css_width <= SHOWN_WIDTH and 2 * css_width - 2 <= image.width <= 2.05 * css_width
    # The text: the figure that was drawn (the same PNG), every text measured as it is shown.
    assert wv.legible_png(fig) == png
    texts = [t for t in fig.findobj(Text) if t.get_text().strip() and t.get_visible()]
    assert texts
    shown = min(SHOWN_WIDTH, css_width) / (inches[0] * 96)  # shown points per point of the figure
    small = sorted({(round(t.get_fontsize() * shown, 2), t.get_text()) for t in texts
                    if t.get_fontsize() * shown < MIN_PT})
    assert not small, f"{name}: text under {MIN_PT} pt once shown: {small[:5]}"


def test_key_frames_are_the_telling_steps():
    records = run(presets.seed_rounds("swap"))
    stepper = RoundStepper(records)
    first = next(i for i, r in enumerate(records) if r.preempted or r.swapped_out)
    assert stepper.key_frame() == first and saved_view(stepper._repr_mimebundle_())[1][0][1] == f"round {first + 1}"
    # The policies' race: the last round, where every run's whole timeline is drawn.
    policies = policy3()
    assert policies.key_frame() == policies.num_steps - 1 == 17


def test_make_legible_raises_only_the_small_text():
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12.0, 3.0))  # shown 900 px wide: a point of it is 0.78 pt
    ax = fig.add_subplot()
    ax.set_xticks([0, 1], ["a", "b"], fontsize=6)
    small, big = ax.text(0, 0, "small", fontsize=5), ax.text(0, 1, "big", fontsize=14)
    wv.make_legible(fig)
    need = MIN_PT / (SHOWN_WIDTH / (12.0 * 96))
    assert need <= small.get_fontsize() <= need * 1.02 and big.get_fontsize() == 14
    assert all(t.get_fontsize() >= need for t in ax.get_xticklabels())
    narrow = Figure(figsize=(6.0, 3.0))  # shown at its own size: points are points
    t = narrow.add_subplot().text(0, 0, "x", fontsize=7)
    wv.make_legible(narrow)
    assert MIN_PT <= t.get_fontsize() <= MIN_PT * 1.02


# -- the save hook --------------------------------------------------------------------------------


def notebook_with(*outputs, state: dict | None = None) -> dict:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("text"),
                nbformat.v4.new_code_cell("w", outputs=[nbformat.v4.new_output("display_data", data=d)
                                                        for d in outputs])]
    if state is not None:
        nb.metadata["widgets"] = {"application/vnd.jupyter.widget-state+json": {"state": state, "version_major": 2,
                                                                                 "version_minor": 0}}
    return json.loads(json.dumps(nb))  # as the server gets it from the frontend: plain dicts


def test_drop_widget_views_keeps_the_saved_view():
    stepper = RoundStepper(run(presets.seed_rounds("swap")), draw=False)
    live = stepper._repr_mimebundle_()
    kept_state = {VIEW: {"model_id": "m-saved", "version_major": 2, "version_minor": 0}, "text/plain": "VBox()"}
    only_view = {VIEW: {"model_id": "m-alone", "version_major": 2, "version_minor": 0}}
    nb = notebook_with(live, kept_state, only_view, {"text/plain": "42"}, state={"m-saved": {}})
    assert wv.drop_widget_views(nb) == 1
    first, second, third, fourth = (o["data"] for o in nb["cells"][1]["outputs"])
    assert VIEW not in first and first["text/html"] == live["text/html"] and first["text/plain"] == live["text/plain"]
    assert VIEW in second, "a view whose model state the notebook saved still shows"
    assert VIEW in third, "an output is never emptied"
    assert fourth == {"text/plain": "42"}
    nbformat.validate(nbformat.from_dict(nb))
    assert wv.drop_widget_views(nb) == 0


def test_pre_save_hook_touches_only_notebooks():
    bundle = {VIEW: {"model_id": "m", "version_major": 2, "version_minor": 0}, "text/html": "<b>x</b>"}
    model = {"type": "notebook", "content": notebook_with(bundle)}
    wv.pre_save_hook(model=model, path="a.ipynb", contents_manager=None)
    assert VIEW not in model["content"]["cells"][1]["outputs"][0]["data"]
    text = {"type": "file", "format": "text", "content": json.dumps(bundle)}
    wv.pre_save_hook(model=dict(text), path="a.json", contents_manager=None)
    assert text["content"] == json.dumps(bundle)


def test_the_server_extension_drops_views_on_save(tmp_path):
    """Through a real FileContentsManager: what a reader's save writes to disk."""
    from jupyter_server.services.contents.filemanager import FileContentsManager

    cm = FileContentsManager(root_dir=str(tmp_path))
    points = wv._jupyter_server_extension_points()
    assert points == [{"module": "tinyserve.viz.widget_view"}]
    wv._load_jupyter_server_extension(SimpleNamespace(contents_manager=cm))
    bundle = BlockOpsStepper(draw=False)._repr_mimebundle_()
    cm.save({"type": "notebook", "format": "json", "content": notebook_with(bundle)}, "chapter.ipynb")
    saved = nbformat.read(tmp_path / "chapter.ipynb", as_version=4)
    data = saved.cells[1].outputs[0].data
    assert VIEW not in data and 'class="tinyserve-fallback"' in data["text/html"]


def test_make_venv_enables_the_extension():
    """The .venv's Jupyter server loads the extension: its config file is the repo's, as
    ``make venv`` installs it, and it names this module."""
    repo_file = REPO / "jupyter" / "jupyter_server_config.d" / "tinyserve.json"
    enabled = json.loads(repo_file.read_text())["ServerApp"]["jpserver_extensions"]
    assert enabled == {"tinyserve.viz.widget_view": True}
    installed = Path(sys.prefix) / "etc" / "jupyter" / "jupyter_server_config.d" / "tinyserve.json"
    assert installed.is_file(), f"{installed} is missing: run make venv"
    assert json.loads(installed.read_text()) == json.loads(repo_file.read_text())
    makefile = (REPO / "Makefile").read_text()
    assert "jupyter/jupyter_server_config.d/tinyserve.json" in makefile.split("\nlint:")[0]


def test_make_book_leaves_the_saved_view():
    spec = importlib.util.spec_from_file_location("run_book", REPO / "scripts" / "run_book.py")
    run_book = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run_book)
    bundle = WhatIfExplorer(draw=False)._repr_mimebundle_()
    nb = nbformat.from_dict(notebook_with(bundle, state={bundle[VIEW]["model_id"]: {}}))
    assert run_book.strip_widget_state(nb) == 1
    assert "widgets" not in nb.metadata
    assert set(nb.cells[1].outputs[0].data) == {"text/html", "text/plain"}
