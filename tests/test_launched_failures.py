"""A failed launched command is said by nbddp first and cleanly: its cell and line, the exception line, the
user's own frames mapped to the script's file and line and the ``%%writefile`` cell (``nbddp.launched``),
torchrun's and nbddp's agent frames never shown. Read from recorded ``stderr.log`` texts: no process starts here.

And an install line nbddp cannot split (an unclosed quote) is a refusal at its cell and line, not an internal
error."""

from __future__ import annotations

import pytest

from nbddp.convert.clean import Install
from nbddp.errors import CellError
from nbddp.launch.planning import run_installs


def test_an_install_with_an_unclosed_quote_is_refused_at_its_cell_and_line():
    install = Install(cell=2, line=3, command="pip install 'torch")
    with pytest.raises(CellError) as err:
        install.argv()
    assert str(err.value).startswith("cell 2, line 3: "), str(err.value)
    assert "quot" in str(err.value) and "pip install 'torch" in str(err.value)
    with pytest.raises(CellError):  # as `nbddp run` runs the installs before launch
        run_installs([install], sink=lambda *_: None)


# ------------------------------------------------------------------ a failed rank's stderr.log, as recorded

from nbddp.cells import cells_from_sources  # noqa: E402
from nbddp.convert.script import convert_cells  # noqa: E402
from nbddp.launched_failures import _say_failure, failure_of, launch_line, read_rank_error  # noqa: E402

#: rank 0's stderr.log of a script that came with the notebook's folder, raising a chained multi-line error
#: (the frames of nbddp's agent and runpy starting the rank, then a warning torch prints at exit)
CHAINED = """\
[rank0]: Traceback (most recent call last):
[rank0]:   File "train.py", line 9, in step
[rank0]:     {}["x"]
[rank0]:     ~~^^^^^
[rank0]: KeyError: 'x'

[rank0]: The above exception was the direct cause of the following exception:

[rank0]: Traceback (most recent call last):
[rank0]:   File "/x/site-packages/nbddp/agent/forked_ranks.py", line 200, in run_rank
[rank0]:     namespace = runpy.run_path(script_args[0], run_name="__main__")
[rank0]:                 ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
[rank0]:   File "<frozen runpy>", line 291, in run_path
[rank0]:   File "<frozen runpy>", line 88, in _run_code
[rank0]:   File "train.py", line 12, in <module>
[rank0]:     step()
[rank0]:   File "train.py", line 11, in step
[rank0]:     raise ValueError("bad config:\\n  key x missing\\n  see docs") from e
[rank0]: ValueError: bad config:
[rank0]:   key x missing
[rank0]:   see docs
[rank0]:[W1128 04:44:50.1 ProcessGroup.cpp:1] Warning: destroy_process_group() was not called before exit
""".replace("/x/site-packages/nbddp", str(__import__("nbddp").__path__[0]))

ARGPARSE = """\
usage: train.py [-h] [--epochs EPOCHS]
train.py: error: unrecognized arguments: --bogus
"""

NOTEBOOK = ["import os", "x = 1\n!torchrun --nproc_per_node=2 train.py --bogus", "print('after')"]


def test_the_headline_is_the_exception_line_and_the_agents_frames_are_gone():
    error = read_rank_error(CHAINED)
    assert error.message == "ValueError: bad config:"
    assert error.frame == ("train.py", 11)
    assert "forked_ranks" not in error.traceback and "runpy" not in error.traceback
    assert "[rank0]" not in error.traceback and "destroy_process_group" not in error.traceback
    assert error.traceback.startswith("Traceback (most recent call last):\n  File \"train.py\", line 9")
    assert "KeyError: 'x'" in error.traceback and error.traceback.endswith("  see docs")
    parse = read_rank_error(ARGPARSE)
    assert parse.message == "train.py: error: unrecognized arguments: --bogus" and parse.parse_error
    assert read_rank_error("some output\n") is None


