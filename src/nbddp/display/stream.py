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

from ..runtime.records import Event

#: Longest line a view keeps (a bar or a dict longer than this is cut; the log file has it whole).
MAX_LINE = 300
#: Most different warnings a view lists.
MAX_WARNINGS = 30

#: Python's warning line; it may follow a bar left unfinished on the same line (a warning while a bar stands).
_PY_WARNING = re.compile(r"(?:^|(?<=\]))(?P<file>[^\s:][^:]*\.py):(?P<line>\d+): (?P<category>[A-Z]\w*Warning): (?P<message>.*)$")
_TORCH_WARNING = re.compile(r"^\[W\d{3,4} [^\]]*\] (?:Warning: )?(?P<message>.*)$")
_TRAINER_LOG = re.compile(r"^\{'\w+': .*\}$")
#: A finished progress bar (tqdm's line: ``Tokenizing: 100%|█████| 1024/1024 [00:00<00:00, …]``).
_FINISHED_BAR = re.compile(r"\d+%\|.*\|\s*[\d.]+[kMG]?/[\d.]+[kMG]?\b")
#: Lines the log holds, of which it shows ``lines``: the finished bars yield first (``RankLog.lines``).
HELD_LINES = 200
#: A traceback's first line, as Python prints it or with torch's ``[rank0]:`` prefix.
_TRACEBACK = re.compile(r"^(?:\[rank\d+\]:\s*)?Traceback \(most recent call last\)")
#: The same where it starts in a stream: at a line's start, or after a bar left unfinished on the line.
_TRACEBACK_IN_STREAM = re.compile(r"(?m)(?:^|(?<=[\r\]]))(?:\[rank\d+\]:\s*)?Traceback \(most recent call last\)")
_RANK_PREFIX = re.compile(r"^\[rank\d+\]:\s?")
#: The line naming the exception: ``ValueError: …``, ``torch.distributed.DistBackendError: …``, ``KeyboardInterrupt``.
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(?::\s.*)?$")
_TRACEBACK_WORDS = ("Traceback (most recent call last)", "During handling of the above exception",
                    "The above exception was the direct cause")
#: Lines of a held traceback past which it is released: no dying rank prints that much.
HOLD_LIMIT_LINES = 400
_DIM = "opacity:0.65"


def exception_line(traceback: str) -> str:
    """The line of a raw traceback that names its exception (the last one, for a chain), without torch's
    ``[rankN]:`` prefix, cut to ``MAX_LINE``; "" where there is none."""
    found = ""
    for line in traceback.replace("\r", "\n").splitlines():
        text = _RANK_PREFIX.sub("", line).rstrip()
        if text and not text[0].isspace() and not text.startswith(_TRACEBACK_WORDS) and _EXCEPTION_LINE.match(text):
            found = text
    return _shown(found)


def fold_traceback(traceback: str, rank: int, failure_rank: int | None, log: Path | str | None) -> str:
    """One line for rank ``rank``'s raw traceback once the job failed: the consequence of another rank's failure
    (a collective whose peer vanished) is named by its exception alone; the failing rank's own is shown
    mapped to the notebook by the report, so here it is only pointed at. Kept whole in the rank's log."""
    where = f"in its log: {log}" if log else "in its log"
    if failure_rank == rank:
        return f"(rank {rank}'s raw traceback: {where})"
    said = exception_line(traceback) or "an exception"
    return f"rank {rank} stopped too: {said} (whole traceback {where})"


def trained_after(record: dict, since: float) -> bool:
    """Whether a Trainer event shows training went on after ``since`` (``time.time()``): a "log" event the rank
    wrote later (rank 0 and the launcher share a clock). Not a "step": the launcher adds one of its own when the
    job has ended (``last_step``); and not an event read late, written before the traceback."""
    try:
        return record.get("event") == Event.LOG and float(record.get("time") or 0) > since
    except (TypeError, ValueError):
        return False


