"""The self-launching script's parts: the embedded runtime, the launcher's decisions, failures seen by Kaggle."""

import os
import subprocess
import sys
import zipfile

import pytest

from conftest import write_notebook
from nbddp.export import export_kaggle
from nbddp.export.kaggle import runtime_zip
from nbddp.runtime import selflaunch


@pytest.mark.e2e
def test_runtime_zip_is_reproducible_and_importable_alone(tmp_path):
    data = runtime_zip()
    assert data == runtime_zip()  # same sources, same bytes: an export can be diffed
    path = tmp_path / "nbddp.zip"
    path.write_bytes(data)
    names = zipfile.ZipFile(path).namelist()
    assert "nbddp/runtime/dist.py" in names and "nbddp/runtime/shims/__init__.py" in names
    assert "nbddp/demo.py" in names and not any(n.startswith(("nbddp/convert/", "nbddp/launch", "nbddp/job.py")) for n in names)
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import nbddp.runtime, nbddp.demo, nbddp.runtime.selflaunch; "
            "print(nbddp.runtime.__file__)")
    proc = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True,
                          env={"PATH": os.environ["PATH"]}, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(path / "nbddp" / "runtime" / "__init__.py")


def test_process_count_and_torchrun_argv(monkeypatch):
    monkeypatch.setenv("NBDDP_NPROC", "3")
    assert selflaunch.process_count() == 3
    monkeypatch.delenv("NBDDP_NPROC")
    assert selflaunch.process_count() == 2  # no GPU here: two gloo processes
    argv = selflaunch.torchrun_argv("/k/run.py", 2, "/k/logs")
    assert argv[:3] == [sys.executable, "-m", "torch.distributed.run"] and argv[-1] == "/k/run.py"
    assert "--nproc_per_node=2" in argv and "--local-ranks-filter=0" in argv and "--log-dir=/k/logs" in argv


def test_under_torchrun_main_returns(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert selflaunch.under_torchrun()
    assert selflaunch.main("/nonexistent.py", [["false"]]) is None  # neither installs nor launches


def test_pip_installs_use_this_interpreter():
    assert selflaunch.install_argv(["pip", "install", "-q", "trl"]) == [sys.executable, "-m", "pip", "install", "-q", "trl"]
    assert selflaunch.install_argv(["apt-get", "install", "-y", "x"]) == ["apt-get", "install", "-y", "x"]


def run_exported(tmp_path, sources):
    nb = write_notebook(tmp_path / "nb.ipynb", sources)
    script = export_kaggle(nb, tmp_path / "kernel", kernel_id="me/failing-run",
                           every_rank=True).script  # no training call: every cell on every rank, as asked
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "NBDDP_NPROC", "LOCAL_RANK")}
    return subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.e2e
def test_a_failing_install_stops_before_launch(tmp_path):
    proc = run_exported(tmp_path, ["!pip install -q --no-index nbddp-no-such-package-xyz", "print('trained')"])
    assert proc.returncode != 0
    assert "nbddp: install failed" in proc.stderr and "starting" not in proc.stdout
    assert not (tmp_path / "nbddp_logs").exists()


@pytest.mark.e2e
def test_a_failing_rank_fails_the_kaggle_run(tmp_path):
    proc = run_exported(tmp_path, ["import os\nif os.environ['RANK'] == '1':\n    raise ValueError('boom on rank 1')"])
    assert proc.returncode != 0  # Kaggle marks the version failed
    assert "ValueError: boom on rank 1" in proc.stdout + proc.stderr  # torchrun's failure summary


def test_several_machines_through_the_command_line_or_the_environment(monkeypatch):
    monkeypatch.delenv("NBDDP_TORCHRUN_ARGS", raising=False)
    assert selflaunch.torchrun_options([]) == []
    single = selflaunch.torchrun_argv("/k/run.py", 2, "/k/logs", [])
    assert "--standalone" in single
    monkeypatch.setenv("NBDDP_TORCHRUN_ARGS", "--nnodes=2 --rdzv-endpoint=10.0.0.1:29400")
    extra = selflaunch.torchrun_options(["--node-rank=1"])
    assert extra == ["--nnodes=2", "--rdzv-endpoint=10.0.0.1:29400", "--node-rank=1"]
    multi = selflaunch.torchrun_argv("/k/run.py", 2, "/k/logs", extra)
    assert "--standalone" not in multi and multi[-4:] == [*extra, "/k/run.py"]