def _recorded_run(tmp_path, monkeypatch, logs: dict[int, str], written=None):
    """A run directory as launched mode leaves it: the job's script, each launched rank's stderr.log."""
    run_dir = tmp_path / "run"
    convert_cells(cells_from_sources(NOTEBOOK)).write(run_dir / "script.py")
    log_dir = run_dir / "launched" / "launch-1" / "logs"
    for rank, text in logs.items():
        (log_dir / "x" / "attempt_0" / str(rank)).mkdir(parents=True)
        (log_dir / "x" / "attempt_0" / str(rank) / "stderr.log").write_text(text)
    monkeypatch.setenv("NBDDP_LAUNCHED_DIR", str(run_dir / "launched"))
    monkeypatch.setenv("NBDDP_WRITTEN", __import__("json").dumps(written or {}))
    return ["python", "-m", "nbddp.agent", f"--log-dir={log_dir}", "train.py", "--bogus"], run_dir


def test_a_script_not_written_by_a_cell_is_said_at_its_launch_line_and_its_own_file_and_line(tmp_path, monkeypatch,
                                                                                            capsys):
    argv, run_dir = _recorded_run(tmp_path, monkeypatch, {0: CHAINED})
    assert launch_line(run_dir / "script.py", argv) == (2, 2, "!torchrun --nproc_per_node=2 train.py --bogus")
    _say_failure(argv, 1)
    said = capsys.readouterr().err
    assert said == ("nbddp: launched rank 0 failed; launched from cell 2, line 2 (train.py, line 11): "
                    "ValueError: bad config:\n"), said
    failure = failure_of(run_dir / "launched")
    assert (failure.cell, failure.line, failure.message) == (2, 2, "ValueError: bad config:")
    assert str(failure).startswith("launched rank 0 failed in cell 2, line 2: ValueError: bad config:\n"
                                   "    !torchrun --nproc_per_node=2 train.py --bogus")
    assert "runpy" not in failure.traceback and "forked_ranks" not in failure.traceback


def test_an_argument_parse_failure_names_the_launch_line_even_of_a_written_script(tmp_path, monkeypatch, capsys):
    argv, run_dir = _recorded_run(tmp_path, monkeypatch, {0: ARGPARSE, 1: ARGPARSE}, written={"train.py": [1, 2]})
    _say_failure(argv, 2)
    assert capsys.readouterr().err == ("nbddp: launched rank 0 failed; launched from cell 2, line 2: train.py: error: "
                                       "unrecognized arguments: --bogus\n")
    failure = failure_of(run_dir / "launched")
    assert (failure.cell, failure.line, failure.exitcode) == (2, 2, 2)


def test_a_written_scripts_frames_name_its_writefile_cell(tmp_path, monkeypatch, capsys):
    argv, run_dir = _recorded_run(tmp_path, monkeypatch, {1: CHAINED.replace("[rank0]", "[rank1]")},
                                  written={"train.py": [1, 2]})
    _say_failure(argv, 1)
    assert capsys.readouterr().err == ("nbddp: launched rank 1 failed in cell 1, line 12 (train.py, line 11): "
                                       "ValueError: bad config:\n")
    failure = failure_of(run_dir / "launched")
    assert '  File "train.py", line 11 (cell 1, line 12), in step' in failure.traceback


def test_a_later_cells_error_after_a_failed_launch_leaves_the_launch_the_jobs_failure(tmp_path):
    from nbddp.launch import RankFailure, RunResult
    from nbddp.launched_failures import record_failure, with_launched_failure

    later = RankFailure(rank=0, message="FileNotFoundError: model.pt", traceback="", cell=3, line=1)
    run = RunResult(returncode=1, run_dir=tmp_path, script=tmp_path / "script.py", duration_s=1.0, failure=later)
    assert with_launched_failure(run, tmp_path / "launched") is run  # no launch failed: the cell's error stands
    record_failure(tmp_path / "launched", rank=0, message="train.py: error: unrecognized arguments: --bogus",
                   traceback="", exitcode=2, cell=2, line=1, source="!torchrun train.py --bogus")
    failure = with_launched_failure(run, tmp_path / "launched").failure
    assert (failure.cell, failure.line, failure.launched) == (2, 1, True)
    stopped = RunResult(returncode=-15, run_dir=tmp_path, script=tmp_path / "script.py", duration_s=1.0)
    assert with_launched_failure(stopped, tmp_path / "launched") is stopped
