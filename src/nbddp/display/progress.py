"""Training progress from rank 0's Trainer events (``runtime/metrics.py``): step, speed, ETA, the losses,
the table of logged metrics, the loss curve. Pure data and drawing; the panel and the terminal show them."""

from __future__ import annotations

import contextlib
import html
import io
import threading
from typing import Sequence

from ..runtime.records import Event

#: Keys of an event record that are nbddp's, not a metric the Trainer logged.
_NOT_METRICS = frozenset({"event", "step", "max_steps", "time", "output_dir"})


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
        if event == Event.BEGIN:
            self.phase = "training"
        elif event == Event.END:
            self.phase = "finished"
        if event in (Event.STEP, Event.LOG, Event.END) and "time" in record:
            self.step = max(self.step, step)
            point = (step, float(record["time"]))
            if self._first is None:
                self._first = point
            elif step > self._first[0]:
                self._last = point
        if event == Event.LOG and "loss" in record:
            self.losses.append((step, float(record["loss"])))
        if event == Event.LOG and "eval_loss" in record:
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
        """The status line, most wanted first: a narrow cell cuts its end (``bundle``), so the loss comes
        right after the step and the speed, ETA and epoch after it."""
        parts = [f"nbddp · {self.nproc} processes · {outcome or self.phase}"]
        if self.max_steps:
            parts.append(f"step {self.step}/{self.max_steps} ({100 * self.step // self.max_steps}%)")
        if self.losses:
            parts.append(f"loss {self.losses[-1][1]:.4f}")
        rate = self.steps_per_s
        if rate:
            parts.append(f"{rate:.2f} steps/s" if rate >= 1 else f"{1 / rate:.1f} s/step")
        eta = self.eta_s
        if eta is not None and self.phase == "training" and outcome is None:
            parts.append(f"ETA {_clock(eta)}")
        if self.epoch is not None:
            parts.append(f"epoch {self.epoch:.2f}")
        return " · ".join(parts)

    def bundle(self, outcome: str | None = None) -> dict:
        """The panel's status line as a display bundle: plain text, and HTML with a progress bar."""
        text = self.text(outcome)
        bar = f'<progress value="{self.step}" max="{self.max_steps}" style="width:12em;flex:none"></progress>' if self.max_steps else ""
        # nowrap on the text itself: front ends style <code> as pre-wrap
        line = f'<code style="white-space:nowrap;overflow:hidden;text-overflow:ellipsis;min-width:0">{html.escape(text)}</code>'
        # one line at any width: the bar keeps its size, the text is cut with "…" rather than wrapped
        style = "display:flex;gap:0.6em;align-items:center;white-space:nowrap;overflow:hidden"
        return {"text/plain": text, "text/html": f'<div style="{style}">{bar}{line}</div>'}


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


class LossPlot:
    """The loss curve, drawn again on one matplotlib figure (Agg): the figure, its axes and its ticks are made
    once, and the margins are fixed, so a redraw costs a few hundredths of a second where a new figure with
    ``tight_layout`` cost several tenths — CPU the kernel takes from ranks on the same cores. One per kernel
    (``shared``), behind a lock, so a warm-up in a thread (``warm``) and a panel never draw at once."""

    def __init__(self):
        from matplotlib.figure import Figure

        self.fig = Figure(figsize=(6, 2.6), dpi=80)
        self.fig.subplots_adjust(left=0.13, right=0.97, top=0.95, bottom=0.19)
        self.ax = self.fig.add_subplot()
        self.ax.set_xlabel("step")
        self.ax.set_ylabel("loss")
        self.ax.grid(alpha=0.3)
        (self.loss,) = self.ax.plot([], [], marker=".", label="loss")
        (self.eval,) = self.ax.plot([], [], marker="o", label="eval_loss")
        self.lock = threading.Lock()

    def png(self, losses: Sequence[tuple[int, float]], eval_losses: Sequence[tuple[int, float]] = (),
            max_steps: int = 0) -> bytes:
        with self.lock:
            for line, points in ((self.loss, losses), (self.eval, eval_losses)):
                line.set_data(*(zip(*points) if points else ([], [])))
                line.set_visible(bool(points))
            legend = self.ax.get_legend()
            if eval_losses and legend is None:
                self.ax.legend()
            elif not eval_losses and legend is not None:
                legend.remove()
            self.ax.relim(visible_only=True)
            self.ax.autoscale_view()
            if max_steps:
                self.ax.set_xlim(0, max_steps)
            buf = io.BytesIO()
            self.fig.savefig(buf, format="png")  # a bare Figure renders with Agg, whatever pyplot's backend is
            return buf.getvalue()


