"""Inputs a person should never have to see nbddp's traceback for: a cell holding a NUL byte, option values
and paths that cannot work, a notebook whose code deletes its own run directory. Each gets one clear line
before anything launches (or, for what only the run can show, a report pointing at the user's code)."""

import os
import re

import nbformat
import pytest

from nbddp import choose_strategy as strategy, cli, preflight
from nbddp.convert import convert_notebook
from nbddp.errors import NbddpError
from nbddp.options import RunOptions

NUL_CELL = "x = 1\x00\nprint(x)"


@pytest.fixture
def nul_notebook(tmp_path):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(NUL_CELL),
                                         nbformat.v4.new_code_cell("print('trained')")])
    path = tmp_path / "nul.ipynb"
    nbformat.write(nb, str(path))
    return path


def test_a_nul_byte_is_named_not_printed(nul_notebook, capsys):
    assert cli.main(["convert", str(nul_notebook)]) == 2
    err = capsys.readouterr().err
    assert "\x00" not in err
    assert "cell 1, line 1: not valid Python: source code string cannot contain null bytes" in err
    assert "x = 1\\x00" in err  # the byte, escaped


def test_a_skipped_nul_cell_leaves_a_script_that_compiles(nul_notebook, tmp_path, capsys):
    out = tmp_path / "train.py"
    assert cli.main(["convert", str(nul_notebook), "--skip-bad-cells", "-o", str(out)]) == 0
    text = out.read_text()
    assert "\x00" not in text and "\x00" not in capsys.readouterr().err
    compile(text, str(out), "exec")  # the header's comment of the skipped cell holds no NUL
    assert "skipped cell 1" in text and "print('trained')" in text


def test_run_with_skip_bad_cells_decides_a_strategy_for_it(nul_notebook):
    script = convert_notebook(nul_notebook, skip_bad_cells=True)
    assert strategy.read_shape(script.text).model is None  # used to raise: source cannot contain null bytes
    assert strategy.decide(script.text, nul_notebook.parent, gpu_free=()).strategy == "ddp"


# ------------------------------------------------------------------ processes, nodes and paths, before launch


@pytest.fixture
def tiny_notebook(tmp_path):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("print('never runs')")])
    path = tmp_path / "nb.ipynb"
    nbformat.write(nb, str(path))
    return path


def refused(argv, capsys) -> str:
    """``nbddp ARGV`` in this process: it must exit 2 with one ``nbddp: error:`` line (or argparse's usage)."""
    try:
        code = cli.main([str(a) for a in argv])
    except SystemExit as exc:  # argparse's own refusal: usage and one error line
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    return err


def test_more_processes_than_gpus_is_refused_naming_both_numbers(tiny_notebook, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(preflight.GPU_COUNT_ENV, "1")  # as on a one-GPU machine
    err = refused(["run", tiny_notebook, "--nproc", "2", "--runs-dir", tmp_path / "runs"], capsys)
    assert ("nbddp: error: --nproc 2 asks for 2 processes, one per GPU, but torch sees 1 GPU(s) here: use --nproc 1"
            in err) and "GPU T4 x2" in err
    assert not (tmp_path / "runs").exists()
    from nbddp.job import run_job

    with pytest.raises(NbddpError, match="torch sees 1 GPU"):  # the API (templates, other front ends) too
        run_job(tiny_notebook, RunOptions(nproc=4, runs_dir=tmp_path / "runs"))
    monkeypatch.setenv(preflight.GPU_COUNT_ENV, "2")
    assert preflight.check_processes(2) == [] and preflight.check_processes(None) == []


def test_more_cpu_processes_than_cores_is_a_warning(tiny_notebook, capsys):
    warning = preflight.check_processes(64, gpus=0, cores=2)
    assert warning == ["--nproc 64 starts 64 CPU processes (no GPU here) on 2 CPU core(s): they share the cores "
                       "and each step slows down; --nproc 2 or fewer runs faster"]
    assert preflight.check_processes(2, gpus=0, cores=2) == []
    args = cli._parser().parse_args(["run", str(tiny_notebook), "--nproc", str(preflight.cpu_cores() + 1)])
    assert RunOptions.parse(args).nproc == preflight.cpu_cores() + 1
    assert "CPU processes (no GPU here)" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["convert", "{nb}", "-o", "{tmp}"], "-o {tmp} is a folder; give a file path, e.g. {tmp}/train.py"),
    (["convert", "{nb}", "-o", ""], "-o takes a file path, not ''"),
    (["convert", "{nb}", "-o", "/proc/x.py"], "-o /proc/x.py cannot be written: its folder /proc is not writable"),
    (["convert", "{nb}", "-o", "{nb}/x.py"], "-o {nb}/x.py cannot be written: its folder {nb} is a file, not a folder"),
    (["run", "{nb}", "--runs-dir", "/proc/nope"], "--runs-dir /proc/nope cannot be made in /proc"),
    (["run", "{nb}", "--runs-dir", "{nb}"], "--runs-dir {nb} is a file, not a folder"),
    (["run", "{nb}", "--runs-dir", ""], "argument --runs-dir: takes a folder, not ''"),
    (["run", "{nb}", "--runs-dir", "a\x00b"], "--runs-dir 'a\\x00b' cannot be a path: it holds a NUL byte"),
    (["convert", "{nb}", "-o", "a\x00b.py"], "-o 'a\\x00b.py' cannot be a path: it holds a NUL byte"),
    (["convert", "{nb}", "-o", "{tmp}/" + "n" * 300], "is not a path this system can write (File name too long)"),
    (["run", "{nb}", "--nnodes", "0"], "--nnodes takes a number of machines of at least 1, or MIN:MAX, not '0'"),
    (["run", "{nb}", "--nnodes", "3:2"], "--nnodes takes a number of machines of at least 1, or MIN:MAX, not '3:2'"),
    (["run", "{nb}", "--nnodes", "2", "--node-rank", "2"], "--node-rank takes this machine's rank among the nodes, "
                                                           "from 0 to 1, not 2"),
    (["run", "{nb}", "--node-rank", "-1"], "--node-rank takes this machine's rank among the nodes, from 0 or more"),
    (["run", "{nb}", "--rdzv-endpoint", "host:99999"], "--rdzv-endpoint takes HOST:PORT (a port from 1 to 65535)"),
    (["run", "{nb}", "--rdzv-endpoint", ":29500"], "--rdzv-endpoint takes HOST:PORT"),
    # the doctor's probe of -1 processes failed as a broken NCCL link does, with NCCL's hints
    (["doctor", "--nproc", "-1"], "--nproc takes a whole number of processes of at least 1, not -1"),
    (["doctor", "--timeout", "0"], "--timeout takes a number of seconds above 0, not 0"),
])
def test_every_path_and_number_an_option_carries_is_checked_first(tiny_notebook, tmp_path, capsys, argv, message):
    fill = {"nb": tiny_notebook, "tmp": tmp_path}
    before = sorted(tmp_path.rglob("*"))
    err = refused([a.format(**fill) for a in argv], capsys)
    assert message.format(**fill) in err
    assert sorted(tmp_path.rglob("*")) == before  # nothing made, nothing left behind


