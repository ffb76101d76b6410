"""Real runs: torchrun, two gloo processes, the real DDP reducer."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import QUICKSTART, ROOT, no_rank_processes
from nbddp.display.view import QuietView
from nbddp.job import run_job
from nbddp.options import RunOptions

pytestmark = pytest.mark.e2e


def test_quickstart_trains_on_two_ranks_through_the_cli(tmp_path):
    nb = tmp_path / "quickstart.ipynb"
    shutil.copy(QUICKSTART, nb)
    proc = subprocess.run(
        [sys.executable, "-m", "nbddp.cli", "run", str(nb), "--nproc", "2", "--runs-dir", str(tmp_path / "runs")],
        cwd=tmp_path, capture_output=True, text=True, timeout=400,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # rank 0 streamed live to the terminal
    assert "nbddp: 2 process(es), backend" in proc.stdout
    assert "Adapter saved to outputs/lora_adapter" in proc.stdout
    first, last = [float(x.rstrip(",")) for x in proc.stdout.split("Loss: first ")[1].split()[0:3:2]]
    assert last < first
    assert "finished in" in proc.stderr and "loss" in proc.stderr
    # the adapter, written once, by rank 0
    assert (tmp_path / "outputs" / "lora_adapter" / "adapter_model.safetensors").exists()
    (run_dir,) = (tmp_path / "runs").iterdir()
    rank1 = next(run_dir.glob("logs/*/attempt_0/1/stdout.log")).read_text()
    assert "trainable params" in rank1  # rank 1 trained too …
    assert "Adapter saved" not in rank1  # … but the tail ran on rank 0 only
    assert no_rank_processes(str(run_dir))


def test_rank_one_output_goes_only_to_its_log(greeting_job):
    result, streamed = greeting_job.job.run, greeting_job.streamed
    assert result.ok
    assert "hello from rank 0" in streamed and "hello from rank 1" not in streamed
    assert "hello from rank 1" in result.rank_log(1).read_text()


def test_a_failing_rank_is_reported_at_its_cell_and_line(tmp_path, notebook):
    nb = notebook(
        [
            "import os\nimport time",
            "x = 1\nif os.environ['RANK'] == '1':\n    raise ValueError('boom on rank 1')\ntime.sleep(60)\nprint('rank 0 slept')",
        ],
        markdown_first=True,
    )
    result = run_job(nb, RunOptions(every_rank=True, nproc=2, runs_dir=tmp_path / "runs"), QuietView()).run
    assert not result.ok
    f = result.failure
    assert (f.rank, f.cell, f.line) == (1, 3, 3)
    assert f.message == "ValueError: boom on rank 1"
    assert "raise ValueError('boom on rank 1')" in f.source
    assert 'File "nb.ipynb", cell 3, line 3, in <module>' in f.traceback
    assert "rank 0 slept" not in result.rank_log(0).read_text()  # rank 0 was stopped, not left sleeping
    assert no_rank_processes(str(result.run_dir))
