"""The magics in a real kernel: notebooks executed with nbclient on CPU/gloo, asserted on their saved outputs."""

import base64
import re
import shutil
import sys

import pytest

from conftest import ROOT, no_rank_processes, write_notebook
from kernel import displays, errors, execute, stream

pytestmark = pytest.mark.e2e

EXAMPLE = ROOT / "notebooks" / "magics.ipynb"
sys.path.insert(0, str(ROOT / "tests" / "gpu"))
import check_magics  # noqa: E402  - run_all.sh's ``magic`` check, read on this same run


def test_the_example_notebook_trains_with_a_live_panel_and_leaves_its_result(tmp_path):
    path = tmp_path / EXAMPLE.name
    shutil.copy(EXAMPLE, path)
    nb, client = execute(path, NBDDP_CACHE=str(tmp_path / "cache"))
    setup, train, result, inference = nb.cells[2], nb.cells[4], nb.cells[6], nb.cells[8]
    assert "registered for the job" in stream(setup, "stdout")
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert not any(errors(cell) for cell in code), [errors(cell) for cell in code]
    # the GPU proofs' ``magic`` check (tests/gpu/check_magics.py) passes on the notebook as it runs now
    assert check_magics.missing(check_magics.cell_text(nb), "gloo") == []

    # the job: the registered cells plus the magic cell, numbered as the kernel numbers them
    out = stream(train, "stdout")
    assert "2 cells from %%ddp_setup cells (registered) and this cell: In [2], In [3], In [4]" in out
    panel, log = displays(train)
    assert "nbddp: 2 process(es), backend gloo" in log  # rank 0's output: in the log view
    assert re.search(r"finished in [\d.]+ s · 30 steps · [\d.]+ steps/s · [\d.]+ samples/s · loss [\d.]+ → [\d.]+", out)
    assert f"adapter saved in {tmp_path / 'outputs' / 'lora_adapter'}" in out

    # the panel: a status line, a loss curve and the metrics table, updated in place through its display id;
    # the log view too; nothing else but the lines before and the summary
    assert [o.output_type for o in train.outputs] == ["stream", "display_data", "display_data", "stream"]
    assert "done" in panel and "step 30/30" in panel and "learning_rate" in panel
    html = train.outputs[1].data["text/html"]
    png = re.search(r'src="data:image/png;base64,([^"]+)"', html).group(1)
    assert base64.b64decode(png).startswith(b"\x89PNG\r\n\x1a\n")
    train_index = nb.cells.index(train)
    panel_id, log_id = [d for c, kind, d, _ in client.messages if c == train_index and kind == "display_data"]
    updates = [d for c, kind, d, mimes in client.messages if kind == "update_display_data"]
    assert updates.count(panel_id) >= 2 and updates.count(log_id) >= 1

    # the Trainer's bar in the log view: its last redraw only, and no Trainer dict lines (the table has them)
    assert len(re.findall(r"\b30/30 \[", log)) == 1
    assert not re.search(r"\b([1-9]|[12]\d)/30 \[", log) and "{'loss'" not in log

    # the next cells: the result, then the adapter loaded in the kernel for inference
    text = stream(result, "stdout")
    losses = [float(x) for x in re.search(r"loss: \[(.*)\]", text).group(1).split(",")]
    assert len(losses) == 10 and losses[-1] < losses[0]  # rank 0's 10 logs: one Trainer in DDP, not two alone
    assert f"adapter: {tmp_path / 'outputs' / 'lora_adapter'}" in text
    assert stream(inference, "stdout").startswith("Q: 12+7=? A:")
    assert no_rank_processes(str(tmp_path))


FAIL = '''%%ddp_train --nproc 2 --every-rank --env NBDDP_TEST_GREETING=hello
print("greeting:", os.environ["NBDDP_TEST_GREETING"], flush=True)
if os.environ["RANK"] == "1":
    raise ValueError("boom on rank 1")
time.sleep(60)'''

TQDM = '''import time
from tqdm import tqdm
for _ in tqdm(range(200), mininterval=0, file=sys.stderr):
    time.sleep(0.005)
print("loop done")'''


