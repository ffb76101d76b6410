"""What a person sees of a job: rank 0's output as it comes, a live panel in a notebook cell (progress,
speed, ETA, a loss curve updated in place), and when it ends a summary or the failure mapped to the notebook.

The panel is fed by the launcher's ``on_metrics`` callback with rank 0's Trainer events
(``runtime/metrics.py``), never by reading the text the ranks print. IPython and matplotlib are imported only
when a panel is made, so the CLI's text path stays light.
"""

from __future__ import annotations

import base64
import html
import io
import math
import sys
import time
from typing import TYPE_CHECKING, Callable, Iterable, Sequence

from .errors import JobFailed, JobInterrupted, NbddpError
from .launch import RankFailure

if TYPE_CHECKING:
    from .job import JobResult


def summary(job: "JobResult") -> str:
    """A few lines: outcome, steps, time, throughput, loss first → last, where the adapter and files are."""
    if job.ok:
        outcome = "finished"
    elif job.interrupted:
        outcome = "interrupted"
    elif job.timed_out:
        outcome = "timed out"
    else:
        outcome = "failed"
    parts = [f"{outcome} in {job.duration_s:.1f} s"]
    if job.steps:
        total = f"/{job.max_steps}" if job.max_steps and job.max_steps != job.steps else ""
        parts.append(f"{job.steps}{total} steps")
    metrics = job.metrics
    if metrics.get("train_steps_per_second"):
        parts.append(f"{metrics['train_steps_per_second']:.2f} steps/s")
    if metrics.get("train_samples_per_second"):
        parts.append(f"{metrics['train_samples_per_second']:.1f} samples/s")
    losses = job.losses
    if losses:
        parts.append(f"loss {losses[0]:.3f} → {losses[-1]:.3f}")
    lines = ["nbddp: " + " · ".join(parts)]
    if job.adapters:
        lines.append("nbddp: adapter saved in " + ", ".join(str(p) for p in job.adapters))
    if job.output_dir:
        lines.append(f"nbddp: Trainer output_dir {job.output_dir}")
    lines.append(f"nbddp: run directory {job.run_dir} (script.py, logs/)")
    return "\n".join(lines)


def failure_headline(failure: RankFailure, label: Callable[[int], str] | None = None) -> str:
    """``rank 1 failed in cell 3, line 2: ValueError: …`` and the line's code.

    ``label`` names a cell by its number (``cell 3``, or ``In [7]`` for cells taken from a kernel).
    """
    if label is None or failure.cell is None:
        return str(failure)
    src = f"\n    {failure.source.strip()}" if failure.source.strip() else ""
    return f"rank {failure.rank} failed in {label(failure.cell)}, line {failure.line}: {failure.message}{src}"


def failure_report(failure: RankFailure, label: Callable[[int], str] | None = None, others: Iterable[str] = ()) -> str:
    """The failing rank, the notebook cell and line, its traceback with script lines mapped, then ``others``:
    lines on where the other ranks were when stopped (``launch.where_ranks_were``)."""
    tb = f"\n\n{failure.traceback.rstrip()}\n" if failure.traceback.strip() else "\n"
    rest = "".join(f"nbddp:   {line}\n" for line in others)
    return f"nbddp: {failure_headline(failure, label)}{tb}" + (f"nbddp: when the job stopped:\n{rest}" if rest else "")


def outcome_error(job: "JobResult", label: Callable[[int], str] | None = None) -> NbddpError | None:
    """The error a notebook cell ends with when its job did not finish; None when it did.

    A failing rank gives its mapped traceback, shown in the cell as the error's traceback.
    """
    if job.ok:
        return None
    if job.interrupted:
        done = f" at step {job.steps}/{job.max_steps}" if job.max_steps else ""
        return JobInterrupted(f"training stopped{done}; every rank and torchrun have exited. "
                              f"Run the cell again to start over (logs: {job.log_dir})")
    if job.timed_out:
        return JobFailed(f"timed out after {job.duration_s:.0f} s; every rank has been stopped (logs: {job.log_dir})")
    if job.failure:
        return JobFailed(failure_headline(job.failure, label), report=job.failure.traceback)
    return JobFailed(f"torchrun exited with {job.run.returncode}; see {job.run_dir / 'torchrun.log'}")


