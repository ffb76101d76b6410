"""The cell a person watches, in a real JupyterLab driven by headless Chromium (the system's package, through
Playwright; no browser is downloaded): a 2000-step %%ddp_train on the embedded model stays a few outputs with
its summary in sight, a run failing at step 300 on rank 1 shows its one mapped traceback, the stop button
ends every rank, a cell edited and run without saving is trained as it ran, and a kept job (``--keep``, ``%%ddp``
training and generation, ``%ddp_pull``, ``%ddp_status``, ``%ddp_stop``) shows each cell's output; Stop in a kept
``%%ddp`` loop and in the ``--keep`` training keeps the ranks. Screenshots are kept in
build/browser-test/. Run with ``make test-browser``."""

from __future__ import annotations

import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import nbformat
import pytest

from conftest import ROOT, no_rank_processes
from kernel import kernel_env
from long_run import MODEL, TRAIN, TRAINER, sources

pytestmark = [pytest.mark.browser, pytest.mark.e2e]

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
SHOTS = ROOT / "build" / "browser-test"
WIDTH = 1400


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """JupyterLab on 127.0.0.1, serving a fresh folder, its kernels importing nbddp from this tree."""
    root = tmp_path_factory.mktemp("lab")
    port, token = free_port(), secrets.token_hex(16)
    # no autosave: a test that edits a cell decides itself what the saved file holds; no news toast taking focus
    settings = root.parent / f"{root.name}-settings"
    for plugin, value in (("docmanager-extension/plugin", '{"autosave": false}'),
                          ("apputils-extension/notification", '{"fetchNews": "false"}')):
        (settings / "@jupyterlab" / plugin).parent.mkdir(parents=True, exist_ok=True)
        (settings / "@jupyterlab" / f"{plugin}.jupyterlab-settings").write_text(value)
    env = kernel_env(NBDDP_CACHE=str(root / "cache"))
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
         f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}", "--LabApp.expose_app_in_browser=True",
         f"--LabApp.user_settings_dir={settings}", "--ServerApp.terminals_enabled=False",
         *(["--allow-root"] if os.geteuid() == 0 else [])],
        cwd=root, env=env, stdout=open(root / "lab.log", "wb"), stderr=subprocess.STDOUT, start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2)
            break
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("JupyterLab did not start:\n" + (root / "lab.log").read_text()[-3000:])
            time.sleep(0.5)
    yield root, url, token
    server.terminate()
    server.wait(30)


@pytest.fixture(scope="module")
def browser():
    if not os.path.exists(CHROMIUM):
        pytest.fail("no Chromium: apt-get install -y chromium (make test-browser does it where it can)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        yield chromium
        chromium.close()


def open_notebook(browser, lab, name: str, cells: list[str], run_all: bool = True):
    """Write ``name`` from ``cells``, open it in JupyterLab at 1400 px, run every cell (unless told not to);
    return the page."""
    root, url, token = lab
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in cells])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
    nbformat.write(nb, str(root / name))
    page = browser.new_page(viewport={"width": WIDTH, "height": 1000})
    page.goto(f"{url}/lab/tree/{name}?token={token}&reset")
    page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=120_000)
    page.wait_for_function("window.jupyterapp && document.querySelector('.jp-Notebook-ExecutionIndicator, .jp-Toolbar')",
                           timeout=60_000)
    page.wait_for_function(  # the kernel is up: its status is idle
        "(() => { const w = window.jupyterapp.shell.currentWidget;"
        " return w && w.sessionContext && w.sessionContext.session && w.sessionContext.session.kernel"
        " && w.sessionContext.session.kernel.status === 'idle'; })()", timeout=120_000)
    if run_all:  # started, not awaited: the command's promise settles only when every cell has run
        page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")
    return page


def last_cell(page):
    return page.locator(".jp-Notebook .jp-Cell").last


def wait_for_text(page, pattern: str, timeout_s: float) -> str:
    """The last cell's text once ``pattern`` (a regex) shows in it, the cell kept in the window (JupyterLab
    skips drawing cells out of sight)."""
    deadline = time.monotonic() + timeout_s
    while True:
        cell = last_cell(page)
        cell.scroll_into_view_if_needed()
        text = cell.inner_text()
        if re.search(pattern, text):
            return text
        if time.monotonic() > deadline:
            raise AssertionError(f"{pattern!r} never showed in {timeout_s} s; the cell reads:\n{text[-3000:]}")
        time.sleep(1)


def in_view(page, locator) -> bool:
    """Whether ``locator`` is drawn inside the window once the page itself is scrolled to it (no scrolling
    inside the cell, no click)."""
    locator.scroll_into_view_if_needed()
    box = locator.bounding_box()
    return box is not None and box["height"] > 0 and 0 <= box["y"] and box["y"] + min(box["height"], 200) <= 1000