def test_notebook_cells_a_failing_rank_and_a_whole_notebook_file(tmp_path):
    other = write_notebook(tmp_path / "other.ipynb", ["import sys", TQDM])
    sources = [
        "%load_ext nbddp",
        "import os\nimport time",
        "%%ddp_train --dry-run --every-rank --diff --save saved.py\nprint('dry')",
        FAIL,
        f"%ddp_train {other.name} --nproc 2 --every-rank --out other_result",
        "print('other ok:', other_result.ok)",
    ]
    # Jupyter's server tells the kernel its notebook through JPY_SESSION_NAME (ipykernel sets __session__)
    nb, _ = execute(tmp_path / "nb.ipynb", sources, JPY_SESSION_NAME="nb.ipynb")
    dry, fail, whole, after = nb.cells[2], nb.cells[3], nb.cells[4], nb.cells[5]

    # --dry-run: the cells taken from the saved notebook above the magic, and the script; nothing launched
    text = stream(dry, "stdout")
    assert "2 cells from nb.ipynb (notebook): cell 2, cell 3" in text
    assert "# [cell 2]" in text and "_nbddp.setup()" in text and "print('dry')" in text
    assert "\n+_nbddp.setup()" in text  # --diff: from the cells' code to the script
    assert (tmp_path / "saved.py").exists() and (tmp_path / "saved.py.map.json").exists()

    # the failing rank's traceback, at the notebook's cell and line, as the cell's error; earlier
    # %%ddp_train cells are other jobs and are not part of this one
    assert "2 cells from nb.ipynb (notebook): cell 2, cell 4" in stream(fail, "stdout")
    (error,) = errors(fail)
    assert error.ename == "JobFailed"
    assert error.evalue.startswith("rank 1 failed in the %%ddp_train cell (cell 4), line 4: ValueError: boom on rank 1")
    assert any('File "nb.ipynb", cell 4, line 4, in <module>' in line for line in error.traceback)
    assert not any("script.py" in line or "runtime" in line for line in error.traceback)  # nbddp's frames hidden
    assert "greeting: hello" in displays(fail)[1] and "failed in" in stream(fail, "stdout")

    # %ddp_train NOTEBOOK: the whole file; tqdm's redraws reach the notebook collapsed, one bar in the end
    assert not errors(whole)
    shown = displays(whole)[1]
    assert "loop done" in shown and "other ok: True" in stream(after, "stdout")
    log = next((tmp_path / "nbddp_runs").glob("*-other/logs/*/attempt_0/0/stderr.log")).read_bytes()
    assert log.count(b"\r") >= 200 and "\r" not in shown
    bars = [ln for ln in shown.splitlines() if "/200 [" in ln]
    assert len(bars) == 1 and "200/200" in bars[0]
    assert no_rank_processes(str(tmp_path))


def test_history_source_doctor_and_usage_errors(tmp_path):
    sources = [
        "%load_ext nbddp",
        "x = 1",
        "x = 1",
        "%ddp_doctor --timeout 120",
        "%%ddp_train --dry-run --every-rank\nprint(x)",
        "%%ddp_train --dry-run --every-rank --source notebook\nprint(x)",
        "%%ddp_train --nproc two\nprint(x)",
        "print(get_ipython().find_cell_magic('ddp_train').__doc__)",  # what %ddp_train? shows
        "%%ddp_train --dry-run --every-rank --env NOEQUALS\nprint(x)",
        "%%ddp_setup\nhidden = 1",
        "%%ddp_setup --also-here\nshared = 2",
        "print('here:', 'hidden' in dir(), shared)\n%ddp_setup --list",
        "%%ddp_train --dry-run --every-rank\nprint(hidden + shared)",
        "%ddp_setup --clear",
    ]
    nb, _ = execute(tmp_path / "hist.ipynb", sources)
    doctor, dry, forced, bad, help_ = nb.cells[3], nb.cells[4], nb.cells[5], nb.cells[6], nb.cells[7]
    env, listed, registered, cleared = nb.cells[8], nb.cells[11], nb.cells[12], nb.cells[13]

    report = stream(doctor, "stdout")
    assert re.search(r"ok\s+all-reduce\s+2 processes over gloo: correct", report)
    assert re.search(r"ok\s+kernel memory", report) and "/dev/shm" in report

    # no notebook file known: the kernel's history, a cell run twice taken once (named by its last run)
    text = stream(dry, "stdout")
    assert "2 cells from the kernel's history (history): In [3], In [5]" in text
    assert "the kernel does not say which notebook file it runs" in text
    assert "1 earlier version of cells run again left out" in text

    (error,) = errors(forced)
    assert "cannot take the cells from the notebook file" in error.evalue and len(error.traceback) == 1
    assert "UsageError" in stream(bad, "stderr") and "--nproc" in stream(bad, "stderr")

    shown = stream(help_, "stdout")
    for option in ("--nproc", "--dry-run", "--show-script", "--diff", "--timeout", "--no-shim", "--env", "--save",
                   "--out", "--source", "torchrun"):
        assert option in shown, option

    (error,) = errors(env)
    assert error.ename == "NbddpError" and "--env expects NAME=VALUE, got 'NOEQUALS'" in error.evalue

    # %%ddp_setup: registered and not run here, unless --also-here; registered cells then make the job
    text = stream(listed, "stdout")
    assert "here: False 2" in text
    assert "2 cell(s) registered for the job\n  In [10]: hidden = 1\n  In [11]: shared = 2" in text
    assert "2 cells from %%ddp_setup cells (registered) and this cell: In [10], In [11], In [13]" in stream(registered, "stdout")
    assert "hidden = 1" in stream(registered, "stdout") and "x = 1" not in stream(registered, "stdout")
    assert "0 cell(s) registered" in stream(cleared, "stdout")
