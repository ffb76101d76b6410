"""A job's view in a notebook cell, in a bounded number of outputs however long the run.

Outputs, in order: the panel (status line and progress bar, the loss curve and the table of the Trainer's
logged metrics, one display updated in place), the log view (rank 0's last lines, warnings once each, the
full log's path: one display updated in place), and at the end the summary, or the cell's error (the
interrupt message or one mapped traceback). Front ends that cap a cell's outputs (JupyterLab and Notebook 7
show 50) and clients that save every output (nbclient, papermill) see the same few outputs: updates to a
display replace it.

The panel is fed by the launcher's ``on_metrics`` callback with rank 0's Trainer events
(``runtime/metrics.py``), never by reading the text the ranks print. IPython and matplotlib are imported only
when a panel is made, so the CLI's text path stays light.
"""

from __future__ import annotations

import base64
import math
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from ..runtime.records import Event
from .progress import MetricsTable, Progress, loss_plot_png
from .stream import CarriageReturns, RankLog
from .text import summary

if TYPE_CHECKING:
    from ..job import JobResult

#: ``show(bundle)`` puts a display in the cell and returns its handle (``handle.update(bundle, raw=True)``).
Show = Callable[[dict], object]


def in_kernel() -> bool:
    """Whether this runs in a Jupyter kernel, where display handles update outputs in place."""
    shell = sys.modules.get("IPython") and sys.modules["IPython"].get_ipython()
    return shell is not None and hasattr(shell, "kernel")


def publish_display(record: dict) -> None:
    """A job's "display" event as rich output of the running cell (templates: papermill keeps it)."""
    if record.get("event") == Event.DISPLAY:
        _ipython_show(record.get("data") or {})


def _ipython_show(bundle: dict):
    from IPython.display import display

    return display(bundle, raw=True, display_id=True)


class LivePanel:
    """A job's view in a notebook cell: the panel and the log view, updated in place, then the summary.

    A ``JobView`` (``display/view.py``), handed to ``run_job``; ``close`` shows the final state and
    summary. ``show`` makes a display (IPython's in a kernel). Outside a kernel (a terminal IPython) rank 0's
    output is passed on as text, its redraws collapsed, and the summary printed.
    """

    def __init__(self, nproc: int, *, status_interval_s: float = 0.5, plot_interval_s: float = 2.0,
                 log_lines: int = 12, clock: Callable[[], float] = time.monotonic, show: Show | None = None):
        self.progress, self.table, self.log = Progress(nproc), MetricsTable(), RankLog(log_lines)
        self.clock = clock
        self.status_interval_s, self.plot_interval_s = status_interval_s, plot_interval_s
        self._shown_at = {"panel": -math.inf, "log": -math.inf, "plot": -math.inf}
        self._plotted = 0
        self._png: str | None = None
        self._plotting = True
        self._log_changed = False
        self.streams = {name: CarriageReturns() for name in ("stdout", "stderr")}
        self.show = show if show is not None else (_ipython_show if in_kernel() else None)
        self.panel = self.show(self.panel_bundle()) if self.show else None
        self.log_view = None

    def on_run_dir(self, run_dir: str | os.PathLike) -> None:
        self.log.path = Path(run_dir) / "logs"

    def sink(self, stream: str, text: str) -> None:
        if not self.show:
            self._write(stream, self.streams[stream].feed(text))
            return
        self.log.feed(stream, text)
        self._log_changed = True
        self._show_log()

    def rank_env(self) -> dict[str, str]:
        """What the ranks need to send rank 0's ``display()`` here as rich output (``runtime/rich.py``)."""
        return {"NBDDP_RICH_DISPLAY": "1"} if self.show else {}

    def on_metrics(self, record: dict) -> None:
        if record.get("event") == Event.DISPLAY:  # rank 0's own display() or plt.show(): shown as it was made
            if self.show:
                self.show(record.get("data") or {})
            return
        self.progress.update(record)
        self.table.add(record)
        self.log.went_on(record)
        if record.get("event") == Event.BEGIN:
            self.log.started = True
        if not self.show:
            for name, stream in self.streams.items():  # a bar held back is not left behind while training goes on
                self._write(name, stream.due())
            return
        drawn = self._plotted
        # the interval counts from the last drawing: a record with no new loss does not take the turn
        if len(self.progress.losses) > self._plotted and self._due("plot", self.plot_interval_s):
            self._draw_plot()
        if (record.get("event") in (Event.BEGIN, Event.END) or self._plotted != drawn
                or self._due("panel", self.status_interval_s)):  # a new curve is shown at once, with its table
            self.panel.update(self.panel_bundle(), raw=True)
        self._show_log()

    def close(self, job: "JobResult") -> None:
        """Show the final state, plot and log view, then the summary (an interrupt ends with the cell's error
        alone, a failure with its traceback)."""
        if self.show:
            if job.failure:
                self.log.cut_traceback(job.failure.rank)
            self.log.path = job.log_dir
            self._log_changed = True
            self._show_log(force=True)
            if len(self.progress.losses) > self._plotted:
                self._draw_plot()
            outcome = "done" if job.ok else ("interrupted" if job.interrupted else "failed")
            self.panel.update(self.panel_bundle(outcome), raw=True)
        else:
            for name, stream in self.streams.items():
                self._write(name, stream.flush())
        if not job.interrupted:
            print(summary(job), flush=True)

    def panel_bundle(self, outcome: str | None = None) -> dict:
        """Status line, then the loss curve beside the metrics table; nothing where there is nothing yet."""
        status = self.progress.bundle(outcome)
        table = self.table.html()
        plot = f'<img src="data:image/png;base64,{self._png}" alt="loss curve" style="flex:none"/>' if self._png else ""
        below = f'<div style="display:flex;gap:1em;align-items:flex-start;flex-wrap:wrap">{plot}{table}</div>' if plot or table else ""
        text = "\n".join(t for t in (status["text/plain"], self.table.text()) if t)
        return {"text/plain": text, "text/html": f'<div class="nbddp-panel">{status["text/html"]}{below}</div>'}

    def _due(self, what: str, interval_s: float) -> bool:
        now = self.clock()
        if now - self._shown_at[what] < interval_s:
            return False
        self._shown_at[what] = now
        return True

    def _show_log(self, force: bool = False) -> None:
        if not self._log_changed or not (self._due("log", self.status_interval_s) or force):
            return
        self._log_changed = False
        if self.log_view is None:
            self.log_view = self.show(self.log.bundle())
        else:
            self.log_view.update(self.log.bundle(), raw=True)

    def _draw_plot(self) -> None:
        if not self._plotting:
            return
        try:
            png = loss_plot_png(self.progress.losses, self.progress.eval_losses, self.progress.max_steps)
        except Exception as exc:  # a plot must never stop training: say so once and stop plotting
            self._plotting = False
            self.log.tail.append(f"nbddp: no loss plot ({type(exc).__name__}: {exc})")
            return
        if png is not None:
            self._plotted = len(self.progress.losses)
            self._png = base64.b64encode(png).decode("ascii")

    @staticmethod
    def _write(stream: str, text: str) -> None:
        if text:
            out = sys.stdout if stream == "stdout" else sys.stderr
            out.write(text)
            out.flush()
