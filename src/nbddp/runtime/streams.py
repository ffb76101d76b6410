"""A rank's printed output never ends its training: a write the disk refuses is dropped.

torchrun sends each rank's stdout and stderr to files in the run directory (``--redirects``). When that disk
fills, the next ``print`` (the Trainer's log line, a progress bar) raises ``OSError: [Errno 28] No space left on
device`` inside the training, and a run at its last step dies before it saves what it trained; at exit, Python's
final flush would fail the process too. ``install()`` puts each standard stream that is a file over a raw layer
that drops what the disk refuses (``Dropping``), so the text layer never sees the error; output comes through
again once there is room. The launcher says, at the job's end, which folder was full
(``launch.postmortem.full_disk``): a warning written from here would only be dropped too.
"""

from __future__ import annotations

import io
import os
import stat
import sys

from .records import dropped_write


class Dropping(io.RawIOBase):
    """A descriptor's raw writes, each refused one (a full disk, a quota) dropped as if written."""

    def __init__(self, fd: int, name: str):
        super().__init__()
        self._fd, self.name = fd, name

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._fd

    def isatty(self) -> bool:
        return False

    def write(self, data) -> int:
        """All of ``data`` written (a short write is followed up, as a text layer over a raw one expects), or
        the rest of it dropped where the disk refuses it."""
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            try:
                done += os.write(self._fd, view[done:])
            except OSError as exc:
                dropped_write(self.name, exc, warn=False)  # a warning would go through this very stream
                break
        return len(view)

    def close(self) -> None:  # the descriptor stays open: it is the process's stdout or stderr
        super().close()


def install() -> list[str]:
    """sys.stdout and sys.stderr, where each is a file, over ``Dropping``; the names of those put over it."""
    done = []
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        replaced = _tolerant(stream, f"<{name}>")
        if replaced is not None:
            setattr(sys, name, replaced)
            if getattr(sys, f"__{name}__") is stream:
                setattr(sys, f"__{name}__", replaced)
            _kept.append(stream)  # the old object is not collected: its closing would flush into the error again
            done.append(name)
    return done


#: The streams replaced, kept alive.
_kept: list = []


def _tolerant(stream, name: str):
    """A text stream like ``stream`` writing to the same descriptor through ``Dropping``; None where ``stream``
    is no file on disk (a terminal, a pipe: no disk to fill) or is already one of these."""
    try:
        fd = stream.fileno()
        if not stat.S_ISREG(os.fstat(fd).st_mode) or isinstance(getattr(stream.buffer, "raw", None), Dropping):
            return None
        stream.flush()
    except (AttributeError, OSError, ValueError):  # replaced by something without a descriptor, closed
        return None
    raw = Dropping(fd, name)
    unbuffered = not isinstance(stream.buffer, io.BufferedWriter)  # python -u: writes go straight through
    return io.TextIOWrapper(raw if unbuffered else io.BufferedWriter(raw), encoding=stream.encoding,
                            errors=stream.errors, line_buffering=stream.line_buffering,
                            write_through=stream.write_through or unbuffered)
