"""The records a job leaves in its run directory: their file names, their formats, and how each is read back.

Ranks and torchrun's agent write them; the launcher reads them when the job ends. Both sides import this
module, so a format is spelled once:

- ``error.json`` per failed rank: torch elastic's error file (its path is ``TORCHELASTIC_ERROR_FILE``),
  written by the rank's excepthook, with the global rank and the time to a fraction of a second added;
- ``stacks.txt`` per rank, beside it: a header naming the rank and its pid, then every ``faulthandler`` dump;
- ``failures.json``: every failed rank's exit code or signal, from torch elastic's ``ChildFailedError``
  (``nbddp.agent``);
- ``metrics.jsonl``: rank 0's events, one JSON object a line, each with an ``event`` (``Event``);
- ``last_step``: the last Trainer step completed, overwritten in place at every step.

Imported in every rank: nothing here imports torch, IPython, nbformat or libcst.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Iterator, NamedTuple

#: torch elastic's per-rank error file, in ``<log dir>/<run id>/attempt_N/<local rank>/``.
ERROR_FILE = "error.json"
#: Each rank's stack dumps, beside its error file.
STACKS_FILE = "stacks.txt"
#: The agent's record of how each failed rank ended, in the run directory.
FAILURES_FILE = "failures.json"
#: Rank 0's events, in the run directory (``NBDDP_METRICS`` names it for the ranks).
METRICS_FILE = "metrics.jsonl"
#: The last completed step, beside the metrics file.
LAST_STEP_FILE = "last_step"
#: Lines for the person following the job that come from outside it (another job writing the same folder),
#: in the run directory; the launcher passes each on as it comes (``append_notice``).
NOTICES_FILE = "notices.txt"


def append_notice(run_dir: str | os.PathLike, line: str) -> None:
    """Add one line to a job's ``NOTICES_FILE``, in one append (lines of two writers never interleave)."""
    append_line(os.path.join(run_dir, NOTICES_FILE), line, mode=0o600)


# --- writes that never end a training -----------------------------------------------------------------------

#: Paths (or stream names) a write to failed in this process: each is warned about once.
_DROPPED: dict[str, str] = {}


def append_line(path: str | os.PathLike, line: str, mode: int = 0o644) -> bool:
    """Append one line to a record file in one write; False where it could not be written (a full disk, a
    deleted folder): the line is dropped, with one warning per file (``dropped_write``), and nothing is raised.
    A line the disk took only part of is cut back off, so a reader never meets half a line."""
    data = (line.rstrip("\n") + "\n").encode("utf-8", "replace")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, mode)
    except OSError as exc:
        dropped_write(str(path), exc)
        return False
    size = None
    try:
        size = os.fstat(fd).st_size
        if os.write(fd, data) < len(data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # the disk took part of it: it is full
        return True
    except OSError as exc:
        if size is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, size)
        dropped_write(str(path), exc)
        return False
    finally:
        os.close(fd)


def dropped_write(path: str, exc: OSError, warn: bool = True) -> None:
    """Note that a write to ``path`` failed; the first time for that path, say so on stderr (``warn``), where
    that can be written. nbddp's bookkeeping is a help to the job, never a reason to end it."""
    if path in _DROPPED:
        return
    _DROPPED[path] = exc.strerror or str(exc)
    if warn:
        with contextlib.suppress(Exception):
            print(f"nbddp: warning: cannot write {path} ({_DROPPED[path]}): nbddp drops what it writes there, and "
                  "the training goes on", file=sys.stderr, flush=True)


def dropped() -> dict[str, str]:
    """Each path a write to failed in this process, with why (the first failure)."""
    return dict(_DROPPED)


class Event:
    """The ``event`` of a line of ``metrics.jsonl``."""

    BEGIN = "begin"  # a Trainer starts training; carries its ``output_dir``
    STEP = "step"  # a step ended (written at most every ``metrics.STEP_INTERVAL_S``)
    LOG = "log"  # the Trainer logged (loss, learning rate, …)
    END = "end"  # the Trainer's training ended
    DISPLAY = "display"  # rank 0 displayed a rich object: its MIME bundle


# --- error.json -----------------------------------------------------------------------------------------


def error_record(exc_type, exc, tb, rank: int, now: float | None = None) -> dict:
    """torch elastic's error record of an exception; beyond torch's fields, ``extraInfo`` carries the global
    ``rank`` (the file's folder only names the local rank) and ``time`` in fractions of a second, which orders
    failures that fall within one second."""
    import traceback

    now = time.time() if now is None else now
    return {
        "message": {
            "message": exception_text(exc_type, exc),
            "extraInfo": {
                "py_callstack": "".join(traceback.format_exception(exc_type, exc, tb)),
                "timestamp": str(int(now)),
                "time": now,
                "rank": rank,
            },
        }
    }


#: What an exception raised without a text is, said instead of nothing (``MemoryError()`` carries none).
OUT_OF_MEMORY = ("out of memory: this process could not allocate more of the machine's memory (RAM, not a GPU's); "
                 "each rank holds its own copy of the model and of what the notebook loads, so fewer processes "
                 "(--nproc), a smaller batch or a dataset streamed rather than loaded whole needs less")


