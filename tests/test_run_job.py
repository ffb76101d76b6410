"""``run_job``: the one call every front end makes, from a notebook file, a kernel's selection of cells or
cells, to a ``JobResult`` (real torchrun, 2 gloo ranks)."""

import inspect
from pathlib import Path

import pytest

from nbddp import cli, job, magics, template
from nbddp.cells import cells_from_sources
from nbddp.display.view import QuietView
from nbddp.job import JobResult, prepare_job, run_job
from nbddp.options import RunOptions
from nbddp.selection import Selection
from shared_jobs import GREETING_CELLS

CELLS = GREETING_CELLS


@pytest.mark.e2e
def test_a_notebook_file_and_a_selection_of_cells_run_the_same_way(greeting_job, monkeypatch):
    folder, said, from_file = greeting_job.folder, greeting_job.said, greeting_job.job  # greet.ipynb, run_job
    monkeypatch.chdir(folder)
    assert isinstance(from_file, JobResult) and from_file.ok, from_file.failure
    assert "hello from rank 0" in greeting_job.streamed
    assert said[0] == from_file.run_dir and from_file.run_dir.name.endswith("-greet")  # on_run_dir came first
    assert from_file.script.text == from_file.script_path.read_text()

    selection = Selection(tuple(cells_from_sources(CELLS, origin="greet.ipynb")), "notebook", "greet.ipynb")
    from_cells = run_job(selection, RunOptions(every_rank=True, nproc=2, runs_dir=folder / "runs"), QuietView())
    assert from_cells.ok and from_cells.cwd == folder.resolve() and from_cells.run_dir.name.endswith("-greet")
    assert from_cells.script.text == from_file.script.text


def test_a_prepared_job_keeps_its_script_and_folder(tmp_path, notebook):
    prepared = prepare_job(notebook(CELLS, name="greet.ipynb"))
    assert prepared.cwd == tmp_path.resolve() and prepared.name == "greet"
    assert prepare_job(prepared) is prepared
    assert prepare_job(cells_from_sources(CELLS)).name == "job"


def test_every_front_end_goes_through_run_job():
    for front_end in (cli._run, magics.NbddpMagics.ddp_train, template.run_template):
        assert "run_job(" in inspect.getsource(front_end), front_end
    sources = "".join(inspect.getsource(m) for m in (cli, magics, job, template))
    assert sources.count("JobResult.from_run(") == 1 and "run_notebook" not in sources