class HeldTraceback:
    """Holds back a raw traceback that a rank prints, until it is known whether it is the job's end.

    When another rank fails, rank 0 fails in turn (its collective's peer vanished) and prints 30 lines of
    consequent traceback just before the launcher's report of the real cause: printed live, they are what a
    person reads last. So a traceback's text waits here from its first line: ``release()`` gives it back as
    it was where the job went on (a Trainer event came, or it grew past ``HOLD_LIMIT_LINES``: not a dying
    rank's), and when the job ended in a failure the front end folds it to one line (``fold_traceback``).
    Text before it passes at once; a partial line is held only while it could still become a traceback's
    first line.
    """

    def __init__(self):
        self.partial = ""
        self.held: list[str] = []
        self.lines = 0
        self.since = 0.0  # when the held traceback began (time.time())

    def feed(self, text: str) -> str:
        """What may be shown now of ``text``."""
        if self.held:
            self.held.append(text)
            self.lines += text.count("\n")
            return self.release() if self.lines > HOLD_LIMIT_LINES else ""
        buf, self.partial = self.partial + text, ""
        m = _TRACEBACK_IN_STREAM.search(buf)
        if m is not None:
            self.held, self.lines, self.since = [buf[m.start():]], buf.count("\n", m.start()), time.time()
            return buf[: m.start()]
        start = max(buf.rfind("\n"), buf.rfind("\r")) + 1
        if start < len(buf) and _may_become_traceback(buf[start:]):
            self.partial = buf[start:]
            return buf[:start]
        return buf

    def release(self) -> str:
        """The held text, as it was (the job went on: it was output like any other)."""
        text, self.held, self.lines = "".join(self.held) + self.partial, [], 0
        self.partial = ""
        return text

    def take(self) -> str:
        """The held traceback, taken away to be folded (a partial line that was not one is left to release)."""
        text, self.held, self.lines = "".join(self.held), [], 0
        return text


def _may_become_traceback(tail: str) -> bool:
    """Whether a partial line is the start of a traceback's first line (with or without ``[rankN]:``)."""
    if re.fullmatch(r"\[(?:r(?:a(?:n(?:k(?:\d+\]?:?)?)?)?)?)?", tail):  # "[", "[ra", …, "[rank0]:"
        return True
    text = _RANK_PREFIX.sub("", tail)
    if text != tail and not text.strip():  # "[rank0]: "
        return True
    return bool(text) and "Traceback (most recent call last):".startswith(text)


class CarriageReturns:
    """Collapses a stream's carriage-return redraws (tqdm's bars) before they reach a notebook.

    Jupyter front ends draw text that follows ``\\r`` over the current line, so a bar redrawn in place shows
    as one line; but a client that saves outputs as they arrive (nbclient, papermill) keeps every redraw.
    Of the redraws of one line in a chunk only the last is passed on, and a line still being redrawn is
    passed on at most every ``interval_s`` — ``flush()`` gives what is held back. With ``hold_first`` the
    stream's first redraw waits ``interval_s`` too, so a caller can still send it elsewhere meanwhile.
    """

    def __init__(self, interval_s: float = 0.5, clock: Callable[[], float] = time.monotonic,
                 hold_first: bool = False):
        self.interval_s, self.clock, self.hold_first = interval_s, clock, hold_first
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
        if "\r" in tail and self.hold_first and self.last_redraw == -math.inf:
            self.last_redraw = now
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