def height(locator, timeout_s: float = 30) -> float:
    """The element's drawn height, once it is drawn: the panel redraws its status line as each log arrives, and
    JupyterLab skips drawing what is out of sight, so a box read at one moment can be None, and the element found
    can be replaced before it is scrolled to (then it is looked up again)."""
    from playwright.sync_api import Error as PlaywrightError

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            locator.scroll_into_view_if_needed()
            box = locator.bounding_box()
        except PlaywrightError as exc:
            if "not attached" not in str(exc):
                raise
            box = None
        if box is not None:
            return box["height"]
        if time.monotonic() > deadline:
            raise AssertionError(f"{locator} was not drawn in {timeout_s} s")
        time.sleep(0.5)


def outputs(page) -> int:
    return last_cell(page).locator(".jp-OutputArea-child").count()


def shot(page, name: str) -> Path:
    news = page.get_by_role("button", name="No")  # JupyterLab's "get notified about news?" toast, in the way
    if news.count():
        news.first.click()
    SHOTS.mkdir(parents=True, exist_ok=True)
    path = SHOTS / f"{name}.png"
    page.screenshot(path=str(path))
    return path


def assert_cell_bounded(page):
    cell = last_cell(page)
    assert outputs(page) <= 10
    assert cell.get_by_text("Show more outputs").count() == 0
    assert "jp-mod-outputsScrolled" not in (cell.get_attribute("class") or "")


def test_a_2000_step_run_stays_a_few_outputs_with_its_summary_in_sight(lab, browser):
    page = open_notebook(browser, lab, "long.ipynb", sources(steps=2000, logging_steps=100))
    wait_for_text(page, r"training · step \d+/2000", 180)
    status = last_cell(page).locator(".nbddp-panel > div").first
    assert height(status) < 30  # the status line stays one line at 1400 px
    shot(page, "long-running")
    text = wait_for_text(page, r"nbddp: finished in|Error", 420)
    assert "nbddp: finished in" in text and "2000 steps" in text
    assert_cell_bounded(page)
    summary = last_cell(page).get_by_text(re.compile("nbddp: finished in"))
    assert in_view(page, summary)
    assert "done · step 2000/2000" in text and "learning_rate" in text
    assert height(status) < 30  # the longest status, at the end, on one line too
    assert shot(page, "long-finished").stat().st_size > 10_000
    page.close()


def test_a_failure_at_step_300_shows_one_mapped_traceback(lab, browser):
    page = open_notebook(browser, lab, "fail.ipynb", sources(steps=2000, logging_steps=50, fail_at=300))
    text = wait_for_text(page, r"JobFailed", 240)
    assert "rank 1 failed in" in text and "rank 1 gave up at step 300" in text
    assert re.search(r'File "In \[\d+\]", line \d+, in <module>  \(the %%ddp_train cell\)', text)
    assert re.search(r'File "In \[\d+\]", line \d+, in on_step_end', text)
    error = last_cell(page).locator('.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]').last
    assert in_view(page, error)
    shown = error.inner_text()  # the one traceback: no generated script, no nbddp frames, the logs named
    assert "rank 1 gave up at step 300" in shown and "script.py" not in shown and "nbddp/runtime" not in shown
    assert "every rank's own traceback and output:" in shown and shown.count("Traceback (most recent call last)") == 1
    assert_cell_bounded(page)
    shot(page, "failed-at-300")
    page.close()


def test_the_stop_button_ends_every_rank(lab, browser):
    root = lab[0]
    page = open_notebook(browser, lab, "stop.ipynb", sources(steps=2000, logging_steps=100))
    wait_for_text(page, r"training · step [1-9]\d*/2000", 180)
    page.locator('.jp-NotebookPanel-toolbar [data-command="notebook:interrupt-kernel"]').first.click()
    text = wait_for_text(page, r"JobInterrupted", 60)
    assert "every rank and torchrun have exited" in text and "interrupted · step" in text
    assert_cell_bounded(page)
    assert in_view(page, last_cell(page).get_by_text(re.compile("JobInterrupted")))
    shot(page, "stopped")
    deadline = time.monotonic() + 10
    while not no_rank_processes(str(root / "nbddp_runs")) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert no_rank_processes(str(root / "nbddp_runs"))
    page.close()


def kernel_idle(page, timeout_s: float = 300) -> None:
    """Wait until the notebook's kernel has run everything it was given."""
    page.wait_for_function(
        "(() => { const k = window.jupyterapp.shell.currentWidget.sessionContext.session.kernel;"
        " return k.status === 'idle' && !k.hasPendingInput; })()", timeout=timeout_s * 1000)


