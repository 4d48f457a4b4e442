"""The book as a reader uses it: JupyterLab in a real (headless) Chromium, driven by selenium.

For every chapter that has a widget, the test opens a copy of the chapter in JupyterLab (served
from this project's .venv on 127.0.0.1, a random free port, token auth), runs all cells from
the Run menu, and fails on a traceback, an "Error displaying widget" or a widget stuck on
"Loading widget". Then it works every widget the way a reader would (next and prev, the slider
from the keyboard, play, the toggles), and checks through the widget's text and its pixels that
the view changes, that text and picture show the same step, and that the picture is not
stretched. Screenshots go to $TINYSERVE_SCREENSHOTS (default: a temporary folder).

Nothing in the checkout is written: the chapters are copied to a temporary folder and
JupyterLab's settings, workspaces and runtime files live there too. The browser is Debian's
``chromium`` with its ``chromium-driver`` (``make browser-test``; ``.ci/run`` installs them).
Run with ``make browser-test`` (not part of ``make test``).
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
# The widget classes of the book; a code cell that builds one as its last line shows a widget, and
# so does a cell that binds one to a name and ends with that name (``stepper = PolicyStepper(...)``,
# then ``stepper``: chapter 13).
WIDGETS = r"(RoundStepper|BlockOpsStepper|PolicyStepper|WhatIfExplorer|KernelWalkStepper)(?:\.from_example)?\("
WIDGET_CALL = re.compile(r"^(?:\S.*)?\b" + WIDGETS, re.M)
# How many runs each chapter's PolicyStepper shows side by side (one column each).
POLICY_COLUMNS = {"04_": 2, "13_": 3}


def shows_widget(source: str) -> bool:
    """Whether a code cell's last line shows one of the book's widgets."""
    lines = source.strip().splitlines()
    if not lines:
        return False
    last = lines[-1].strip()
    if WIDGET_CALL.search(last):
        return True
    return bool(re.fullmatch(r"[A-Za-z_]\w*", last)) and bool(
        re.search(rf"^{last}\s*=\s*(?:\S.*)?\b" + WIDGETS, source, re.M))
RUN_TIMEOUT_S = 480  # per chapter (each runs in under 90 s on a quiet 2-core machine)


def widget_chapters() -> list[str]:
    import nbformat

    out = []
    for path in sorted((REPO / "chapters").glob("[0-9][0-9]_*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        if any(c.cell_type == "code" and shows_widget(c.source) for c in nb.cells):
            out.append(path.name)
    return out


def expected_widgets(name: str) -> int:
    import nbformat

    nb = nbformat.read(REPO / "chapters" / name, as_version=4)
    return sum(1 for c in nb.cells if c.cell_type == "code" and shows_widget(c.source))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


@pytest.fixture(scope="session")
def shots() -> Path:
    out = Path(os.environ.get("TINYSERVE_SCREENSHOTS") or tempfile.mkdtemp(prefix="tinyserve-screenshots-"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"\nscreenshots: {out}")
    return out


@pytest.fixture(scope="session")
def lab(tmp_path_factory):
    """JupyterLab on a copy of the chapters; yields (base url, token)."""
    root = tmp_path_factory.mktemp("lab")
    # The chapters and what they read beside them (../benchmarks/results, ../figures), as in a clone.
    for folder in ("chapters", "benchmarks", "figures"):
        shutil.copytree(REPO / folder, root / folder, ignore=shutil.ignore_patterns("__pycache__"))
    settings = root / "settings"
    # Every cell in the DOM (no virtual scrolling), and no news or update checks (no network).
    _write_json(settings / "@jupyterlab/notebook-extension/tracker.jupyterlab-settings", {"windowingMode": "none"})
    _write_json(settings / "@jupyterlab/apputils-extension/notification.jupyterlab-settings",
                {"fetchNews": "false", "checkForUpdates": False})
    port, token = _free_port(), os.urandom(16).hex()
    env = {k: v for k, v in os.environ.items() if k != "TINYSERVE_FIGURES_DIR"}
    env.update(JUPYTERLAB_SETTINGS_DIR=str(settings), JUPYTERLAB_WORKSPACES_DIR=str(root / "workspaces"),
               JUPYTER_RUNTIME_DIR=str(root / "runtime"), JUPYTER_CONFIG_DIR=str(root / "config"),
               TMPDIR=str(root), OMP_WAIT_POLICY="PASSIVE")
    log = open(root / "lab.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root", "--ip=127.0.0.1", f"--port={port}",
         f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root / 'chapters'}",
         "--ServerApp.terminals_enabled=False", "--LabApp.extension_manager=readonly"],
        env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            try:
                urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2)
                break
            except OSError:
                if server.poll() is not None or time.time() > deadline:
                    raise RuntimeError("JupyterLab did not start:\n" + (root / "lab.log").read_text()[-3000:]) from None
                time.sleep(0.5)
        yield base, token
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


@pytest.fixture(scope="session")
def browser(tmp_path_factory):
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not Path(p).exists()]
    if missing:
        message = f"{', '.join(missing)} not installed (apt-get install chromium chromium-driver)"
        if os.environ.get("CI"):
            pytest.fail(message)  # CI installs them: a missing browser there is a failure, not a skip
        pytest.skip(message)
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    opts = Options()
    opts.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", f"--user-data-dir={tmp_path_factory.mktemp('chromium')}",
                 "--window-size=1400,1000", "--force-device-scale-factor=1"):
        opts.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    driver.set_script_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


# -- helpers ---------------------------------------------------------------------------------------


def wait_for(predicate, timeout: float, what: str, interval: float = 0.5):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def prompts(driver) -> list[str]:
    return driver.execute_script(
        "return Array.from(document.querySelectorAll('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-CodeCell "
        ".jp-InputArea-prompt')).map(e => e.textContent.trim())")


def page_text(driver) -> str:
    return driver.execute_script(
        "const p = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden)'); return p ? p.innerText : ''")


def click_menu(driver, menu: str, command: str) -> None:
    from selenium.webdriver.common.by import By

    item = next(e for e in driver.find_elements(By.CSS_SELECTOR, ".lm-MenuBar-itemLabel") if e.text == menu)
    item.click()
    wait_for(lambda: driver.find_elements(By.CSS_SELECTOR, f'li.lm-Menu-item[data-command="{command}"]'), 10,
             f"menu item {command}")[0].click()


def view_state(widget) -> dict:
    """What one widget shows: its text, the step its view is on, the picture's alt and sizes, and
    where the picture sits in the widget (``at``: its box's top and left, in CSS pixels from the
    widget's own)."""
    return widget.parent.execute_script("""
        const w = arguments[0], step = w.querySelector('.tinyserve-step'), img = w.querySelector('.tinyserve-step img');
        const box = w.getBoundingClientRect(), pic = img ? img.getBoundingClientRect() : null;
        return {text: step ? step.innerText : w.innerText, step: step ? step.dataset.step : null,
                alt: img ? img.alt : null, natural: img ? img.naturalWidth : 0, shown: img ? img.clientWidth : 0,
                complete: img ? img.complete : true,
                at: pic ? [Math.round(pic.top - box.top), Math.round(pic.left - box.left)] : null};""", widget)


MAX_WIDGET_HEIGHT = 700  # CSS pixels: a widget, controls and picture, fits a laptop's screen (1400 x 1000 here)


def assert_stays_put(before: dict, after: dict, what: str) -> None:
    """The picture did not move inside its widget (text areas of a fixed height above it)."""
    if before["at"] is not None and after["at"] is not None:
        assert after["at"] == before["at"], f"{what} moved the picture from {before['at']} to {after['at']}"


def check_fits_and_names_its_buttons(widget, what: str) -> int:
    """The widget is at most MAX_WIDGET_HEIGHT tall, and every button says what it does: its own
    text, or a tooltip (a title on it or on the control it belongs to). Returns the height."""
    height, unnamed = widget.parent.execute_script("""
        const w = arguments[0];
        const unnamed = Array.from(w.querySelectorAll('button')).filter(b => !b.innerText.trim()
            && !(b.closest('[title]') && w.contains(b.closest('[title]')))).map(b => b.outerHTML.slice(0, 120));
        return [w.getBoundingClientRect().height, unnamed];""", widget)
    print(f"\n{what}: {height:.0f} px tall")
    assert height <= MAX_WIDGET_HEIGHT, f"{what} is {height:.0f} px tall (at most {MAX_WIDGET_HEIGHT})"
    assert not unnamed, f"{what}: buttons with neither text nor a tooltip: {unnamed}"
    return round(height)


def screenshot(widget, path: Path) -> bytes:
    widget.parent.execute_script("arguments[0].scrollIntoView({block: 'center'})", widget)
    time.sleep(0.3)
    png = widget.screenshot_as_png
    path.write_bytes(png)
    return png


def pixels_differ(a: bytes, b: bytes) -> int:
    """How many pixels differ between two screenshots (sizes may differ: then all of them)."""
    from PIL import Image, ImageChops

    ia, ib = Image.open(io.BytesIO(a)).convert("RGB"), Image.open(io.BytesIO(b)).convert("RGB")
    if ia.size != ib.size:
        return ia.size[0] * ia.size[1]
    return sum(ImageChops.difference(ia, ib).convert("L").histogram()[1:])


def first_number(text: str) -> int:
    return int(re.search(r"\d+", text).group())


def assert_consistent(state: dict) -> None:
    """Text and picture are of one step, and the picture is not stretched."""
    if state["alt"] is not None and state["step"] not in (None, "0"):
        assert first_number(state["alt"]) == int(state["step"]), state
    if state["natural"]:
        assert state["shown"] <= state["natural"] // 2 + 1, f"picture stretched: {state}"


def wait_change(widget, before: dict, what: str, timeout: float = 60) -> dict:
    def changed():
        now = view_state(widget)
        return now if now["text"] != before["text"] and now["complete"] else None

    return wait_for(changed, timeout, what, interval=0.2)


# -- working each widget -----------------------------------------------------------------------------


def work_stepper(driver, widget, out: Path) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    buttons = {b.text.strip(): b for b in widget.find_elements(By.CSS_SELECTOR, "button")}
    first = view_state(widget)
    assert first["step"] == "1", first
    assert_consistent(first)
    shot0 = screenshot(widget, out.with_name(out.name + "-1.png"))
    buttons["next ▶"].click()
    second = wait_change(widget, first, "next to change the view")
    assert second["step"] == "2"
    assert_consistent(second)
    assert_stays_put(first, second, "next")
    shot1 = screenshot(widget, out.with_name(out.name + "-2.png"))
    assert pixels_differ(shot0, shot1) > 500, "next changed the text but not the pixels"
    buttons["◀ prev"].click()
    back = wait_change(widget, second, "prev to change the view")
    assert back["step"] == "1" and back["text"] == first["text"]
    # The slider from the keyboard: End jumps to the last step.
    handle = widget.find_element(By.CSS_SELECTOR, ".noUi-handle")
    handle.send_keys(Keys.END)
    last = wait_change(widget, back, "the slider's End key to change the view")
    assert int(last["step"]) > 2
    assert_consistent(last)
    assert_stays_put(first, last, "the slider's End key")
    handle.send_keys(Keys.HOME)
    wait_for(lambda: view_state(widget)["step"] == "1", 60, "the slider's Home key")
    # Play: every view seen while it runs shows one step in text and picture alike.
    play = widget.find_element(By.CSS_SELECTOR, ".widget-play button")
    play.click()
    seen = set()
    deadline = time.time() + 20
    while time.time() < deadline and len(seen) < 4:
        state = view_state(widget)
        assert_consistent(state)
        assert_stays_put(first, state, "play")
        seen.add(state["step"])
        time.sleep(0.15)
    widget.find_elements(By.CSS_SELECTOR, ".widget-play button")[1].click()  # pause
    assert len(seen) >= 3, f"play showed only steps {seen}"


def check_policy_columns(widget, name: str) -> None:
    """A PolicyStepper (its text says "idle in running") shows one column per run: chapter 04 two
    (orca, vllm), chapter 13 three (v0.4's vllm, orca, v1). At round 1 every run is still going, so
    each column says "round 1 ·" and its tokens in batch."""
    first = view_state(widget)
    if "idle in running" not in first["text"]:
        return
    want = next((n for prefix, n in POLICY_COLUMNS.items() if name.startswith(prefix)), None)
    assert want is not None, f"{name}: a PolicyStepper in a chapter missing from POLICY_COLUMNS"
    text = first["text"]
    assert text.count("round 1 ·") == text.count("tokens in batch") == want, \
        f"{name}: the PolicyStepper should show {want} runs at round 1:\n{text}"


def work_toggles(driver, widget, out: Path) -> None:
    """Click every option of every toggle group; each click must change the view."""
    from selenium.webdriver.common.by import By

    groups = widget.find_elements(By.CSS_SELECTOR, ".widget-toggle-buttons")
    for g, group in enumerate(groups):
        options = group.find_elements(By.CSS_SELECTOR, "button")
        for option in reversed(options):  # the first one is usually selected already
            before = view_state(widget)
            if "mod-active" in (option.get_attribute("class") or ""):
                continue
            option.click()
            after = wait_change(widget, before, f"toggle {option.text!r} to change the view")
            assert_consistent(after)
            assert_stays_put(before, after, f"toggle {option.text!r}")
        screenshot(widget, out.with_name(f"{out.name}-toggles{g}.png"))
        options[0].click()
        time.sleep(1)


def work_sliders(driver, widget, out: Path) -> None:
    """Move every slider to its end and back with the keyboard; the view must change."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    for k, handle in enumerate(widget.find_elements(By.CSS_SELECTOR, ".noUi-handle")):
        before = view_state(widget)
        shot0 = screenshot(widget, out.with_name(f"{out.name}-slider{k}-a.png"))
        handle.send_keys(Keys.HOME if k == 0 else Keys.END)
        after = wait_change(widget, before, f"slider {k} to change the view")
        assert_consistent(after)
        assert_stays_put(before, after, f"slider {k}")
        shot1 = screenshot(widget, out.with_name(f"{out.name}-slider{k}-b.png"))
        assert pixels_differ(shot0, shot1) > 500


# -- the second session --------------------------------------------------------------------------------

FALLBACK_WIDTH = 900  # CSS pixels: the widest a widget's saved picture is shown (tinyserve.viz.widget_view)


def shut_down_kernels(base: str, token: str) -> None:
    for session in json.load(urllib.request.urlopen(f"{base}/api/sessions?token={token}")):
        req = urllib.request.Request(f"{base}/api/sessions/{session['id']}?token={token}", method="DELETE")
        urllib.request.urlopen(req)


def saved_notebook(base: str, token: str, name: str) -> dict:
    """The notebook as the server has it on disk (its contents API)."""
    return json.load(urllib.request.urlopen(f"{base}/api/contents/{name}?content=1&token={token}"))


def saved_views(driver) -> list[dict]:
    """Every widget's saved view on the page: its caption and its picture's sizes."""
    return driver.execute_script("""
        return Array.from(document.querySelectorAll(
            '.jp-NotebookPanel:not(.lm-mod-hidden) .tinyserve-fallback')).map(f => {
          const img = f.querySelector('img'), cap = f.querySelector('.tinyserve-caption');
          return {caption: cap ? cap.innerText : '', caption_shown: cap ? cap.offsetHeight > 0 : false,
                  natural: img ? img.naturalWidth : 0, shown: img ? img.clientWidth : 0,
                  css: img ? Number(img.getAttribute('width')) : 0, complete: img ? img.complete : false};
        });""")


def open_saved(driver, base: str, token: str, name: str, widgets: int, shot: Path) -> list[dict]:
    """Open a saved notebook in a fresh page (no widget model left in the browser), check that
    no widget shows an error and each of its ``widgets`` its saved view, and return those views."""
    from selenium.webdriver.common.by import By

    driver.get(f"{base}/lab/workspaces/{shot.stem}/tree/{name}?token={token}")
    wait_for(lambda: len(prompts(driver)) > 0, 120, f"{name} to open")
    # A widget view without its model shows its error only once the new kernel is connected.
    wait_for(lambda: len(saved_views(driver)) + page_text(driver).count("Error displaying widget") >= widgets,
             90, f"{name}'s outputs to render")
    time.sleep(1)  # any widget output still to render
    driver.save_screenshot(str(shot))
    text, views = page_text(driver), saved_views(driver)
    for k, view in enumerate(driver.find_elements(By.CSS_SELECTOR, ".jp-NotebookPanel:not(.lm-mod-hidden) "
                                                                   ".tinyserve-fallback"), start=1):
        screenshot(view, shot.with_name(f"{shot.stem}-view{k}.png"))
    errors = text.count("Error displaying widget")
    print(f"\n{name}: {errors} widget error(s) on reopen, {len(views)} saved view(s)")
    assert errors == 0 and "model not found" not in text, f"{name}: reopened, {errors} widget(s) show an error"
    assert len(views) == widgets, f"{name}: {len(views)} of {widgets} saved views: {views}"
    for view in views:
        assert view["caption_shown"] and view["caption"].startswith("▶ run the cell"), view
        assert view["complete"] and view["natural"] > 0, f"{name}: the saved picture did not load: {view}"
        # Shown at the size it was drawn for (text at least 8 pt at 900 px), never stretched.
        assert min(view["css"], FALLBACK_WIDTH) - 1 <= view["shown"] <= view["natural"], view
    return views


def reopen_saved(driver, base: str, token: str, name: str, shots: Path) -> None:
    """What a reader meets the next day: the chapter was run and saved, the kernel shut down, the
    notebook opened again. No widget may show an error; each shows its saved view instead, one
    key frame at a legible size with a visible caption saying to run the cell. The same file
    unsigned, as a fresh clone's committed chapter is (JupyterLab sanitizes its HTML), as well."""
    stamp = saved_notebook(base, token, name)["last_modified"]
    click_menu(driver, "File", "docmanager:save")
    wait_for(lambda: saved_notebook(base, token, name)["last_modified"] != stamp, 60, f"{name} to be saved")
    content = saved_notebook(base, token, name)["content"]
    assert "application/vnd.jupyter.widget-view+json" not in json.dumps(content), f"{name}: saved with widget views"
    shut_down_kernels(base, token)
    try:
        open_saved(driver, base, token, name, expected_widgets(name), shots / f"{Path(name).stem}-reopened.png")
        for cell in content["cells"]:
            cell["metadata"].pop("trusted", None)  # not signed on saving: untrusted, as in a fresh clone
        unsigned = f"{Path(name).stem}-unsigned.ipynb"
        req = urllib.request.Request(f"{base}/api/contents/{unsigned}?token={token}", method="PUT",
                                     data=json.dumps({"type": "notebook", "content": content}).encode())
        urllib.request.urlopen(req)
        open_saved(driver, base, token, unsigned, expected_widgets(name), shots / f"{Path(name).stem}-unsigned.png")
    finally:
        shut_down_kernels(base, token)  # the kernels the reopened notebooks started


# -- the test ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", widget_chapters())
def test_chapter_in_jupyterlab(name, lab, browser, shots):
    from selenium.webdriver.common.by import By

    base, token = lab
    driver = browser
    start = time.time()
    # A workspace of its own per chapter, so JupyterLab reopens no tab (and no kernel) of another one.
    driver.get(f"{base}/lab/workspaces/{Path(name).stem}/tree/{name}?token={token}")
    wait_for(lambda: len(prompts(driver)) > 0, 120, "the notebook to open")
    wait_for(lambda: driver.execute_script(
        "const s = document.querySelector('.jp-Notebook-ExecutionIndicator, .jp-Toolbar-kernelStatus');"
        "return !document.querySelector('.jp-Dialog') && document.body.innerText.includes('Python 3');"), 120,
        "the kernel to start")
    click_menu(driver, "Run", "runmenu:run-all")

    def finished():
        p = prompts(driver)
        return p and not any("*" in x for x in p) and all(re.search(r"\d", x) for x in p)

    def stopped_early():
        p = prompts(driver)
        text = page_text(driver)
        return not any("*" in x for x in p) and "Traceback (most recent call last)" in text

    try:
        wait_for(lambda: finished() or stopped_early(), RUN_TIMEOUT_S, f"{name} to run all cells", interval=2)
    except AssertionError:
        driver.save_screenshot(str(shots / f"{Path(name).stem}-stuck.png"))
        raise AssertionError(f"{name} did not finish running: prompts {prompts(driver)}") from None
    ran_s = time.time() - start
    time.sleep(3)  # let widget views render
    driver.save_screenshot(str(shots / f"{Path(name).stem}-page.png"))
    # A failing cell fails the test, but only after the widgets that did run have been worked,
    # so that one report says everything that is wrong with the chapter.
    text = page_text(driver)
    problems = []
    if "Traceback (most recent call last)" in text:
        at = text.index("Traceback (most recent call last)")
        problems.append(f"{name}: a cell raised:\n{text[max(0, at - 1500):at + 1500]}")
    elif not finished():
        problems.append(f"{name}: not every cell ran: prompts {prompts(driver)}")
    assert "Error displaying widget" not in text, f"{name}: a widget failed to display"
    wait_for(lambda: "Loading widget" not in page_text(driver), 60, "no widget stuck on 'Loading widget'")

    widgets = driver.find_elements(By.CSS_SELECTOR, ".jp-NotebookPanel:not(.lm-mod-hidden) .tinyserve-widget")
    assert len(widgets) == expected_widgets(name), "\n\n".join(
        problems + [f"{name}: {len(widgets)} of {expected_widgets(name)} widgets shown"])
    for k, widget in enumerate(widgets, start=1):
        out = shots / f"{Path(name).stem}-widget{k}"
        check_fits_and_names_its_buttons(widget, f"{name} widget {k}")
        kinds = widget.find_elements(By.CSS_SELECTOR, ".widget-play")
        if widget.find_elements(By.CSS_SELECTOR, ".widget-toggle-buttons"):
            work_toggles(driver, widget, out)
        if kinds:
            check_policy_columns(widget, name)
            work_stepper(driver, widget, out)
        else:
            work_sliders(driver, widget, out)
    worked_s = time.time() - start - ran_s
    # Saved, shut down and opened again (this also leaves nothing running for the next chapter).
    reopen_saved(driver, base, token, name, shots)
    print(f"\n{name}: ran all cells in {ran_s:.0f} s, worked {len(widgets)} widget(s) in {worked_s:.0f} s")
    readme_shot = os.environ.get("TINYSERVE_README_SCREENSHOT")
    if readme_shot and name.startswith("05_"):  # the what-if explorer as it first appears
        shutil.copy(shots / f"{Path(name).stem}-widget2-slider0-a.png", readme_shot)
    assert not problems, "\n\n".join(problems)