class Redraws:
    """Passes a stream on less the redraws that would show what the line already shows.

    Each time the Trainer logs, ``tqdm.write`` clears the bar (a redraw of spaces), prints the dict and draws
    the bar again as it was. A terminal shows that as one bar; a file, a pipe or a log viewer that breaks
    lines at ``\\r`` (CI, Kaggle's log, a captured run) as every frame twice with a blank line between. So a
    redraw equal to the last one passed on for the line is dropped, and so is a clearing followed by such a
    repeat; a clearing followed by anything else is kept (a shorter text drawn over the bar needs it). What
    may yet turn out to be one of those waits for what follows (``flush()`` at the end gives it).
    ``forget()`` says the line no longer shows its last redraw (cleared on a terminal): the next is passed on.
    """

    def __init__(self):
        self.shown: str | None = None  # the line's last redraw passed on
        self.pending = ""

    def feed(self, text: str) -> str:
        return self._pass((self.pending + text).replace("\r\n", "\n"), final=False)

    def flush(self) -> str:
        return self._pass(self.pending, final=True)

    def forget(self) -> None:
        self.shown = None

    def _pass(self, text: str, final: bool) -> str:
        self.pending = ""
        pieces = [p for p in re.split(r"(?=[\r\n])", text) if p]
        out, clearing = [], ""
        for i, piece in enumerate(pieces):
            drawn = piece[1:] if piece.startswith("\r") else None
            if drawn is not None:
                unfinished = not final and i == len(pieces) - 1
                if unfinished and (not drawn.strip() or (self.shown or "").startswith(drawn)):
                    self.pending = clearing + piece  # a clearing, a repeat or half of "\r\n": known at its end
                    return "".join(out)
                if not drawn.strip():
                    clearing = clearing or piece  # kept only if something new is drawn after it
                    continue
                if drawn == self.shown:
                    clearing = ""
                    continue
            if clearing:
                out.append(clearing)
                clearing = ""
            out.append(piece)
            self.shown = drawn if drawn is not None else None if piece.startswith("\n") else (self.shown or "") + piece
        if clearing:
            if not final:
                self.pending = clearing
            else:
                out.append(clearing)
        return "".join(out)


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
    training begins); after that they are shown as they come. A library's finished progress bars (a dataset's
    preparation: TRL draws eleven) never push the notebook's own lines out of view: of the last
    ``HELD_LINES``, the shown ones are the newest of the other lines with the newest finished bar.
    """

    def __init__(self, lines: int = 12):
        self.shown = lines
        self.tail: deque[str] = deque(maxlen=max(lines, HELD_LINES))
        self.partial = {"stdout": "", "stderr": ""}
        self.warnings: dict[str, int] = {}
        self.startup: list[str] = []
        self.started = False
        self.path: Path | None = None
        self.total = 0
        self._source_line_next = False
        self.traceback: list[str] | None = None  # the last raw traceback's lines, from its first
        self._traceback_at = 0.0

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
        elif line.startswith("nbddp: ") and not line.startswith("nbddp: warning:") and not self.started:
            self.startup.append(line)  # a warning is never folded away
        else:
            self.tail.append(line)
            if _TRACEBACK.match(line):
                self.traceback, self._traceback_at = [line], time.time()
            elif self.traceback is not None and len(self.traceback) < HOLD_LIMIT_LINES:
                self.traceback.append(line)

    def _warn(self, key: str) -> None:
        if key in self.warnings or len(self.warnings) < MAX_WARNINGS:
            self.warnings[key] = self.warnings.get(key, 0) + 1

    def went_on(self, record: dict) -> None:
        """A Trainer event: where it says training went on after the last traceback, that one was output like
        any other (``trained_after``)."""
        if self.traceback is not None and trained_after(record, self._traceback_at):
            self.traceback = None

    def cut_traceback(self, failure_rank: int | None = 0) -> None:
        """Fold the last raw traceback (all of it, also the lines that have scrolled out of the shown ones) to
        one line (``fold_traceback``): the cell's error shows the failing rank's once, mapped to the cells, and
        rank 0's consequent one is named by its exception."""
        if not self.traceback:
            return
        lines = list(self.tail)
        keep = len(lines) - min(len(lines), len(self.traceback))
        folded = fold_traceback("\n".join(self.traceback), 0, failure_rank, None)
        self.tail = deque([*lines[:keep], folded], maxlen=self.tail.maxlen)
        self.traceback = None

    def lines(self) -> list[str]:
        """The shown lines: the newest of the tail (finished bars but the newest left out first, said in one
        line), then each stream's line still being drawn (a progress bar)."""
        bars = [_shown(p) for p in (self.partial["stdout"], self.partial["stderr"]) if _shown(p).strip()]
        tail = list(self.tail)
        if len(tail) <= self.shown:
            return [*tail, *bars]
        finished = [i for i, line in enumerate(tail) if _FINISHED_BAR.search(line)]
        dropped = set(finished[:-1])
        kept = [i for i in range(len(tail)) if i not in dropped][-self.shown:]
        among = sum(1 for i in dropped if i > kept[0])  # bars left out between the lines shown
        shown = [tail[i] for i in kept]
        if among and len(shown) == self.shown:
            shown = [f"({among} finished progress bars not shown)", *shown[1:]]
        return [*shown, *bars]

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