def test_a_cell_edited_and_run_without_saving_is_trained_as_it_ran(lab, browser):
    root = lab[0]
    trainer = TRAINER.replace("%%ddp_setup\n", "").replace('report_to="none"', 'report_to="none", bf16=False')
    cells = ["%load_ext nbddp", MODEL.replace("%%ddp_setup\n", ""), "max_steps = 30",
             trainer.format(steps="max_steps", logging_steps=10, callbacks="[]"), TRAIN]
    page = open_notebook(browser, lab, "edited.ipynb", cells, run_all=False)
    # the person runs the cells above the training cell, as saved
    page.evaluate("() => { const nb = window.jupyterapp.shell.currentWidget.content; nb.activeCellIndex = 4;"
                  " window.jupyterapp.commands.execute('notebook:run-all-above'); }")
    page.wait_for_function("window.jupyterapp.shell.currentWidget.content.widgets[3].model.executionCount === 4",
                           timeout=300_000)
    kernel_idle(page)
    # then edits max_steps to 60 with the keyboard, runs it and the cells below, and never saves
    editor = page.locator(".jp-Notebook .jp-Cell").nth(2).locator(".cm-content")
    editor.click()
    page.keyboard.press("Control+A")
    page.keyboard.type("max_steps = 60")
    page.keyboard.press("Escape")  # out of the editor: the cell keeps its text, the file is not saved
    # run the edited cell and every cell below it, %%ddp_train last, as Run > Run Selected Cell and All Below does
    page.evaluate("() => { const nb = window.jupyterapp.shell.currentWidget.content; nb.activeCellIndex = 2;"
                  " window.jupyterapp.commands.execute('notebook:run-all-below'); }")
    text = wait_for_text(page, r"training · step \d+/60|nbddp: finished in|Error", 300)
    shot(page, "edited-running")
    assert "/30" not in text, text
    text = wait_for_text(page, r"nbddp: finished in|Error", 420)
    assert "done · step 60/60" in text and "60 steps" in text, text
    assert "as run here: 2, 3, 4 (not as saved: 3)" in text
    assert "cell 3 differs from the saved edited.ipynb: the job takes it as run here" in text
    assert "max_steps = 30" in (root / "edited.ipynb").read_text()  # the saved file never held 60
    assert shot(page, "edited-trained").stat().st_size > 10_000
    page.close()


def cell_text(page, index: int, timeout_s: float = 30) -> str:
    """Cell ``index``'s text as drawn, once drawn: scrolled into the window first (JupyterLab skips drawing
    cells out of sight)."""
    cell = page.locator(".jp-Notebook .jp-Cell").nth(index)
    deadline = time.monotonic() + timeout_s
    while True:
        cell.scroll_into_view_if_needed()
        text = cell.locator(".jp-Cell-outputArea").inner_text()
        if text.strip() or time.monotonic() > deadline:
            return text
        time.sleep(0.5)


def test_a_kept_job_trains_again_generates_pulls_and_stops(lab, browser):
    """The kept workflow as a person runs it in JupyterLab: train with --keep, train again on the kept ranks,
    generate, pull the loss history, look at the status, stop; every cell's output read from the page."""
    from test_kept_kernel import AGAIN, FIRST, GENERATE, HISTORY, PULL, SECOND, SETUP, STATUS, STOP, TRAIN

    root = lab[0]
    cells = ["%load_ext nbddp", SETUP, TRAIN, FIRST, AGAIN, SECOND, GENERATE, HISTORY, PULL, STATUS, STOP]
    page = open_notebook(browser, lab, "kept.ipynb", cells)
    text = wait_for_text(page, r"the kept job has ended|Error", 420)
    assert "every rank has exited" in text, text
    kernel_idle(page)
    out = [cell_text(page, i) for i in range(len(cells))]
    assert not any("Error" in o for o in out), out
    assert "stay up" in out[2] and "done · step 30/30" in out[2], out[2]
    assert "done · step 30/30" in out[4] and "nbddp: finished in" in out[4], out[4]  # the panel, on the kept job
    assert "0/30 [00:00<?" not in out[4], out[4]  # no stale first frame of the bar above the panel
    first_loss, second_loss = map(float, re.search(r"losses (\S+) (\S+)", out[5]).groups())
    assert second_loss < first_loss  # trained on from the first training's weights
    assert out[6].count("generated: Q: 12+7=? A:") == 1, out[6]  # rank 0 alone prints it
    assert "pulled 10 losses" in out[8], out[8]
    assert re.search(r"nbddp: kept job, 2 rank\(s\), up (\d+ min )?\d+ s, idle (\d+ min )?\d+ s", out[9]), out[9]
    assert re.search(r"rank 0: pid \d+, cpu", out[9]) and re.search(r"rank 1: pid \d+, cpu", out[9]), out[9]
    for i in (2, 4):  # each training cell stays a few outputs, its summary in sight
        assert page.locator(".jp-Notebook .jp-Cell").nth(i).locator(".jp-OutputArea-child").count() <= 10
    page.locator(".jp-Notebook .jp-Cell").nth(4).scroll_into_view_if_needed()
    assert shot(page, "kept-trained-again").stat().st_size > 10_000
    last_cell(page).scroll_into_view_if_needed()
    assert shot(page, "kept-pulled-status-stopped").stat().st_size > 10_000
    deadline = time.monotonic() + 10
    while not no_rank_processes(str(root / "nbddp_runs")) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert no_rank_processes(str(root / "nbddp_runs"))
    page.close()