def test_a_runs_folder_that_cannot_be_made_is_said_by_the_api_too(tiny_notebook):
    from nbddp.job import run_job

    with pytest.raises(NbddpError, match="cannot make a run directory under /proc/nope .*--runs-dir or NBDDP_RUNS"):
        run_job(tiny_notebook, RunOptions(every_rank=True, nproc=1, runs_dir="/proc/nope", strategy="ddp"))


# ------------------------------------------------------------------ a notebook deleting its own run directory

DELETES_RUNS = '''import shutil
shutil.rmtree("runs", ignore_errors=True)  # tidy up'''


@pytest.mark.e2e
def test_deleting_the_run_directory_is_refused_at_its_line(tmp_path):
    """In a process of its own: an audit hook cannot be removed."""
    import subprocess
    import sys

    run_dir = tmp_path / "runs" / "r1"
    run_dir.mkdir(parents=True)
    (tmp_path / "mine").mkdir()
    code = f'''
import os, shutil, sys
from nbddp.runtime import rundir
assert rundir.protect({str(run_dir)!r})
shutil.rmtree({str(tmp_path / "mine")!r})  # the notebook's own folders stay the notebook's
for victim in ({str(run_dir)!r}, {str(tmp_path / "runs")!r}):
    try:
        shutil.rmtree(victim, ignore_errors=True)
    except rundir.RunDirectoryInUse as exc:
        print("refused:", exc)
open({str(run_dir / "f")!r}, "w").close(); os.remove({str(run_dir / "f")!r})  # nbddp's own files inside: its writers'
'''
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("refused: this deletes") == 2 and run_dir.is_dir() and not (tmp_path / "mine").exists()
    assert f"which holds nbddp's run directory for this job ({run_dir}" in done.stdout


@pytest.mark.e2e
def test_a_notebook_deleting_its_run_directory_is_told_at_its_cell_and_line(tmp_path, capsys):
    nb = tmp_path / "tidy.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(DELETES_RUNS),
                                                   nbformat.v4.new_code_cell("print('after')")]), str(nb))
    old = os.getcwd()
    os.chdir(tmp_path)
    try:
        code = cli.main(["run", "--every-rank", str(nb), "--nproc", "2", "--runs-dir", "runs"])
    finally:
        os.chdir(old)
    err = capsys.readouterr().err
    assert code == 1, err
    # every rank runs the cell, so whichever rank raised first is the one reported
    assert re.search(r"nbddp: rank [01] failed in cell 1, line 2: RunDirectoryInUse: this deletes ", err), err
    assert "shutil.rmtree(\"runs\", ignore_errors=True)" in err and "metrics.jsonl" not in err
    assert list((tmp_path / "runs").iterdir())  # the run directory, its logs and records, are still there


# ------------------------------------------------------------------ library notices nobody can act on

GEMM = ("Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please make sure you already `pip install "
        "kernels` and the kernels >= 0.11.1")


def test_bitsandbytes_cpu_kernel_notice_is_dropped_and_nothing_else(caplog):
    import logging

    from nbddp.runtime import notices

    notices.quiet()
    notices.quiet()
    logger = logging.getLogger("bitsandbytes.backends.cpu.ops")
    assert len(logger.filters) == 1
    with caplog.at_level(logging.WARNING):
        logger.warning(GEMM, "No module named 'kernels'")
        logger.warning("something bitsandbytes means")
    assert [r.getMessage() for r in caplog.records] == ["something bitsandbytes means"]


@pytest.mark.e2e
def test_a_run_importing_bitsandbytes_streams_no_kernel_notice(tmp_path, capsys):
    pytest.importorskip("bitsandbytes")
    nb = tmp_path / "bnb.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("import bitsandbytes\nprint('in')")]),
                   str(nb))
    assert cli.main(["run", "--every-rank", str(nb), "--nproc", "2", "--runs-dir", str(tmp_path / "runs")]) == 0
    said = "".join(capsys.readouterr()) + "".join(p.read_text() for p in (tmp_path / "runs").rglob("std*.log"))
    assert "gemm_4bit_forward" not in said and "in" in said