class CarriageReturns:
    """Collapses a stream's carriage-return redraws (tqdm's bars) before they reach a notebook.

    Jupyter front ends draw text that follows ``\\r`` over the current line, so a bar redrawn in place shows
    as one line; but a client that saves outputs as they arrive (nbclient, papermill) keeps every redraw.
    Of the redraws of one line in a chunk only the last is passed on, and a line still being redrawn is
    passed on at most every ``interval_s`` — ``flush()`` gives what is held back.
    """

    def __init__(self, interval_s: float = 0.5, clock: Callable[[], float] = time.monotonic):
        self.interval_s, self.clock = interval_s, clock
        self.pending = ""
        self.last_redraw = -math.inf

    def feed(self, text: str) -> str:
        text = (self.pending + text).replace("\r\n", "\n")
        self.pending = ""
        held = ""
        if text.endswith("\r"):  # may be the first half of a "\r\n"
            text, held = text[:-1], "\r"
        *complete, tail = text.split("\n")
        out = "".join(_last_redraw(line) + "\n" for line in complete)
        tail = _last_redraw(tail)
        now = self.clock()
        if "\r" in tail and now - self.last_redraw < self.interval_s:
            self.pending = tail + held
            return out
        if "\r" in tail:
            self.last_redraw = now
        self.pending = held
        return out + tail

    def due(self) -> str:
        """A held-back redraw whose interval has passed, for callers that look in between chunks."""
        if "\r" in self.pending.rstrip("\r") and self.clock() - self.last_redraw >= self.interval_s:
            return self.feed("")
        return ""

    def flush(self) -> str:
        text, self.pending = self.pending.rstrip("\r"), ""
        return text


def _last_redraw(line: str) -> str:
    """``"a\\rb\\rc"`` → ``"\\rc"``: what a front end shows of a line drawn over and over."""
    return "\r" + line.rsplit("\r", 1)[1] if "\r" in line else line


class Progress:
    """Training progress from rank 0's Trainer events: step, speed, ETA, the losses so far."""

    def __init__(self, nproc: int):
        self.nproc = nproc
        self.phase = "starting"
        self.step = self.max_steps = 0
        self.epoch: float | None = None
        self.losses: list[tuple[int, float]] = []
        self.eval_losses: list[tuple[int, float]] = []
        self._first: tuple[int, float] | None = None  # (step, time) of the first step seen
        self._last: tuple[int, float] | None = None

    def update(self, record: dict) -> None:
        event = record.get("event")
        step = int(record.get("step") or 0)
        self.max_steps = int(record.get("max_steps") or self.max_steps)
        if record.get("epoch") is not None:
            self.epoch = float(record["epoch"])
        if event == "begin":
            self.phase = "training"
        elif event == "end":
            self.phase = "finished"
        if event in ("step", "log", "end") and "time" in record:
            self.step = max(self.step, step)
            point = (step, float(record["time"]))
            if self._first is None:
                self._first = point
            elif step > self._first[0]:
                self._last = point
        if event == "log" and "loss" in record:
            self.losses.append((step, float(record["loss"])))
        if event == "log" and "eval_loss" in record:
            self.eval_losses.append((step, float(record["eval_loss"])))

    @property
    def steps_per_s(self) -> float | None:
        if not self._first or not self._last or self._last[1] <= self._first[1]:
            return None
        return (self._last[0] - self._first[0]) / (self._last[1] - self._first[1])

    @property
    def eta_s(self) -> float | None:
        rate = self.steps_per_s
        if not rate or not self.max_steps:
            return None
        return max(self.max_steps - self.step, 0) / rate

    def text(self, outcome: str | None = None) -> str:
        parts = [f"nbddp · {self.nproc} processes · {outcome or self.phase}"]
        if self.max_steps:
            parts.append(f"step {self.step}/{self.max_steps} ({100 * self.step // self.max_steps}%)")
        rate = self.steps_per_s
        if rate:
            parts.append(f"{rate:.2f} steps/s" if rate >= 1 else f"{1 / rate:.1f} s/step")
        eta = self.eta_s
        if eta is not None and self.phase == "training" and outcome is None:
            parts.append(f"ETA {_clock(eta)}")
        if self.losses:
            parts.append(f"loss {self.losses[-1][1]:.4f}")
        if self.epoch is not None:
            parts.append(f"epoch {self.epoch:.2f}")
        return " · ".join(parts)

    def bundle(self, outcome: str | None = None) -> dict:
        """The panel's status line as a display bundle: plain text, and HTML with a progress bar."""
        text = self.text(outcome)
        bar = f'<progress value="{self.step}" max="{self.max_steps}" style="width:14em"></progress> ' if self.max_steps else ""
        return {"text/plain": text, "text/html": f"<div><code>{bar}{html.escape(text)}</code></div>"}


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


