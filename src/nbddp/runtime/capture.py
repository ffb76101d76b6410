"""A ``%%capture`` cell in a rank: its printed output is kept from the console, as the kernel keeps it.

The script calls ``begin()`` before the cell's code and ``end()`` after it (``out = end()`` for
``%%capture out``). An exception inside the cell ends the capture first, so its traceback is seen.
"""

from __future__ import annotations

import io
import shlex
import sys
from dataclasses import dataclass

_saved: tuple | None = None
_buffers: tuple[io.StringIO, io.StringIO] | None = None


@dataclass
class Captured:
    """What ``%%capture NAME`` holds afterwards: the cell's text output (IPython's ``CapturedIO``, less rich
    output)."""

    stdout: str
    stderr: str

    def show(self) -> None:
        sys.stdout.write(self.stdout)
        sys.stderr.write(self.stderr)

    __call__ = show


def begin(arguments: str = "") -> None:
    """Send ``sys.stdout`` and ``sys.stderr`` (not with ``--no-stdout``/``--no-stderr``) to buffers."""
    global _saved, _buffers
    end()
    options = shlex.split(arguments)
    _saved = (sys.stdout, sys.stderr, sys.excepthook)
    _buffers = (io.StringIO(), io.StringIO())
    sys.stdout.flush()
    sys.stderr.flush()
    if "--no-stdout" not in options:
        sys.stdout = _buffers[0]
    if "--no-stderr" not in options:
        sys.stderr = _buffers[1]
    previous = sys.excepthook

    def hook(*exc_info):
        end()
        previous(*exc_info)

    sys.excepthook = hook


def end() -> Captured:
    """Put the streams back; what the cell printed."""
    global _saved, _buffers
    if _saved is None:
        return Captured("", "")
    sys.stdout, sys.stderr, sys.excepthook = _saved
    out = Captured(_buffers[0].getvalue(), _buffers[1].getvalue())
    _saved = _buffers = None
    return out
