"""The failing rank's report is the last thing a person reads: rank 0's consequent traceback (its collective's
peer vanished) is folded to one line, kept whole in its log; a traceback the job went on after stays as it was."""

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, write_notebook
from nbddp.display import RankLog, TerminalView
from nbddp.display.stream import HeldTraceback, exception_line
from nbddp.launch import RankFailure, RunResult

GLOO = ("[rank0]: Traceback (most recent call last):\n"
        '[rank0]:   File "/tmp/run/script.py", line 30, in <module>\n'
        "[rank0]:     trainer.train()\n"
        + "".join(f'[rank0]:   File "/lib/site-packages/transformers/trainer.py", line {n}, in train\n'
                  f"[rank0]:     return inner_training_loop(\n" for n in range(12))
        + "[rank0]: RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
          "[127.0.0.1]:41231\n")


def result(tmp_path: Path, failing_rank: int | None) -> RunResult:
    failure = None if failing_rank is None else RankFailure(rank=failing_rank, message="ValueError: boom", traceback="")
    return RunResult(returncode=1 if failure else 0, run_dir=tmp_path, script=tmp_path / "script.py", duration_s=1.0,
                     failure=failure)


def chunks(text: str, size: int = 7) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


def view_of(tmp_path, stream_text: str, failing_rank: int | None, records=()) -> str:
    err = io.StringIO()
    view = TerminalView(io.StringIO(), err)
    for piece in chunks(stream_text):
        view.sink("stderr", piece)
    for record in records:
        view.on_metrics(record)
    view.finish(result(tmp_path, failing_rank))
    return err.getvalue()


def test_rank_0s_consequent_traceback_is_one_line_in_the_terminal(tmp_path):
    shown = view_of(tmp_path, "step 3 done\n" + GLOO, failing_rank=1)
    assert shown == ("step 3 done\nnbddp: rank 0 stopped too: RuntimeError: [../third_party/gloo/gloo/transport/tcp/"
                     "pair.cc:534] Connection closed by peer [127.0.0.1]:41231 (whole traceback in its log)\n")


def test_rank_0s_own_failure_is_pointed_at_the_report_shows_it_mapped(tmp_path):
    assert view_of(tmp_path, GLOO, failing_rank=0) == "nbddp: (rank 0's raw traceback: in its log)\n"


def test_a_traceback_the_job_went_on_after_is_shown_as_it_was(tmp_path):
    assert view_of(tmp_path, "a\n" + GLOO + "b\n", failing_rank=None) == "a\n" + GLOO + "b\n"
    err = io.StringIO()
    view = TerminalView(io.StringIO(), err)
    view.sink("stderr", GLOO)
    assert err.getvalue() == ""  # held while it may be the job's end
    view.on_metrics({"event": "log", "step": 4, "loss": 1.0, "time": 4e9})  # training went on after it
    assert err.getvalue() == GLOO


def test_text_that_only_looks_like_a_traceback_start_passes_at_once():
    held = HeldTraceback()
    assert held.feed("[ra") == ""  # may be "[rank0]: Traceback …"
    assert held.feed("ndom] 50%|█") == "[random] 50%|█"
    assert held.feed("\r 60%|██") == "\r 60%|██"  # a bar's redraw is never held
    assert held.feed(" done\nTrace") == " done\n" and held.feed("back (most recent call last):\n") == ""
    assert exception_line(held.take()) == ""


FOLDED = ("rank 0 stopped too: RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed "
          "by peer [127.0.0.1]:41231 (whole traceback in its log)")


@pytest.mark.parametrize("lines", [12, 40])
def test_the_notebooks_log_view_folds_it_even_once_scrolled_out(lines):
    log = RankLog(lines=lines)
    log.feed("stdout", "epoch 1\n")
    log.feed("stderr", GLOO)
    log.cut_traceback(failure_rank=1)
    # 28 lines: in 12 the traceback's first line had scrolled out, and the fold used to miss it; the log holds
    # more lines than it shows, so once folded the line before the traceback is in view again
    assert log.lines() == ["epoch 1", FOLDED]


RANK_1_FAILS = '''import torch, torch.distributed as dist
t = torch.ones(1)
dist.all_reduce(t)
if dist.get_rank() == 1:
    raise ValueError("boom on rank 1")
dist.all_reduce(t)  # rank 0 waits here for a peer that is gone'''


@pytest.mark.e2e
def test_the_failing_ranks_report_is_the_last_thing_shown(tmp_path):
    nb = write_notebook(tmp_path / "fails.ipynb", [RANK_1_FAILS])
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run([sys.executable, "-m", "nbddp.cli", "run", "--every-rank", str(nb), "--nproc", "2", "--runs-dir", "runs"],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert proc.returncode == 1, proc.stderr
    err = proc.stderr
    assert "[rank0]: Traceback" not in err and "Traceback (most recent call last)" not in err.split("rank 1 failed")[0]
    report = err[err.index("nbddp: rank 1 failed in cell 1, line 5: ValueError: boom on rank 1"):]
    assert err.rstrip().endswith(report.rstrip()) and "nbddp: run directory" not in report  # the summary came before
    logs = list((tmp_path / "runs").glob("*/logs/*/attempt_0/0/stderr.log"))
    if "Traceback" in logs[0].read_text():  # rank 0 raised before torchrun stopped it: folded, kept whole in its log
        assert f"nbddp: rank 0 stopped too: " in err and f"(whole traceback in its log: {logs[0]})" in err


def adapter(folder: Path, *names: str) -> Path:
    folder.mkdir(parents=True)
    for name in ("adapter_config.json", *names):
        (folder / name).write_text("{}")
    return folder


def test_an_incomplete_checkpoint_is_never_listed_as_saved(tmp_path):
    """A full disk during checkpoint-30 leaves its config and 7 of its 11 files: not an adapter saved."""
    from nbddp.display import summary
    from nbddp.job import JobResult

    out = tmp_path / "outputs"
    ranks = ("rng_state_0.pth", "rng_state_1.pth")
    done = adapter(out / "checkpoint-20", "adapter_model.safetensors", "trainer_state.json", *ranks)
    adapter(out / "checkpoint-30", "adapter_model.safetensors", "optimizer.pt", "rng_state_0.pth")  # cut short
    adapter(out / "checkpoint-40", "adapter_model.safetensors", "trainer_state.json", "rng_state_0.pth")  # rank 1's
    adapter(out / "lora", ".adapter_model.safetensors.x1y2z3ab")  # the weights' save was cut short
    adapter(out / "lora_config_only")  # its weights never came
    final = adapter(out / "final", "adapter_model.safetensors")
    (tmp_path / "runs" / "r1").mkdir(parents=True)
    run = RunResult(returncode=1, run_dir=tmp_path / "runs" / "r1", script=tmp_path / "runs" / "r1" / "script.py",
                    duration_s=5.0, failure=RankFailure(rank=0, message="OSError: No space left on device",
                                                        traceback=""))
    job = JobResult.from_run(run, tmp_path)
    assert job.adapters == (done, final)
    said = summary(job)
    assert f"adapter saved in {done}, {final}" in said and "checkpoint-30" not in said