def loss_plot_png(
    losses: Sequence[tuple[int, float]], eval_losses: Sequence[tuple[int, float]] = (), max_steps: int = 0
) -> bytes | None:
    """The loss curve as PNG bytes, drawn with matplotlib's Agg backend; None without matplotlib."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return None
    fig = Figure(figsize=(6, 2.6), dpi=80)
    ax = fig.add_subplot()
    if losses:
        ax.plot(*zip(*losses), marker=".", label="loss")
    if eval_losses:
        ax.plot(*zip(*eval_losses), marker="o", label="eval_loss")
    if max_steps:
        ax.set_xlim(0, max_steps)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    if eval_losses:
        ax.legend()
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")  # a bare Figure renders with Agg, whatever pyplot's backend is
    return buf.getvalue()


def in_kernel() -> bool:
    """Whether this runs in a Jupyter kernel, where display handles update outputs in place."""
    shell = sys.modules.get("IPython") and sys.modules["IPython"].get_ipython()
    return shell is not None and hasattr(shell, "kernel")


class LivePanel:
    """A job's view in a notebook cell: rank 0's output, a status line and a loss curve updated in place.

    ``sink`` and ``on_metrics`` are handed to the launcher; ``close`` shows the final state and summary.
    Outside a kernel (a terminal IPython) only the output and the summary are shown.
    """

    def __init__(self, nproc: int, *, status_interval_s: float = 0.5, plot_interval_s: float = 2.0,
                 clock: Callable[[], float] = time.monotonic):
        self.progress = Progress(nproc)
        self.clock = clock
        self.status_interval_s, self.plot_interval_s = status_interval_s, plot_interval_s
        self._status_at = self._plot_at = -math.inf
        self._plotted = 0
        self.streams = {name: CarriageReturns() for name in ("stdout", "stderr")}
        self.status = self.plot = None
        if in_kernel():
            from IPython.display import display

            self.status = display(self.progress.bundle(), raw=True, display_id=True)
            self.plot = display({"text/plain": ""}, raw=True, display_id=True)

    def sink(self, stream: str, text: str) -> None:
        self._write(stream, self.streams[stream].feed(text))

    def on_metrics(self, record: dict) -> None:
        self.progress.update(record)
        for name, stream in self.streams.items():  # a bar held back is not left behind while training goes on
            self._write(name, stream.due())
        now = self.clock()
        if self.status and (record.get("event") in ("begin", "end") or now - self._status_at >= self.status_interval_s):
            self._status_at = now
            self.status.update(self.progress.bundle(), raw=True)
        if self.plot and len(self.progress.losses) > self._plotted and now - self._plot_at >= self.plot_interval_s:
            self._plot_at = now
            self._draw_plot()

    def close(self, job: "JobResult") -> None:
        """Flush held output, show the final state and plot, then the summary."""
        for name, stream in self.streams.items():
            self._write(name, stream.flush())
        if self.status:
            outcome = "done" if job.ok else ("interrupted" if job.interrupted else "failed")
            self.status.update(self.progress.bundle(outcome), raw=True)
        if self.plot and len(self.progress.losses) > self._plotted:
            self._draw_plot()
        if not job.interrupted:  # an interrupt ends with one message: the cell's error
            print(summary(job), flush=True)

    def _draw_plot(self) -> None:
        try:
            png = loss_plot_png(self.progress.losses, self.progress.eval_losses, self.progress.max_steps)
        except Exception as exc:  # a plot must never stop training: say so once and stop plotting
            self.plot = None
            self._write("stderr", f"nbddp: no loss plot ({type(exc).__name__}: {exc})\n")
            return
        if png is not None:
            self._plotted = len(self.progress.losses)
            encoded = base64.b64encode(png).decode("ascii")
            self.plot.update({"image/png": encoded, "text/plain": f"<loss curve, {self._plotted} points>"}, raw=True)

    @staticmethod
    def _write(stream: str, text: str) -> None:
        if text:
            out = sys.stdout if stream == "stdout" else sys.stderr
            out.write(text)
            out.flush()