def test_the_stop_button_in_a_kept_cell_keeps_the_ranks(lab, browser):
    """Stop on a plain loop in a %%ddp cell: every rank interrupted where it is, the cell says where, not in the
    words of a failure, and the ranks stay up for the next cell."""
    from test_kept_interrupt import LOOP
    from test_kept_kernel import SMALL_SETUP, SMALL_TRAIN, STOP

    root = lab[0]
    page = open_notebook(browser, lab, "kept-stop.ipynb", ["%load_ext nbddp", SMALL_SETUP, SMALL_TRAIN, LOOP, STOP])
    deadline = time.monotonic() + 300
    while "tick 1" not in cell_text(page, 3):
        assert time.monotonic() < deadline, cell_text(page, 3)
        time.sleep(0.2)
    pressed = time.monotonic()
    page.locator('.jp-NotebookPanel-toolbar [data-command="notebook:interrupt-kernel"]').first.click()
    while "JobInterrupted" not in cell_text(page, 3):
        assert time.monotonic() - pressed < 30, cell_text(page, 3)
        time.sleep(0.1)
    shown = cell_text(page, 3)
    assert "interrupted at line 4 of this %%ddp cell (time.sleep(1)), the ranks are kept" in shown, shown
    assert "Failed" not in shown and "tick 58" not in shown, shown
    assert time.monotonic() - pressed < 10
    shot(page, "kept-stopped")
    assert not no_rank_processes(str(root / "nbddp_runs"))  # the ranks are still up
    kernel_idle(page)  # the run stopped at the interrupted cell: %ddp_stop, run by hand, ends the ranks
    page.evaluate("() => { const nb = window.jupyterapp.shell.currentWidget.content; nb.activeCellIndex = 4;"
                  " window.jupyterapp.commands.execute('notebook:run-cell'); }")
    assert "every rank has exited" in wait_for_text(page, r"every rank has exited|Error", 60)
    deadline = time.monotonic() + 10
    while not no_rank_processes(str(root / "nbddp_runs")) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert no_rank_processes(str(root / "nbddp_runs"))
    page.close()


def test_the_stop_button_in_the_keep_training_keeps_the_ranks(lab, browser):
    """Stop during the --keep cell's own training: the ranks stop together at a step and stay up, said so."""
    from test_kept_interrupt import LONG_SETUP, TRAIN
    from test_kept_kernel import STILL, STOP

    root = lab[0]
    page = open_notebook(browser, lab, "keep-stop.ipynb", ["%load_ext nbddp", LONG_SETUP, TRAIN, STILL, STOP])
    deadline = time.monotonic() + 300
    while not re.search(r"training · step [1-9]\d*/100000", cell_text(page, 2)):
        assert time.monotonic() < deadline, cell_text(page, 2)
        time.sleep(0.2)
    page.locator('.jp-NotebookPanel-toolbar [data-command="notebook:interrupt-kernel"]').first.click()
    pressed = time.monotonic()
    while "JobInterrupted" not in cell_text(page, 2):
        assert time.monotonic() - pressed < 90, cell_text(page, 2)
        time.sleep(0.2)
    shown = cell_text(page, 2)
    assert "the training stopped together at step" in shown and "the ranks are kept" in shown, shown
    assert "Failed" not in shown and "stay up" in shown, shown
    shot(page, "keep-training-stopped")
    kernel_idle(page)  # the run stopped at the interrupted cell: the next two run by hand
    page.evaluate("() => { const nb = window.jupyterapp.shell.currentWidget.content; nb.activeCellIndex = 3;"
                  " window.jupyterapp.commands.execute('notebook:run-all-below'); }")
    assert "every rank has exited" in wait_for_text(page, r"every rank has exited|Error", 120)
    assert "still kept, world 2" in cell_text(page, 3)
    deadline = time.monotonic() + 10
    while not no_rank_processes(str(root / "nbddp_runs")) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert no_rank_processes(str(root / "nbddp_runs"))
    page.close()
