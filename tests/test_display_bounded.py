"""A long run stays a few outputs: the panel and the log view are updated in place, warnings are shown once,
the end is one summary or one traceback; in a terminal the metrics print as a table and nothing lands on the
end of a bar."""

import io
import json

from nbddp.display import LivePanel, RankLog, TerminalView, cell_label, clean_traceback, outcome_error
from nbddp.display.text import PACKAGE_DIR
from nbddp.cells import Cell
from nbddp.job import JobResult
from nbddp.launch import RankFailure, RunResult

STEPS, LOGGING_STEPS = 2000, 10


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class Cell_:
    """A notebook cell's outputs as nbclient keeps them: a display's updates replace it, consecutive text of
    one stream joins one output."""

    def __init__(self):
        self.outputs: list[dict] = []
        self.updates = 0

    def show(self, bundle):
        output = {"output_type": "display_data", "data": dict(bundle)}
        self.outputs.append(output)
        cell = self

        class Handle:
            def update(self, bundle, raw=True):
                output["data"] = dict(bundle)
                cell.updates += 1

        return Handle()

    def write(self, name, text):
        last = self.outputs[-1] if self.outputs else None
        if last and last["output_type"] == "stream" and last["name"] == name:
            last["text"] += text
        else:
            self.outputs.append({"output_type": "stream", "name": name, "text": text})

    def size(self) -> int:
        return len(json.dumps(self.outputs))


class Capture(io.StringIO):
    def __init__(self, cell, name):
        super().__init__()
        self.cell, self.name = cell, name

    def write(self, text):
        self.cell.write(self.name, text)
        return len(text)


def rank0_output(step):
    """What rank 0 prints around ``step``: start-up lines and warnings first, a redrawn bar, dict lines."""
    if step == 0:
        yield "stdout", "nbddp: 2 process(es), backend gloo, rank 0 on cpu, seed 0; no GPU: fp32 only\n"
        yield "stdout", "nbddp: DDP defaults: gradient_as_bucket_view on\n"
        for _ in range(2):  # the same warning from two places in the run is listed once
            yield "stderr", ("/venv/lib/transformers/training_args.py:1541: FutureWarning: `gradient_checkpointing` "
                             "is deprecated\n  warnings.warn(f\"...\", FutureWarning)\n")
        yield "stderr", "[W1123 12:00:00.000 ProcessGroupGloo.cpp:1] Warning: no GPU, gloo on CPU\n"
        yield "stderr", ("  0%|          | 0/2000 [00:00<?, ?it/s]/venv/torch/utils/data/dataloader.py:759: UserWarning: "
                         "'pin_memory' argument is set as true\n  super().__init__(loader)\n")
        return
    yield "stderr", f"\r{100 * step // STEPS:3d}%|#####     | {step}/{STEPS} [00:10<00:20, 9.0it/s]"
    if step % LOGGING_STEPS == 0:
        yield "stdout", f"{{'loss': '{3 - step / 1000:.3g}', 'grad_norm': '0.4', 'epoch': '{step / 200}'}}\n"


def records(step):
    if step == 0:
        yield {"event": "begin", "step": 0, "max_steps": STEPS, "epoch": 0, "time": 0.0, "output_dir": "/tmp/out"}
        return
    yield {"event": "step", "step": step, "max_steps": STEPS, "epoch": step / 200, "time": step * 0.1}
    if step % LOGGING_STEPS == 0:
        yield {"event": "log", "step": step, "max_steps": STEPS, "epoch": step / 200, "time": step * 0.1,
               "loss": 3 - step / 1000, "grad_norm": 0.4, "learning_rate": 0.001}
    if step == STEPS:
        yield {"event": "log", "step": step, "max_steps": STEPS, "time": step * 0.1, "train_runtime": 200.0,
               "train_steps_per_second": 10.0, "train_samples_per_second": 20.0}
        yield {"event": "end", "step": step, "max_steps": STEPS, "time": step * 0.1}


def job_result(tmp_path, history, **kw):
    run = RunResult(returncode=kw.pop("returncode", 0), run_dir=tmp_path / "r1", script=tmp_path / "r1" / "script.py",
                    duration_s=200.0, log_history=tuple(history), **kw)
    return JobResult(run, tmp_path)


def simulate(tmp_path, monkeypatch, last_step=STEPS, **result):
    """A run streamed through a panel as the launcher streams it: rank 0's text and events, 0.1 s a step."""
    cell, clock = Cell_(), Clock()
    monkeypatch.setattr("sys.stdout", Capture(cell, "stdout"))
    monkeypatch.setattr("sys.stderr", Capture(cell, "stderr"))
    print("nbddp: 2 cells from %%ddp_setup cells (registered) and this cell: In [2], In [3], In [4]")
    panel = LivePanel(2, clock=clock, show=cell.show, plot_interval_s=30.0)
    panel.on_run_dir(tmp_path / "r1")
    history = []
    for step in range(last_step + 1):
        clock.now = step * 0.1
        for stream, text in rank0_output(step):
            panel.sink(stream, text)
        for record in records(step):
            history.append(record)
            panel.on_metrics(record)
    for stream, text in result.pop("tail", ()):
        panel.sink(stream, text)
    job = job_result(tmp_path, history, **result)
    panel.close(job)
    return cell, panel, job


