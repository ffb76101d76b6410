"""``nbddp run`` in a terminal: rank 0's text as it comes, so tqdm redraws its bar on one line (each frame
once: ``stream.Redraws`` drops the bar ``tqdm.write`` draws again as it was after each Trainer log); the
Trainer's logged metrics as a compact table instead of its dict lines; nothing printed on the end of a bar;
a raw traceback held back until the job's end says whether it is the consequence of another rank's failure
(then one line: ``stream.HeldTraceback``), so the failing rank's report is what a person reads last.
"""

from __future__ import annotations

import re
import sys
from typing import TYPE_CHECKING, TextIO

from .progress import MetricsTable
from .stream import HeldTraceback, Redraws, fold_traceback, trained_after
from .view import QuietView

if TYPE_CHECKING:
    from ..launch import RunResult

_TRAINER_LOG = re.compile(r"^\{'\w+': .*\}$")
#: Back to the line's start and clear it: where a bar stands, a line printed next starts clean, and the
#: bar's next redraw puts it back below (what ``tqdm.write`` does).
_CLEAR_LINE = "\r\x1b[K"


class TerminalView(QuietView):
    """A job's view (``JobView``) in a terminal (or a file: then a bar's line is ended with a newline rather
    than cleared): ``sink`` and ``on_metrics``; ``finish`` when the job ended."""

    def __init__(self, out: TextIO | None = None, err: TextIO | None = None):
        self.files = {"stdout": out or sys.stdout, "stderr": err or sys.stderr}
        self.table = MetricsTable()
        self._header: list[str] = []
        self._held = ""  # stdout's unfinished line that may be a Trainer dict
        self._open: str | None = None  # the stream whose last line is unfinished (a bar being drawn)
        self.held = HeldTraceback()  # rank 0's raw traceback (Python and torch print them on stderr)
        self.redraws = {"stdout": Redraws(), "stderr": Redraws()}  # a bar's frame once, not again after tqdm.write

    def sink(self, stream: str, text: str) -> None:
        text = self._without_trainer_dicts(text) if stream == "stdout" else self.held.feed(text)
        text = self.redraws[stream].feed(text)
        if text:
            self._emit(stream, text)

    def finish(self, result: "RunResult") -> None:
        """The job ended: a held traceback is folded to one line when the job failed (kept whole in rank 0's
        log), else shown as it was; a bar's line is ended."""
        for stream, redraws in self.redraws.items():
            if text := redraws.flush():
                self._emit(stream, text)
        if result.failure is not None and self.held.held:
            line = fold_traceback(self.held.take(), 0, result.failure.rank, result.rank_log(0, "stderr"))
            self.end_line()
            self._emit("stderr", f"nbddp: {line}\n")
        rest = self.held.release()
        if rest:
            self._emit("stderr", rest)
        self.end_line()

    def on_metrics(self, record: dict) -> None:
        if self.held.held and trained_after(record, self.held.since):  # the job went on: it was plain output
            self._emit("stderr", self.held.release())
        row = self.table.add(record)
        if row is None:
            return
        lines = []
        if self.table.columns != self._header:
            self._header = list(self.table.columns)
            lines.append(self.table.header())
        lines.append(self.table.line(row))
        self.end_line(clear=True)
        self._emit("stdout", "".join(f"{ln}\n" for ln in lines))

    def end_line(self, clear: bool = False) -> None:
        """Make the next text start a line of its own: a bar left unfinished is ended (or, with ``clear``
        on a terminal, cleared so its next redraw comes back below)."""
        if self._open is None:
            return
        f = self.files[self._open]
        cleared = clear and f.isatty()
        f.write(_CLEAR_LINE if cleared else "\n")
        f.flush()
        if cleared:  # the bar is gone from the screen: its next frame is drawn even if it is the same
            self.redraws[self._open].forget()
        self._open = None

    def _without_trainer_dicts(self, text: str) -> str:
        *complete, self._held = (self._held + text).split("\n")
        kept = "".join(f"{ln}\n" for ln in complete if not _TRAINER_LOG.match(ln.strip("\r")))
        if not self._held.startswith("{"):  # only a line that may become a dict waits for its end
            kept, self._held = kept + self._held, ""
        return kept

    def _emit(self, stream: str, text: str) -> None:
        if self._open and self._open != stream:
            self.end_line(clear=True)
        f = self.files[stream]
        f.write(text)
        f.flush()
        self._open = None if text.endswith("\n") else stream
