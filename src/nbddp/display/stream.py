"""Rank 0's raw output made short: tqdm's redraws collapsed, and a log view that keeps the last lines.

``CarriageReturns`` serves a stream passed on as text (a terminal IPython); ``RankLog`` is what a notebook
cell shows in one output updated in place: the last lines of rank 0's stdout and stderr as a front end would
draw them, each library warning once (folded), nbddp's start-up lines in one folded line, and where the full
log is. Its size is bounded however long the run.
"""

from __future__ import annotations

import html
import math
import re
import time
from collections import deque
from pathlib import Path
from typing import Callable

#: Longest line a view keeps (a bar or a dict longer than this is cut; the log file has it whole).
MAX_LINE = 300
#: Most different warnings a view lists.
MAX_WARNINGS = 30

#: Python's warning line; it may follow a bar left unfinished on the same line (a warning while a bar stands).
_PY_WARNING = re.compile(r"(?:^|(?<=\]))(?P<file>[^\s:][^:]*\.py):(?P<line>\d+): (?P<category>[A-Z]\w*Warning): (?P<message>.*)$")
_TORCH_WARNING = re.compile(r"^\[W\d{3,4} [^\]]*\] (?:Warning: )?(?P<message>.*)$")
_TRAINER_LOG = re.compile(r"^\{'\w+': .*\}$")
#: A traceback's first line, as Python prints it or with torch's ``[rank0]:`` prefix.
_TRACEBACK = re.compile(r"^(?:\[rank\d+\]:\s*)?Traceback \(most recent call last\)")
_DIM = "opacity:0.65"


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


def _compact(tail: str) -> str:
    """A partial line as little as a front end shows of it: its last redraw (a final ``\\r`` kept, as it may
    be the first half of ``\\r\\n``)."""
    body, held = (tail[:-1], "\r") if tail.endswith("\r") else (tail, "")
    return _last_redraw(body) + held


def _shown(line: str) -> str:
    """What a front end draws of a finished line, cut to ``MAX_LINE``."""
    text = line.rsplit("\r", 1)[-1] if "\r" in line.rstrip("\r") else line.rstrip("\r")
    return text if len(text) <= MAX_LINE else text[: MAX_LINE - 1] + "…"


class RankLog:
    """Rank 0's output as a notebook cell shows it: the last ``lines`` lines, warnings once each, nbddp's
    start-up lines folded, the full log's path.

    ``feed`` takes raw text from either stream. Lines the Trainer prints as dicts (``{'loss': …}``) are left
    out: the panel's table has them. nbddp's own lines are start-up lines until ``started`` is set (when
    training begins); after that they are shown as they come.
    """

    def __init__(self, lines: int = 12):
        self.tail: deque[str] = deque(maxlen=lines)
        self.partial = {"stdout": "", "stderr": ""}
        self.warnings: dict[str, int] = {}
        self.startup: list[str] = []
        self.started = False
        self.path: Path | None = None
        self.total = 0
        self._source_line_next = False

    def feed(self, stream: str, text: str) -> None:
        text = (self.partial[stream] + text).replace("\r\n", "\n")
        *complete, tail = text.split("\n")
        for line in complete:
            self._add(_shown(line))
        self.partial[stream] = _compact(tail)

    def _add(self, line: str) -> None:
        self.total += 1
        after_warning, self._source_line_next = self._source_line_next, False
        if not line.strip() or _TRAINER_LOG.match(line):
            return
        if after_warning and line.startswith(" "):
            return  # the code line Python prints under a warning
        m = _PY_WARNING.search(line)
        if m:
            self._source_line_next = True
            self._warn(f"{m['category']}: {m['message']} ({Path(m['file']).name}:{m['line']})")
        elif (m := _TORCH_WARNING.match(line)):
            self._warn(f"torch: {m['message']}")
        elif line.startswith("nbddp: ") and not self.started:
            self.startup.append(line)
        else:
            self.tail.append(line)

    def _warn(self, key: str) -> None:
        if key in self.warnings or len(self.warnings) < MAX_WARNINGS:
            self.warnings[key] = self.warnings.get(key, 0) + 1

    def cut_traceback(self) -> None:
        """Drop a raw traceback from the shown lines: the cell's error shows it once, mapped to the cells."""
        lines = list(self.tail)
        at = next((i for i, ln in enumerate(lines) if _TRACEBACK.match(ln)), None)
        if at is not None:
            self.tail = deque([*lines[:at], "(rank 0's raw traceback: in its log)"], maxlen=self.tail.maxlen)

    def lines(self) -> list[str]:
        """The shown lines: the kept tail, then each stream's line still being drawn (a progress bar)."""
        bars = [_shown(p) for p in (self.partial["stdout"], self.partial["stderr"]) if _shown(p).strip()]
        return [*self.tail, *bars]

    def where(self) -> str:
        return f"rank 0's full output: {self.path}" if self.path else "rank 0's full output: in the run directory's logs/"

    def text(self) -> str:
        out = []
        if self.startup:
            more = f" (+{len(self.startup) - 1} nbddp notes)" if len(self.startup) > 1 else ""
            out.append(self.startup[0] + more)
        if self.warnings:
            out.append(f"{len(self.warnings)} library warning(s), each shown once:")
            out.extend(f"  {key}" for key in self.warnings)
        return "\n".join([*out, *self.lines(), self.where()])

    def html(self) -> str:
        parts = []
        if self.startup:
            more = f" · {len(self.startup) - 1} more" if len(self.startup) > 1 else ""
            parts.append(_folded(html.escape(self.startup[0]) + more, self.startup[1:]))
        if self.warnings:
            listed = [f"{k}" + (f"  (×{n})" if n > 1 else "") for k, n in self.warnings.items()]
            parts.append(_folded(f"⚠ {len(self.warnings)} library warning(s), each shown once", listed))
        shown = html.escape("\n".join(self.lines()))
        parts.append(f'<pre style="margin:2px 0;padding:0;overflow-x:auto;white-space:pre">{shown}</pre>')
        parts.append(f'<div style="{_DIM}">{html.escape(self.where())}</div>')
        return f'<div class="nbddp-log" style="font-size:12px">{"".join(parts)}</div>'

    def bundle(self) -> dict:
        return {"text/plain": self.text(), "text/html": self.html()}


def _folded(summary_html: str, lines: list[str]) -> str:
    """A dimmed ``<details>``: one line shown, the rest on a click."""
    body = html.escape("\n".join(lines))
    inner = f'<pre style="margin:0;white-space:pre-wrap">{body}</pre>' if lines else ""
    return f'<details style="{_DIM}"><summary><code>{summary_html}</code></summary>{inner}</details>'