def test_a_2000_step_run_is_a_few_outputs_updated_in_place(tmp_path, monkeypatch):
    cell, panel, job = simulate(tmp_path, monkeypatch)
    kinds = [o["output_type"] for o in cell.outputs]
    assert kinds == ["stream", "display_data", "display_data", "stream"], kinds
    assert len(cell.outputs) <= 10 and cell.updates > 100  # live, but in place
    assert cell.size() < 100_000

    status, log, end = cell.outputs[1]["data"], cell.outputs[2]["data"], cell.outputs[3]["text"]
    # the panel: status, the loss curve and the table of logged metrics, no plot slot before there is a plot
    assert status["text/plain"].startswith("nbddp · 2 processes · done · step 2000/2000 (100%)")
    assert "data:image/png;base64," in status["text/html"] and "<table" in status["text/html"]
    assert "earlier row(s) in _ddp.log_history" in status["text/html"]
    table = status["text/plain"].splitlines()[1:]
    assert table[0].split() == ["step", "epoch", "loss", "grad_norm", "learning_rate"]
    assert table[-1].split()[:3] == ["2000", "10", "1"] and len(table) == 9  # header + the last 8 rows
    assert "train_runtime" not in status["text/plain"]

    # the log view: the bar's last redraw, each warning once, the start-up lines folded, no Trainer dicts
    text = log["text/plain"]
    assert text.count("FutureWarning: `gradient_checkpointing` is deprecated (training_args.py:1541)") == 1
    assert "torch: no GPU, gloo on CPU" in text and "warnings.warn" not in text
    assert "UserWarning: 'pin_memory' argument is set as true (dataloader.py:759)" in text  # after a bar, on its line
    assert " 0/2000" not in text and "super().__init__" not in text
    assert text.startswith("nbddp: 2 process(es), backend gloo, rank 0 on cpu, seed 0; no GPU: fp32 only (+1 nbddp notes)")
    assert "{'loss'" not in text and "2000/2000 [" in text and "1999/2000" not in text
    assert text.splitlines()[-1] == f"rank 0's full output: {tmp_path / 'r1' / 'logs'}"
    assert "<details" in log["text/html"] and "opacity" in log["text/html"]

    assert end.startswith("nbddp: finished in 200.0 s · 2000 steps")


def test_a_failure_ends_with_one_traceback_and_the_log_view_without_the_raw_one(tmp_path, monkeypatch):
    raw = ("[rank0]: Traceback (most recent call last):\n[rank0]:   File \"/r1/script.py\", line 40, in <module>\n"
           "[rank0]: RuntimeError: Connection closed by peer\n")
    failure = RankFailure(rank=1, message="ValueError: boom", traceback="Traceback (most recent call last):\nValueError: boom",
                          cell=4, line=2)
    cell, panel, job = simulate(tmp_path, monkeypatch, last_step=300, returncode=1, failure=failure,
                                tail=[("stderr", "\n" + raw)])
    assert [o["output_type"] for o in cell.outputs] == ["stream", "display_data", "display_data", "stream"]
    assert "failed · step 300/2000" in cell.outputs[1]["data"]["text/plain"]
    log = cell.outputs[2]["data"]["text/plain"]
    assert "script.py" not in log and "[rank0]" not in log
    assert "rank 0 stopped too: RuntimeError: Connection closed by peer (whole traceback in its log)" in log
    error = outcome_error(job)
    assert f"every rank's own traceback and output: {tmp_path / 'r1' / 'logs'}" in error.report


def test_an_interrupt_ends_with_the_cell_error_alone(tmp_path, monkeypatch):
    cell, panel, job = simulate(tmp_path, monkeypatch, last_step=50, interrupted=True)
    assert [o["output_type"] for o in cell.outputs] == ["stream", "display_data", "display_data"]
    assert "interrupted · step 50/2000" in cell.outputs[1]["data"]["text/plain"]
    assert "every rank and torchrun have exited" in str(outcome_error(job))


