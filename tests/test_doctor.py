"""Pre-flight checks: each check's verdict, and the real all-reduce across 2 gloo processes."""

import subprocess
import sys

import pytest

from conftest import ROOT, no_rank_processes
from nbddp import doctor

T4 = {"rank": 0, "local_rank": 0, "name": "Tesla T4", "capability": "7.5", "total_bytes": 15 * 2**30,
      "free_bytes": 14 * 2**30, "bf16": False}
A100 = {**T4, "name": "NVIDIA A100", "capability": "8.0", "bf16": True}


def test_precision():
    assert doctor.precision_check([A100, {**A100, "local_rank": 1}]).status == "ok"
    check = doctor.precision_check([T4, {**T4, "local_rank": 1}])
    assert check.status == "warn" and "no bf16 on Tesla T4" in check.detail and "fp16=True" in check.hint
    assert doctor.precision_check([{"rank": 0, "device": "cpu"}]).detail == "CPU: float32"


def test_gpus():
    check = doctor.gpus_check([T4, {**T4, "local_rank": 1}], 2)
    assert check.status == "ok" and check.detail.startswith("2: cuda:0 Tesla T4 (sm 7.5, 15.0 GiB, 14.0 free)")
    assert doctor.gpus_check([], 2).status == "fail"
    assert "CPU with gloo" in doctor.gpus_check([], 0).detail


def test_small_shm_suggests_disabling_nccls_shared_memory(tmp_path):
    check = doctor.shm_check(str(tmp_path), minimum=2**60)
    assert check.status == "warn" and "NCCL_SHM_DISABLE=1" in check.hint
    assert doctor.shm_check(str(tmp_path), minimum=1).status == "ok"
    assert doctor.shm_check(str(tmp_path / "missing")).status == "info"


def test_kernel_memory():
    assert doctor.kernel_gpu_memory() == {}  # no CUDA used in this process
    warning = doctor.kernel_memory_warning({0: 3 * 2**30, 1: 2**29})
    assert "cuda:0 3.0 GiB, cuda:1 0.5 GiB" in warning and "torch.cuda.empty_cache()" in warning
    assert doctor.kernel_memory_warning({}) is None


def test_data_parallel_warning_names_the_crash():
    check = doctor.data_parallel_check(2)
    assert check.status == "warn" and "DataParallel" in check.detail and "CheckpointError" in check.detail
    assert "%%ddp_train" in check.hint


def test_report_text_and_verdict():
    report = doctor.Report((doctor.Check("a", "ok", "fine"), doctor.Check("bb", "warn", "hm", "do this")))
    assert report.ok and report.text().splitlines() == ["nbddp doctor", "  ok    a   fine", "  warn  bb  hm",
                                                        "            → do this"]
    assert not doctor.Report((doctor.Check("a", "fail", "no"),)).ok


@pytest.mark.e2e
def test_nbddp_doctor_all_reduces_across_two_gloo_processes(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "nbddp.cli", "doctor", "--timeout", "180"], capture_output=True,
                          text=True, timeout=400, cwd=tmp_path,
                          env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin", "TMPDIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "all-reduce  2 processes over gloo: correct, 4 MiB in" in proc.stdout
    assert "kernel memory" not in proc.stdout  # a kernel check, not the CLI's
    assert not list(tmp_path.glob("nbddp-doctor-*"))  # a passing probe leaves nothing behind
    assert no_rank_processes(str(tmp_path))


@pytest.mark.e2e
def test_a_probe_that_does_not_answer_in_time_fails_with_nccl_hints(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)
    # ranks that hang before their all-reduce, as over a broken NCCL link (a second was once too short for
    # ranks to start at all; forked from a warm agent they answer within it on a fast machine)
    monkeypatch.setattr(doctor, "PROBE_SCRIPT", "import time\n\ntime.sleep(300)\n")
    probe = doctor.all_reduce_probe(nproc=2, timeout_s=1)
    assert probe.check.status == "fail" and "no answer within 1 s" in probe.check.detail
    assert "NCCL_P2P_DISABLE=1" in probe.check.hint
    (kept,) = tmp_path.glob("nbddp-doctor-*")  # kept, with its logs, for a look
    assert str(kept) in probe.check.detail
    assert no_rank_processes(str(tmp_path))
