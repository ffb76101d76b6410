"""What a ``%%ddp`` cell shows: rank 0's text as it comes (a line's redraws collapsed), and from the first
Trainer event on the job's live panel (progress, loss curve, log view), closed with its summary."""

from __future__ import annotations

import sys

from ..display import LivePanel
from ..display.stream import CarriageReturns
from ..runtime.records import Event


class CellView:
    def __init__(self, nproc: int, run_dir):
        self.nproc, self.run_dir = nproc, run_dir
        self.panel: LivePanel | None = None
        self.streams = {name: CarriageReturns() for name in ("stdout", "stderr")}

    def sink(self, stream: str, text: str) -> None:
        if self.panel:
            self.panel.sink(stream, text)
            return
        out = self.streams[stream].feed(text)
        if out:
            (sys.stdout if stream == "stdout" else sys.stderr).write(out)

    def on_metrics(self, record: dict) -> None:
        if self.panel is None and record.get("event") == Event.BEGIN:
            self.flush()
            self.panel = LivePanel(self.nproc)
            self.panel.on_run_dir(self.run_dir)
        if self.panel:
            self.panel.on_metrics(record)
        elif record.get("event") == Event.DISPLAY:
            from ..display.panel import publish_display

            publish_display(record)

    def flush(self) -> None:
        for name, stream in self.streams.items():
            out = stream.flush()
            if out:
                (sys.stdout if name == "stdout" else sys.stderr).write(out)
        sys.stdout.flush()

    def close(self, job) -> None:
        """The panel's final state and summary, when the cell trained."""
        self.flush()
        if self.panel:
            self.panel.close(job)
