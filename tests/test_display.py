"""The notebook view of a job: carriage returns, progress, the loss plot, the summary and the cell's error."""

import os
import time

from nbddp.display import CarriageReturns, Progress, loss_plot_png, outcome_error, summary
from nbddp.errors import JobFailed, JobInterrupted
from nbddp.job import JobResult
from nbddp.launch import RankFailure, RunResult


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_redraws_of_a_line_collapse_to_the_last():
    cr = CarriageReturns(interval_s=0.5, clock=Clock())
    assert cr.feed("start\n\r 10%\r 20%\r 30%\n") == "start\n\r 30%\n"
    assert cr.feed("plain text, no newline yet") == "plain text, no newline yet"


def test_a_line_still_being_redrawn_is_passed_on_at_most_every_interval():
    clock = Clock()
    cr = CarriageReturns(interval_s=0.5, clock=clock)
    assert cr.feed("\r 1%") == "\r 1%"
    clock.now = 0.1
    assert cr.feed("\r 2%") == ""  # held back
    clock.now = 0.2
    assert cr.feed("\r 3%") == ""
    clock.now = 0.7
    assert cr.feed("\r 4%") == "\r 4%"
    clock.now = 0.8
    assert cr.feed("\r 5%") == ""
    assert cr.feed("\r 6%\nnext") == "\r 6%\nnext"  # a finished line always goes through
    clock.now = 0.9
    assert cr.feed("\r 7%") == ""
    assert cr.due() == ""  # not yet
    clock.now = 1.5
    assert cr.due() == "\r 7%" and cr.due() == ""  # passed on once its interval is over
    clock.now = 1.6
    assert cr.feed("\r 8%") == ""
    assert cr.flush() == "\r 8%" and cr.flush() == ""


def test_crlf_split_across_chunks_stays_a_newline():
    cr = CarriageReturns(clock=Clock())
    assert cr.feed("line one\r") == "line one"
    assert cr.feed("\nline two\r\n") == "\nline two\n"


def records():
    yield {"event": "begin", "step": 0, "max_steps": 10, "epoch": 0, "time": 100.0, "output_dir": "/tmp/out"}
    for step in range(1, 11):
        yield {"event": "step", "step": step, "max_steps": 10, "epoch": step / 10, "time": 100.0 + step * 0.5}
        if step % 2 == 0:
            yield {"event": "log", "step": step, "max_steps": 10, "epoch": step / 10, "time": 100.0 + step * 0.5,
                   "loss": 3.0 - step * 0.2, "learning_rate": 0.001}


def test_progress_speed_eta_and_losses():
    p = Progress(nproc=2)
    assert p.text() == "nbddp · 2 processes · starting"
    for r in records():
        p.update(r)
        if r["event"] == "step" and r["step"] == 4:
            assert p.steps_per_s == 2.0 and p.eta_s == 3.0
            assert "step 4/10 (40%) · loss 2.6000 · 2.00 steps/s · ETA 0:03 · epoch 0.40" in p.text()
    assert p.losses[0] == (2, 2.6) and len(p.losses) == 5
    assert '<progress value="10" max="10"' in p.bundle("done")["text/html"]
    assert "ETA" not in p.text("done")


def test_the_status_line_says_the_loss_before_what_a_narrow_cell_may_cut():
    """The line is one line cut with "…" where the cell is narrow (1400 px with JupyterLab's sidebar open cut it
    before the loss): the step and the loss come first, the speed, ETA and epoch after them."""
    p = Progress(nproc=2)
    for r in records():
        p.update(r)
        if r["event"] == "step" and r["step"] == 4:
            break
    parts = p.text().split(" · ")
    assert parts.index("loss 2.6000") == parts.index("step 4/10 (40%)") + 1
    assert parts.index("loss 2.6000") < min(parts.index("2.00 steps/s"), parts.index("ETA 0:03"), parts.index("epoch 0.40"))


def test_loss_plot_is_a_png():
    png = loss_plot_png([(2, 2.6), (4, 2.2), (6, 1.8)], [(6, 2.0)], max_steps=10)
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 1000


def run_result(tmp_path, **kw):
    history = tuple(records()) + (
        {"event": "log", "step": 10, "max_steps": 10, "time": 106.0, "train_runtime": 5.0,
         "train_steps_per_second": 2.0, "train_samples_per_second": 32.0, "train_loss": 2.0},
        {"event": "end", "step": 10, "max_steps": 10, "time": 106.0},
    )
    defaults = dict(returncode=0, run_dir=tmp_path / "runs" / "r1", script=tmp_path / "runs" / "r1" / "script.py",
                    duration_s=12.5, log_history=history)
    return RunResult(**{**defaults, **kw})