_shared: list[LossPlot] = []


def shared_plot() -> LossPlot | None:
    """This process' ``LossPlot``, made on first use; None without matplotlib."""
    if not _shared:
        try:
            plot = LossPlot()
        except ImportError:
            return None
        _shared[:] = _shared or [plot]
    return _shared[0]


def warm() -> None:
    """Import matplotlib and draw once (fonts, the renderer), so a job's first plot is a cheap one; run in a
    thread while a kept job's ranks load."""
    with contextlib.suppress(Exception):
        plot = shared_plot()
        if plot is not None:
            plot.png([(0, 1.0)])


def loss_plot_png(
    losses: Sequence[tuple[int, float]], eval_losses: Sequence[tuple[int, float]] = (), max_steps: int = 0
) -> bytes | None:
    """The loss curve as PNG bytes, drawn with matplotlib's Agg backend; None without matplotlib."""
    plot = shared_plot()
    return plot.png(losses, eval_losses, max_steps) if plot is not None else None


class MetricsTable:
    """The Trainer's logged metrics, one row per log (as the Trainer's notebook callback shows them): the
    step, then every metric in the order first logged. The end-of-training summary record is left out (the
    summary line has it)."""

    def __init__(self):
        self.rows: list[dict] = []
        self.columns: list[str] = ["step"]

    def add(self, record: dict) -> dict | None:
        """Take a "log" record; return its row, or None for any other record."""
        if record.get("event") != Event.LOG or "train_runtime" in record:
            return None
        row = {"step": int(record.get("step") or 0), **{k: v for k, v in record.items() if k not in _NOT_METRICS}}
        self.columns.extend(k for k in row if k not in self.columns)
        self.rows.append(row)
        return row

    def widths(self) -> list[int]:
        return [max(len(c), 9) for c in self.columns]

    def header(self) -> str:
        return "  ".join(f"{c:>{w}}" for c, w in zip(self.columns, self.widths()))

    def line(self, row: dict) -> str:
        return "  ".join(f"{_cell(row.get(c)):>{w}}" for c, w in zip(self.columns, self.widths()))

    def text(self, last: int = 8) -> str:
        if not self.rows:
            return ""
        return "\n".join([self.header(), *(self.line(r) for r in self.rows[-last:])])

    def html(self, last: int = 8) -> str:
        """The last ``last`` rows as an HTML table (all of them are in ``_ddp.log_history``)."""
        if not self.rows:
            return ""
        head = "".join(f"<th>{html.escape(c)}</th>" for c in self.columns)
        body = "".join(
            "<tr>" + "".join(f"<td>{html.escape(_cell(r.get(c)))}</td>" for c in self.columns) + "</tr>"
            for r in self.rows[-last:]
        )
        more = len(self.rows) - last
        note = f'<div style="opacity:0.65">{more} earlier row(s) in _ddp.log_history</div>' if more > 0 else ""
        return (f'<table style="font-size:12px;margin:2px 0"><thead><tr>{head}</tr></thead>'
                f"<tbody>{body}</tbody></table>{note}")


def _cell(value) -> str:
    """A metric as a table shows it: four significant digits, whether the Trainer logged a number or a string."""
    if value is None:
        return ""
    if isinstance(value, int):
        return str(value)
    try:
        return f"{float(value):.4g}"
    except (TypeError, ValueError):
        return str(value)