def exception_text(exc_type, exc) -> str:
    """``Type: text`` of an exception, for a message; one raised without a text is said for what it is."""
    text = str(exc).strip()
    if not text and issubclass(exc_type, MemoryError):
        text = OUT_OF_MEMORY
    return f"{exc_type.__name__}: {text}" if text else exc_type.__name__


class RankError(NamedTuple):
    """What a rank's ``error.json`` says: which global rank raised what, when, and its traceback."""

    rank: int
    time: float
    message: str
    callstack: str


def read_error(path: Path) -> RankError | None:
    """A rank's ``error.json`` (ours or one torch wrote itself); None when it cannot be read.

    A file without our ``rank`` is taken as the rank its folder names; torch writes a plain string message
    for some failures, and only a whole second.
    """
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    msg = data.get("message", {})
    if isinstance(msg, str):
        msg = {"message": msg, "extraInfo": {}}
    info = msg.get("extraInfo", {})
    return RankError(
        rank=int(info.get("rank", Path(path).parent.name)),
        time=float(info.get("time") or info.get("timestamp") or 0),
        message=msg.get("message", ""),
        callstack=info.get("py_callstack", ""),
    )


# --- stacks.txt -----------------------------------------------------------------------------------------


class StacksHeader(NamedTuple):
    rank: int
    pid: int


def stacks_header(rank: int, pid: int) -> str:
    """The first line of a rank's ``stacks.txt``: the launcher finds the rank and the pid to signal there."""
    return f"nbddp: stacks of rank {rank} (pid {pid})\n"


_HEADER = re.compile(r"nbddp: stacks of rank (\d+) \(pid (\d+)\)")


def read_stacks_file(path: Path) -> tuple[StacksHeader | None, str]:
    """A ``stacks.txt``: its header (None when it has none) and the dumps below it ("" while none is written).

    Raises ``OSError`` when the file cannot be read.
    """
    header, _, dumps = Path(path).read_text(errors="replace").partition("\n")
    m = _HEADER.search(header)
    return (StacksHeader(int(m.group(1)), int(m.group(2))) if m else None), dumps


class StacksFile(NamedTuple):
    """One rank's ``stacks.txt`` as read: where it is, its header (None when it has none), its dumps."""

    path: Path
    header: StacksHeader | None
    dumps: str


def read_stacks_files(paths: Iterable[Path]) -> Iterator[StacksFile]:
    """Each of ``paths`` that can be read, as ``read_stacks_file`` reads it; one that cannot (a rank gone
    with its folder, a file not yet made) is passed over."""
    for path in paths:
        try:
            header, dumps = read_stacks_file(path)
        except OSError:
            continue
        yield StacksFile(Path(path), header, dumps)


# --- failures.json --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RankExit:
    """How one failed rank ended, as torch elastic's ``ProcessFailure`` says: a negative ``exitcode`` is the
    signal that killed it; ``timestamp`` is whole seconds, when the agent noticed."""

    rank: int
    exitcode: int
    timestamp: int
    local_rank: int | None = None
    pid: int | None = None
    signal: str | None = None
    error_file: str | None = None


def failures_record(root_rank: int, exits: Iterable[RankExit]) -> dict:
    """``failures.json``'s content: torch elastic's root cause and every failed rank."""
    return {"root_rank": int(root_rank), "failures": [asdict(e) for e in exits]}


def read_failures(path: Path | None) -> list[RankExit]:
    """Every failed rank of ``failures.json``; none when there is no such file or it cannot be read."""
    if path is None:
        return []
    try:
        entries = json.loads(Path(path).read_text()).get("failures", [])
        return [RankExit(rank=e["rank"], exitcode=e["exitcode"], timestamp=e["timestamp"],
                         local_rank=e.get("local_rank"), pid=e.get("pid"), signal=e.get("signal"),
                         error_file=e.get("error_file")) for e in entries]
    except (OSError, ValueError, AttributeError, KeyError, TypeError):
        return []


# --- last_step ------------------------------------------------------------------------------------------


def last_step_path(metrics_path: str | os.PathLike) -> str:
    """The file holding ``"<step> <max_steps>"`` of the last completed step, beside the metrics file."""
    return os.path.join(os.path.dirname(os.fspath(metrics_path)), LAST_STEP_FILE)


def write_last_step(fd: int, step: int, max_steps: int) -> None:
    """One ``pwrite``, same width each time: the file always holds one whole record."""
    os.pwrite(fd, b"%20d %20d\n" % (step, max_steps or 0), 0)


def read_last_step(metrics_path: str | os.PathLike) -> tuple[int, int] | None:
    """``(step, max_steps)`` from ``last_step_path``, or None when there is none (no Trainer ran)."""
    try:
        with open(last_step_path(metrics_path), "rb") as fh:
            step, total = fh.read().split()[:2]
        return int(step), int(total)
    except (OSError, ValueError):
        return None
