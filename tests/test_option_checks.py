"""Numbers a person types are checked before anything starts, the same in the CLI, the magic and the API:
a refused option leaves no run directory and starts no process."""

import subprocess
import sys

import pytest
from IPython.core.interactiveshell import InteractiveShell

from conftest import ROOT
from nbddp.errors import NbddpError
from nbddp.job import run_job
from nbddp.options import RunOptions, switchable

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

SHIMS = ", ".join(switchable())  # the shims and the features with a switch of their own (saves, notices …)
NODES_NEED_AN_ENDPOINT = ("--nnodes 2 needs --rdzv-endpoint HOST:PORT (one machine's address and a free port, the "
                          "same on every machine): without it this machine waits for nodes that cannot find it")
ONE_NODE = ("--node-rank 5 needs a job of more than one machine, but it runs on one (no --nnodes): leave --node-rank "
            "out, or give --nnodes N and --rdzv-endpoint HOST:PORT")
#: Numbers and names that were accepted without a word (a job waiting forever, a switch no rank reads).
MISFITS = [
    ("--nnodes 2", NODES_NEED_AN_ENDPOINT),
    ("-- --nnodes=2", NODES_NEED_AN_ENDPOINT),
    ("--node-rank 5", ONE_NODE),
    ("--no-shim bogus", f"--no-shim takes one of {SHIMS}, not 'bogus'"),
    ("--shim bogus", f"--shim takes one of {SHIMS}, not 'bogus'"),
    ("--nproc 100000", "--nproc 100000 starts 100000 CPU processes of 300 MiB to 500 MiB each (torch alone), at least "),
]
BAD += [(line.split(), message) for line, message in MISFITS[::2]]  # through the CLI too: the same line


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


@pytest.mark.parametrize("kwargs, message", [
    (dict(nnodes=2), NODES_NEED_AN_ENDPOINT),
    (dict(nnodes="1:2", node_rank=1), "--nnodes 1:2 needs --rdzv-endpoint HOST:PORT"),
    (dict(node_rank=5), ONE_NODE),
    (dict(torchrun_args=["--node-rank=5"]), ONE_NODE),
    (dict(nnodes=2, node_rank=5, rdzv_endpoint="host:29400"),
     "--node-rank takes this machine's rank among the nodes, from 0 to 1, not 5"),
    (dict(no_shim=["bogus"]), f"--no-shim takes one of {SHIMS}, not 'bogus'"),
    (dict(shim=["grad_ckpt", "bogus"]), f"--shim takes one of {SHIMS}, not 'bogus'"),
    (dict(nproc=100000), "this machine has "),
])
def test_numbers_and_names_that_cannot_work_are_refused_in_one_line(monkeypatch, kwargs, message):
    monkeypatch.setenv("NBDDP_GPU_COUNT", "0")  # CPU ranks, as on the machine of the report
    with pytest.raises(NbddpError) as info:
        RunOptions(**kwargs)
    assert message in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("kwargs", [
    dict(nnodes=2, rdzv_endpoint="host:29400", node_rank=1),
    dict(torchrun_args=["--nnodes=2", "--node-rank=1", "--master-addr=host", "--master-port=29500"]),  # static
    dict(torchrun_args=["--nnodes=2", "--node-rank=0", "--master-port=29533"]),  # the static master, serving
    dict(node_rank=0), dict(shim=["SAVES"], no_shim=["grad_ckpt", "notices"]),
])
def test_jobs_across_machines_and_known_switches_pass(kwargs):
    RunOptions(**kwargs)


def test_the_switch_names_are_the_shims_and_the_features_setup_installs_under_a_switch():
    from nbddp.options import SHIM_NAMES

    assert set(SHIM_NAMES) < set(switchable()) and {"saves", "notices", "launchers"} < set(switchable())


def test_cpu_ranks_are_held_to_the_memory_there_is():
    from nbddp.preflight import RANK_BYTES_LEAST, RANK_BYTES_MOST, check_cpu_memory

    gib = 2**30
    with pytest.raises(NbddpError, match=r"^--nproc 64 starts 64 CPU processes .* at least 18.8 GiB in all, but this "
                                         r"machine has 16.0 GiB of memory available: use --nproc 32 or fewer$"):
        check_cpu_memory(64, available=16 * gib)
    (tight,) = check_cpu_memory(64, available=23 * gib)  # the report's 2 cores / 23 GB: may fit, said
    assert "up to 31.2 GiB in all, with 23.0 GiB of memory available: they may run out of memory" in tight
    assert check_cpu_memory(2, available=23 * gib) == []
    with pytest.raises(NbddpError, match="of 2.3 GiB to 2.5 GiB each .torch and the model."):
        check_cpu_memory(16, model_bytes=2 * gib, available=23 * gib)
    assert RANK_BYTES_LEAST < RANK_BYTES_MOST


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
    *MISFITS,
])
def test_the_magic_refuses_them_with_the_same_message(shell, tmp_path, capsys, monkeypatch, line, message):
    monkeypatch.setenv("NBDDP_GPU_COUNT", "0")  # --nproc counted as CPU ranks wherever the test runs
    runs = tmp_path / "runs"
    result = shell.run_cell(f"%%ddp_train --runs-dir {runs} {line}\nx = 1", store_history=True)
    assert not result.success
    shown = "".join(capsys.readouterr())
    assert f"Error: {message}" in shown
    assert not runs.exists()
