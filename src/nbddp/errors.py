"""Typed errors. Each carries what a person needs to find the problem: the notebook, cell and line."""

from __future__ import annotations

import unicodedata


def printable(text: str) -> str:
    """``text`` with its control characters written as escapes (``\\x00``), tabs and newlines kept: a message
    quoting a notebook's bytes must not print a NUL, a carriage return that hides the line, or a terminal's
    escape sequence, nor break the comment a script's header makes of it."""
    return "".join(c if c in "\t\n" or unicodedata.category(c) not in ("Cc", "Cs") else repr(c)[1:-1] for c in text)


class NbddpError(Exception):
    """Base class: the message is meant for the user, printed as is, with no nbddp traceback."""

    def _render_traceback_(self) -> list[str]:
        """What IPython shows for this error in a cell: the message alone, not nbddp's frames."""
        return [f"{type(self).__name__}: {self}"]


class NotebookError(NbddpError):
    """The notebook file cannot be read: missing, not JSON, not a valid notebook, wrong encoding."""


class CellError(NbddpError):
    """A cell cannot be converted. ``cell`` is 1-based among all the notebook's cells, like the UI."""

    def __init__(self, message: str, *, cell: int, line: int | None = None, source: str = ""):
        self.cell, self.line, self.source = cell, line, source
        where = f"cell {cell}" + (f", line {line}" if line else "")
        detail = f"\n    {printable(source.strip())}" if source.strip() else ""
        super().__init__(f"{where}: {printable(message)}{detail}")


class LaunchError(NbddpError):
    """torchrun could not be started, or an install step before launch failed."""


class SecretError(CellError):
    """A notebook cell holds what looks like a hard-coded credential; exporting it would publish it."""


class JobFailed(NbddpError):
    """A job started from a notebook ended badly. ``report`` is what the cell shows: the failing rank's
    traceback mapped to the notebook's cells, or why torchrun stopped."""

    def __init__(self, message: str, report: str = ""):
        super().__init__(message)
        self.report = report

    def _render_traceback_(self) -> list[str]:
        return [*self.report.rstrip().splitlines(), f"{type(self).__name__}: {self}"]


class JobInterrupted(NbddpError):
    """The user interrupted a job started from a notebook; every process of it has been stopped."""
