"""Numbers a person types are checked before anything starts, the same in the CLI, the magic and the API:
a refused option leaves no run directory and starts no process."""

import subprocess
import sys

import pytest
from IPython.core.interactiveshell import InteractiveShell

from conftest import ROOT
from nbddp.errors import NbddpError
from nbddp.job import run_job
from nbddp.options import RunOptions

BAD = [
    (["--nproc", "0"], "--nproc takes a whole number of processes of at least 1, not 0"),
    (["--nproc", "-1"], "--nproc takes a whole number of processes of at least 1, not -1"),
    (["--timeout", "-5"], "--timeout takes a number of seconds above 0, not -5"),
    (["--timeout", "nan"], "--timeout takes a number of seconds above 0, not nan"),
    (["--timeout", "inf"], "--timeout takes a number of seconds above 0, not inf"),
    (["--collective-timeout", "0"], "--collective-timeout takes a number of seconds above 0, not 0"),
    (["--collective-timeout", "nan"], "--collective-timeout takes a number of seconds above 0, not nan"),
    (["--", "--master-port=99999"], "--master-port takes a port number from 1 to 65535, not '99999'"),
    (["--", "--master-port", "http"], "--master-port takes a port number from 1 to 65535, not 'http'"),
]


@pytest.mark.e2e
@pytest.mark.parametrize("argv, message", BAD)
def test_the_cli_refuses_bad_numbers_before_anything_starts(tmp_path, notebook, argv, message):
    nb = notebook(["print('never runs')"])
    runs = tmp_path / "runs"
    at = argv.index("--") if "--" in argv else len(argv)
    cmd = [sys.executable, "-m", "nbddp.cli", "run", str(nb), "--runs-dir", str(runs), *argv[:at], *argv[at:]]
    proc = subprocess.run(cmd, cwd=tmp_path, text=True, capture_output=True, timeout=120,
                          env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 2, proc.stderr
    assert f"nbddp: error: {message}" in proc.stderr
    assert not runs.exists() or not list(runs.iterdir())  # no run directory left behind


def test_a_busy_master_port_leaves_no_run_directory(tmp_path, notebook):
    import socket

    with socket.socket() as held:
        held.bind(("", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(NbddpError, match=f"port {port} .* already in use"):
            run_job(notebook(["x = 1"]),
                    RunOptions(nproc=2, runs_dir=tmp_path / "runs", torchrun_args=[f"--master-port={port}"]))
    assert not (tmp_path / "runs").exists() or not list((tmp_path / "runs").iterdir())


@pytest.mark.parametrize("kwargs", [dict(nproc=0), dict(timeout_s=float("nan")), dict(collective_timeout_s=-1.0)])
def test_the_api_refuses_them_too(kwargs):
    with pytest.raises(NbddpError):
        RunOptions(**kwargs)


def test_good_values_pass():
    RunOptions(nproc=None, timeout_s=None, collective_timeout_s=None)
    RunOptions(nproc=8, timeout_s=0.5, collective_timeout_s=1800, torchrun_args=["--master-port=29511"])


@pytest.fixture
def shell():
    ip = InteractiveShell.instance()
    ip.run_cell("%load_ext nbddp", store_history=True)
    yield ip
    ip.run_cell("%unload_ext nbddp")
    InteractiveShell.clear_instance()


@pytest.mark.parametrize("line, message", [
    ("--timeout -5", "--timeout takes a number of seconds above 0, not -5"),
    ("--timeout nan", "--timeout takes a number of seconds above 0, not nan"),
    ("-- --master-port=0", "--master-port takes a port number from 1 to 65535, not '0'"),
])
def test_the_magic_refuses_them_with_the_same_message(shell, tmp_path, capsys, line, message):
    runs = tmp_path / "runs"
    result = shell.run_cell(f"%%ddp_train --runs-dir {runs} {line}\nx = 1", store_history=True)
    assert not result.success
    shown = "".join(capsys.readouterr())
    assert f"Error: {message}" in shown
    assert not runs.exists()