def test_one_traceback_cells_named_nbddp_frames_hidden(tmp_path):
    script = tmp_path / "r1" / "script.py"
    shim = PACKAGE_DIR / "runtime" / "shims" / "loss_filter.py"
    traceback = "\n".join([
        "Traceback (most recent call last):",
        f'  File "{script}", line 3, in <module>',
        "    _nbddp.setup()",
        '  File "%%ddp_setup cells", cell 11, line 1, in <module>',
        "    trainer.train()",
        f'  File "{shim}", line 40, in train',
        "    return wrapped(*args, **kwargs)",
        "           ^^^^^^^^^^^^^^^^^^^^^^^^",
        '  File "/venv/lib/transformers/trainer.py", line 2000, in train',
        "    return inner_training_loop(",
        '  File "%%ddp_setup cells", cell 3, line 7, in compute_loss',
        "    raise ValueError('step 300')",
        "ValueError: step 300",
    ])
    cells = [Cell(3, "def compute_loss(): ..."), Cell(11, "# %%ddp_train\ntrainer.train()")]
    label = cell_label(cells, numbering="execution")
    assert label(11) == "the %%ddp_train cell (In [11])" and label(3) == "In [3]"
    assert clean_traceback(traceback, label, hidden=[script]).splitlines() == [
        "Traceback (most recent call last):",
        '  File "In [11]", line 1, in <module>  (the %%ddp_train cell)',
        "    trainer.train()",
        '  File "/venv/lib/transformers/trainer.py", line 2000, in train',
        "    return inner_training_loop(",
        '  File "In [3]", line 7, in compute_loss',
        "    raise ValueError('step 300')",
        "ValueError: step 300",
    ]
    on_disk = cell_label(cells, numbering="notebook")
    assert '  File "nb.ipynb", cell 11, line 4, in <module>  (the %%ddp_train cell)' == clean_traceback(
        '  File "nb.ipynb", cell 11, line 4, in <module>', on_disk)


def test_log_view_keeps_only_the_last_lines_however_many_came():
    log = RankLog(lines=5)
    for i in range(10_000):
        log.feed("stdout", f"line {i}\n")
    log.feed("stderr", "bar\r" * 1000 + "last bar")
    assert log.lines() == [f"line {i}" for i in range(9995, 10_000)] + ["last bar"]
    assert len(log.partial["stderr"]) < 20 and len(log.html()) < 2000


class Tty(io.StringIO):
    def isatty(self):
        return True


def test_terminal_bar_on_one_line_metrics_as_a_table_and_a_headline_on_a_line_of_its_own():
    out = err = io.StringIO()
    view = TerminalView(out, err)
    view.sink("stderr", "\r 10%|#   | 1/10")
    view.sink("stdout", "{'loss': '3.1', 'grad_norm': '0.5', 'epoch': '0.1'}\n")
    view.on_metrics({"event": "log", "step": 1, "max_steps": 10, "time": 1.0, "loss": 3.1, "grad_norm": 0.5, "epoch": 0.1})
    view.sink("stderr", "\r 20%|##  | 2/10")
    view.on_metrics({"event": "log", "step": 2, "max_steps": 10, "time": 2.0, "loss": 2.9, "grad_norm": 0.5, "epoch": 0.2})
    view.sink("stderr", "\r 30%|### | 3/10")
    view.end_line()
    err.write("nbddp: rank 1 failed in cell 4, line 2: ValueError: boom\n")
    lines = out.getvalue().split("\n")
    assert "{'loss'" not in out.getvalue()
    assert lines[1].split() == ["step", "loss", "grad_norm", "epoch"]  # one header for the table
    assert lines[2].split() == ["1", "3.1", "0.5", "0.1"] and lines[4].split() == ["2", "2.9", "0.5", "0.2"]
    assert lines[-2] == "nbddp: rank 1 failed in cell 4, line 2: ValueError: boom"  # not after "3/10"

    tty = Tty()
    view = TerminalView(tty, tty)
    view.sink("stderr", "\r 10%|#   | 1/10")
    view.on_metrics({"event": "log", "step": 1, "time": 1.0, "loss": 3.1})
    assert tty.getvalue() == "\r 10%|#   | 1/10\r\x1b[K" + "     step       loss\n        1        3.1\n"


def test_the_loss_plot_is_drawn_when_a_new_loss_comes_not_held_back_by_steps_between():
    """The plot is redrawn at most every ``plot_interval_s``, counted from its last drawing: step events in
    between used to take the turn (nothing new to draw) and push a new loss back a whole interval more, the
    table showing a row the curve lacked."""
    clock, cell = Clock(), Cell_()
    panel = LivePanel(2, clock=clock, show=cell.show, plot_interval_s=2.0)
    events = [(0.0, {"event": "begin", "step": 0, "max_steps": 10}),
              (0.1, {"event": "log", "step": 1, "max_steps": 10, "loss": 2.0}),
              (2.2, {"event": "step", "step": 2, "max_steps": 10}),  # the interval has passed: nothing new yet
              (2.5, {"event": "log", "step": 2, "max_steps": 10, "loss": 1.5})]
    for now, record in events:
        clock.now = now
        panel.on_metrics({**record, "time": now})
    assert len(panel.table.rows) == 2
    assert panel._plotted == 2  # the curve has the table's last loss, drawn as it came (2.4 s after the last drawing)
    shown = cell.outputs[0]["data"]["text/html"]  # the panel: the new curve shown with the row, not 0.5 s later
    assert panel._png in shown and "<td>1.5</td>" in shown
