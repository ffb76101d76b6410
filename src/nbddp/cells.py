"""Where a job's cells come from: a notebook file read with nbformat, or sources handed over directly."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import nbformat

from .errors import NotebookError

#: Cells carrying this tag are never part of a job: a template's launch cell, a plot, a note to self.
SKIP_TAG = "nbddp-skip"


@dataclass(frozen=True)
class Cell:
    """One code cell. ``index`` is its 1-based position among all the notebook's cells, as a person counts."""

    index: int
    source: str
    origin: str = "<cells>"

    @property
    def first_line(self) -> str:
        return next((ln.strip() for ln in self.source.splitlines() if ln.strip()), "")


def read_notebook(path: str | Path) -> list[Cell]:
    """The code cells of the notebook at ``path``, validated by nbformat, less those tagged ``nbddp-skip``.

    Raises ``NotebookError`` with a one-line reason for a missing file, bad encoding, invalid JSON or a
    notebook that fails nbformat's schema.
    """
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise NotebookError(f"{path}: no such notebook") from None
    except OSError as exc:
        raise NotebookError(f"{path}: cannot read: {exc.strerror}") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise NotebookError(f"{path}: not UTF-8 (byte {exc.start}); save the notebook as UTF-8") from None
    try:
        json.loads(text)
    except json.JSONDecodeError as exc:
        raise NotebookError(f"{path}: not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})") from None
    try:
        nb = nbformat.reads(text, as_version=4)
    except Exception as exc:  # nbformat raises several types for structurally wrong files
        raise NotebookError(f"{path}: not a notebook: {exc}") from None
    try:
        nbformat.validate(nb)
    except nbformat.ValidationError as exc:
        raise NotebookError(f"{path}: invalid notebook: {exc.message}") from None
    return notebook_cells(nb, origin=str(path))


def notebook_cells(nb: nbformat.NotebookNode, origin: str = "<notebook>") -> list[Cell]:
    """The code cells of a notebook already in memory, less those tagged ``nbddp-skip``."""
    return [
        Cell(index=i, source=cell.source, origin=origin)
        for i, cell in enumerate(nb.cells, start=1)
        if cell.cell_type == "code" and SKIP_TAG not in cell.metadata.get("tags", [])
    ]


def cells_from_sources(sources: list[str], origin: str = "<cells>") -> list[Cell]:
    """Cells from plain source strings, numbered 1, 2, …"""
    return [Cell(index=i, source=src, origin=origin) for i, src in enumerate(sources, start=1)]
