"""A notebook that predicts and does not train, run on two gloo ranks: each rank predicts its own block of the
rows, and the files written after are byte for byte those one plain process writes."""

import json
import shutil
import subprocess
import sys

import nbformat
import pytest

from conftest import no_rank_processes
from nbddp.display.view import QuietView
from nbddp.job import run_job
from nbddp.options import RunOptions
from test_predict import CORPUS

pytestmark = pytest.mark.e2e

NOTEBOOK = CORPUS / "predict_classifier.ipynb"
WRITTEN = ("submission.csv", "metrics.json", "answers.json", "votes.csv")


def one_process(folder):
    """The notebook's code cells run in one plain Python process in ``folder``: the reference."""
    nb = nbformat.read(str(NOTEBOOK), as_version=4)
    code = "\n\n".join(c.source for c in nb.cells if c.cell_type == "code")
    return subprocess.run([sys.executable, "-c", code], cwd=folder, check=True, capture_output=True, text=True,
                          timeout=120).stdout


def test_a_predicting_notebook_splits_its_rows_and_writes_what_one_process_writes(tmp_path, monkeypatch):
    reference, ranked = tmp_path / "one", tmp_path / "two"
    reference.mkdir()
    ranked.mkdir()
    printed = one_process(reference).strip()
    shutil.copy(NOTEBOOK, ranked / NOTEBOOK.name)
    monkeypatch.chdir(ranked)
    result = run_job(ranked / NOTEBOOK.name, RunOptions(nproc=2, runs_dir=tmp_path / "runs"), QuietView()).run
    assert result.ok, result.failure
    for name in WRITTEN:
        assert (ranked / name).read_bytes() == (reference / name).read_bytes(), name
    # each rank's share of each loop: disjoint, in rank order, together every batch or row
    shares = {r: [json.loads(ln) for ln in (result.run_dir / "shares" / f"rank{r}.jsonl").read_text().splitlines()]
              for r in (0, 1)}
    assert [(s["unit"], s["total"]) for s in shares[0]] == [("batches", 8), ("rows", 11), ("rows", 7)] + [("batches", 8)] * 2
    for first, second in zip(shares[0], shares[1]):
        assert first["first"] == 0 and first["end"] == second["first"] < second["end"] == first["total"]
        assert 0 < first["end"]
    # and how long each share took and then waited for the other rank: a line per loop, after its rows
    for r in (0, 1):
        times = [json.loads(ln) for ln in (result.run_dir / "shares" / f"rank{r}-times.jsonl").read_text().splitlines()]
        assert [t["loop"] for t in times] == [s["loop"] for s in shares[r]]
        assert all(t["rows_s"] >= 0 and t["gather_s"] >= 0 and t["gathered"] >= s["began"]
                   for t, s in zip(times, shares[r]))
    # the code after the loops ran once, on rank 0
    assert printed.startswith("accuracy") and printed in result.rank_log(0).read_text()
    assert "accuracy" not in result.rank_log(1).read_text()
    assert no_rank_processes(str(result.run_dir))
