"""What a ``%%ddp`` cell shows: rank 0's text as it comes (a line's redraws collapsed), and from the first
Trainer event on the job's live panel (progress, loss curve, log view), closed with its summary.

The Trainer draws its bar's first frame just before its first event reaches the kernel, so a stream's first
redraw is held back a moment (``CarriageReturns(hold_first=True)``): when the panel opens meanwhile, the frame
goes into the panel's log view, where the bar goes on, instead of staying above the panel as a stale 0 % bar.
"""

from __future__ import annotations

import sys
import time

from ..display import LivePanel
from ..display.stream import CarriageReturns
from ..display.view import QuietView
from ..runtime.records import Event


class CellView(QuietView):
    """A kept job's ``JobView`` for one ``%%ddp`` cell (its run directory known from the start)."""

    def __init__(self, nproc: int, run_dir, *, show=None, clock=time.monotonic):
        self.nproc, self.run_dir = nproc, run_dir
        self.show, self.clock = show, clock  # the panel's (a test's stand-in for IPython's display)
        self.panel: LivePanel | None = None
        self.streams = {name: CarriageReturns(clock=clock, hold_first=True) for name in ("stdout", "stderr")}

    def sink(self, stream: str, text: str) -> None:
        if self.panel:
            self.panel.sink(stream, text)
            return
        self._write(stream, self.streams[stream].feed(text))

    def poll(self) -> None:
        """Between chunks: a held-back redraw whose moment has passed (a bar outside training) is shown."""
        if not self.panel:
            for name, stream in self.streams.items():
                self._write(name, stream.due())

    def on_metrics(self, record: dict) -> None:
        if self.panel is None and record.get("event") == Event.BEGIN:
            self.panel = LivePanel(self.nproc, show=self.show, clock=self.clock)
            self.panel.on_run_dir(self.run_dir)
            for name, stream in self.streams.items():  # a bar's frame held back: the panel's log view takes it
                held = stream.flush()
                if held:
                    self.panel.sink(name, held)
            sys.stdout.flush()
        if self.panel:
            self.panel.on_metrics(record)
        elif record.get("event") == Event.DISPLAY:
            from ..display.panel import publish_display

            publish_display(record)

    def flush(self) -> None:
        for name, stream in self.streams.items():
            self._write(name, stream.flush())
        sys.stdout.flush()

    def close(self, job) -> None:
        """The panel's final state and summary, when the cell trained."""
        self.flush()
        if self.panel:
            self.panel.close(job)

    @staticmethod
    def _write(stream: str, text: str) -> None:
        if text:
            (sys.stdout if stream == "stdout" else sys.stderr).write(text)
