"""``tests/gpu/run_all.sh``'s logic, on CPU: a check that needs more GPUs than the machine has is SKIP
without running (on one GPU, none fails for lack of a second); a FAIL sets the exit status; and the
``magic`` check reads what the cell shows now (the backend line is in the log view's folded HTML)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RUN_ALL = ROOT / "tests" / "gpu" / "run_all.sh"
sys.path.insert(0, str(ROOT / "tests" / "gpu"))
import check_magics  # noqa: E402


def run_all(tmp_path, ngpu: int, checks: str, path: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "NGPU": str(ngpu), "CHECKS": checks, "LOGS": str(tmp_path / "logs")}
    if path:
        env["PATH"] = path
    return subprocess.run(["bash", str(RUN_ALL)], capture_output=True, text=True, env=env, timeout=120)


@pytest.mark.e2e
def test_on_one_gpu_the_two_gpu_checks_skip_without_running(tmp_path):
    done = run_all(tmp_path, 1, "ckpt templates each-template")
    assert done.returncode == 0, done.stdout + done.stderr
    for name in ("ckpt", "templates", "each-template"):
        assert f"SKIP {name} (needs 2 GPU(s), this machine has 1)" in done.stdout
    assert not list((tmp_path / "logs").iterdir())  # nothing ran


@pytest.mark.e2e
def test_without_a_gpu_every_check_skips(tmp_path):
    done = run_all(tmp_path, 0, "quickstart magic ckpt t4-fp16 templates each-template forked unsloth")
    assert done.returncode == 0 and "== GPU proofs (0 GPU(s))" in done.stdout
    assert done.stdout.count("SKIP ") == 2 * 8 and "PASS" not in done.stdout and "FAIL" not in done.stdout


@pytest.mark.e2e
def test_a_check_that_fails_sets_the_exit_status(tmp_path):
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "python3").write_text("#!/bin/sh\nexit 1\n")  # every check's python fails at once
    (fake / "python3").chmod(0o755)
    done = run_all(tmp_path, 1, "quickstart ckpt", path=f"{fake}:/usr/bin:/bin")
    assert done.returncode == 1
    assert "FAIL quickstart" in done.stdout and "SKIP ckpt (needs 2 GPU(s)" in done.stdout


def test_the_magic_check_reads_the_log_views_html_too():
    nb = check_magics.nbformat_like([
        {"output_type": "stream", "name": "stdout", "text": "nbddp: 3 cell(s) from %%ddp_setup\n"},
        {"output_type": "display_data", "metadata": {}, "data": {
            "text/plain": "nbddp: strategy ddp: a whole replica fits (+6 nbddp notes)",
            "text/html": '<details><summary><code>nbddp: strategy ddp …</code></summary><pre>nbddp: 1 process(es), '
                         "backend nccl, rank 0 on cuda:0 &amp; more</pre></details>"}},
        {"output_type": "stream", "name": "stdout", "text": "nbddp: finished in 20.1 s\n"},
    ], [{"output_type": "stream", "name": "stdout", "text": "JobResult(ok, steps=30)\nadapter: outputs/lora_adapter\n"}])
    streams = "".join(o.get("text", "") for c in nb.cells for o in c.outputs)
    assert "backend nccl" not in streams  # what the old check read: it failed on a run that trained
    assert check_magics.missing(check_magics.cell_text(nb), "nccl") == []
    assert check_magics.missing("nbddp: finished in 1 s", "nccl") == ["backend nccl", "JobResult(ok", "adapter:"]