def test_job_result_finds_what_the_run_wrote(tmp_path):
    (tmp_path / "runs" / "r1").mkdir(parents=True)
    old = tmp_path / "old_adapter"
    old.mkdir()
    (old / "adapter_config.json").write_text("{}")
    os.utime(old / "adapter_config.json", (time.time() - 3600,) * 2)  # from an earlier run
    new = tmp_path / "outputs" / "lora"
    new.mkdir(parents=True)
    (new / "adapter_config.json").write_text("{}")
    (new / "adapter_model.safetensors").write_bytes(b"weights")
    history = list(run_result(tmp_path).log_history)
    history[0] = {**history[0], "output_dir": str(tmp_path / "outputs")}
    job = JobResult.from_run(run_result(tmp_path, log_history=tuple(history)), tmp_path)
    assert job.adapters == (new,)
    assert job.output_dir == tmp_path / "outputs"
    assert job.steps == 10 and job.max_steps == 10
    assert job.metrics["train_runtime"] == 5.0
    assert job.log_history[0] == {"step": 2, "epoch": 0.2, "loss": 2.6, "learning_rate": 0.001}
    assert job.log_dir == tmp_path / "runs" / "r1" / "logs" and job.script_path.name == "script.py"
    assert repr(job).startswith("JobResult(ok, steps=10, loss=1")

    text = summary(job)
    assert "finished in 12.5 s · 10 steps · 2.00 steps/s · 32.0 samples/s · loss 2.600 → 1.000" in text
    assert f"adapter saved in {new}" in text and "run directory" in text
    assert outcome_error(job) is None


def test_the_error_a_cell_ends_with(tmp_path):
    failure = RankFailure(rank=1, message="ValueError: boom", traceback='  File "In", cell 7, line 2, in <module>',
                          cell=7, line=2, source="raise ValueError('boom')")
    job = JobResult(run_result(tmp_path, returncode=1, failure=failure), tmp_path)
    error = outcome_error(job, label=lambda i: f"In [{i}]")
    assert isinstance(error, JobFailed)
    assert str(error).startswith("rank 1 failed in In [7], line 2: ValueError: boom")
    assert error._render_traceback_()[0] == '  File "In [7]", line 2, in <module>'  # the cell as the notebook names it

    job = JobResult(run_result(tmp_path, returncode=0, interrupted=True), tmp_path)  # torchrun may exit 0 when stopped
    assert not job.ok and summary(job).startswith("nbddp: interrupted in")
    error = outcome_error(job)
    assert isinstance(error, JobInterrupted) and "step 10/10" in str(error) and "Run the cell again" in str(error)
    assert error._render_traceback_() == [f"JobInterrupted: {error}"]

    job = JobResult(run_result(tmp_path, returncode=-9, timed_out=True), tmp_path)
    assert "timed out" in str(outcome_error(job))
    job = JobResult(run_result(tmp_path, returncode=3), tmp_path)
    assert "torchrun exited with 3" in str(outcome_error(job))


def test_the_loss_plot_is_drawn_again_on_one_figure():
    """Redraws reuse the kernel's one figure (cheap: the kernel shares the CPUs with the ranks) and still
    show what each call is given: the points, and the eval curve with its legend only when there is one."""
    from nbddp.display import progress

    progress.warm()
    plot = progress.shared_plot()
    first = loss_plot_png([(2, 2.6), (4, 2.2)], max_steps=10)
    assert progress.shared_plot() is plot
    assert plot.loss.get_xydata().tolist() == [[2, 2.6], [4, 2.2]] and not plot.eval.get_visible()
    assert plot.ax.get_legend() is None and plot.ax.get_xlim() == (0, 10)
    second = loss_plot_png([(2, 2.6), (4, 2.2), (6, 1.0)], [(6, 1.5)], max_steps=20)
    assert second != first and second.startswith(b"\x89PNG")
    assert plot.eval.get_visible() and plot.ax.get_legend() is not None and plot.ax.get_xlim() == (0, 20)
    assert plot.ax.get_ylim()[0] <= 1.0  # rescaled to the new points
    loss_plot_png([(2, 2.6)])
    assert plot.ax.get_legend() is None and not plot.eval.get_visible()


SAME = ("SameBatches: nbddp: ranks 0 and 1 trained on the same samples in their first 3 training steps … Fix: feed the "
        "training loop from a DataLoader")
OWN_STOP_TRACEBACK = f"""Traceback (most recent call last):
  File "nb.ipynb", cell 40, line 18, in <module>
    y_pred = model_0(X_train)
  File "/lib/torch/nn/modules/module.py", line 1811, in inner
    args_kwargs_result = hook(self, args, kwargs)
nbddp.runtime.same_batches.SameBatches: {SAME.removeprefix('SameBatches: ')}"""


def test_a_stop_of_nbddps_own_is_said_without_a_traceback(tmp_path):
    """The same-samples check (or the replica guard) stops a rank with its reason, cell, line and fix: said once, not
    again at the end of a traceback through torch's hook frames that ends in nbddp's own exception class."""
    from nbddp.display import failure_report

    failure = RankFailure(rank=0, message=SAME, traceback=OWN_STOP_TRACEBACK, cell=40, line=18,
                          source="y_pred = model_0(X_train)")
    report = failure_report(failure, label=lambda i: f"cell {i}")
    assert report.count("trained on the same samples") == 1 and "Traceback" not in report and "module.py" not in report
    assert "rank 0 failed in cell 40, line 18: SameBatches" in report and "y_pred = model_0(X_train)" in report
    error = outcome_error(JobResult(run_result(tmp_path, returncode=1, failure=failure), tmp_path), lambda i: f"cell {i}")
    assert "trained on the same samples" in str(error)
    assert not any("module.py" in line or "Traceback" in line for line in error._render_traceback_())
