"""Where a job's cells come from: a notebook file read with nbformat, or sources handed over directly. A job
started from a kernel selects its cells in ``selection.py`` (what a selection is, ``%%ddp_setup``'s registry, the
notebook file the kernel runs) and ``kernel_cells.py`` (the saved notebook's cells as the kernel ran them, or the
kernel's history; ``executions.py`` records what the kernel ran)."""

from __future__ import annotations

import json
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

from .notebook_format import nbformat  # first: any nbformat import loads jsonschema, which it loads lazily

from nbformat.warnings import MissingIDFieldWarning  # noqa: E402

from .errors import NotebookError

#: Cells carrying this tag are never part of a job: a template's launch cell, a plot, a note to self.
SKIP_TAG = "nbddp-skip"


@dataclass(frozen=True)
class Cell:
    """One code cell. ``index`` is its 1-based position among all the notebook's cells, as a person counts."""

    index: int
    source: str
    origin: str = "<cells>"


def read_notebook(path: str | Path) -> list[Cell]:
    """The code cells of the notebook at ``path``, less those tagged ``nbddp-skip`` (see ``load_notebook``)."""
    return load_notebook(path)[0]


def load_notebook(path: str | Path) -> tuple[list[Cell], tuple[str, ...]]:
    """The code cells of the notebook at ``path``, less those tagged ``nbddp-skip``, and notes on what was
    repaired to read it (see ``read_nbformat``). A Python script (``.py``) is read as cells too
    (``script_cells``), so ``nbddp run train.py`` takes a script as it takes a notebook."""
    if Path(path).suffix == ".py":
        return script_cells(path), ()
    nb, notes = read_nbformat(path)
    return notebook_cells(nb, origin=str(path)), notes


#: A cell marker of the percent format (VS Code, Spyder, jupytext): ``# %%`` starts a cell.
_PERCENT = re.compile(r"^# ?%%(?!%)")


def script_cells(path: str | Path) -> list[Cell]:
    """A Python script's cells: the parts between ``# %%`` markers where it has them (markdown parts,
    ``# %% [markdown]``, left out but counted, as a notebook counts its cells), else the whole file as one
    cell, so a failure maps to the script's own line where the file is one cell."""
    path = Path(path)
    try:
        text = path.read_bytes().decode("utf-8-sig")
    except FileNotFoundError:
        raise NotebookError(f"{path}: no such script") from None
    except OSError as exc:
        raise NotebookError(f"{path}: cannot read: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise NotebookError(f"{path}: not UTF-8 (byte {exc.start}); save the script as UTF-8") from None
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if _PERCENT.match(line)]
    if not starts:
        return [Cell(1, text, str(path))]
    parts = ([lines[: starts[0]]] if "\n".join(lines[: starts[0]]).strip() else []) + [
        lines[a:b] for a, b in zip(starts, starts[1:] + [len(lines)])
    ]
    cells = []
    for index, part in enumerate(parts, start=1):
        if part and _PERCENT.match(part[0]) and "[markdown]" in part[0]:
            continue
        body = part[1:] if part and _PERCENT.match(part[0]) else part
        cells.append(Cell(index, "\n".join(body), str(path)))
    return cells


def read_nbformat(path: str | Path) -> tuple[nbformat.NotebookNode, tuple[str, ...]]:
    """The notebook at ``path`` as nbformat reads it, and notes on what was repaired to read it.

    What Jupyter opens is read: a notebook that fails nbformat's schema is upgraded and normalised as nbformat
    can (``repair``), with a note. Raises ``NotebookError`` with a one-line reason for a missing file, bad
    encoding, invalid JSON, or a file with no cells Jupyter could show.
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
    invalid: dict = {}  # nbformat validates while it reads; asked again it would validate twice
    try:
        with warnings.catch_warnings():  # cells without ids get them, as Jupyter gives them, without a word
            warnings.simplefilter("ignore", MissingIDFieldWarning)
            nb = nbformat.reads(text, as_version=4, capture_validation_error=invalid)
    except nbformat.reader.NotJSONError as exc:
        bad = exc.__cause__
        where = f"line {bad.lineno}, column {bad.colno}: {bad.msg}" if isinstance(bad, json.JSONDecodeError) else exc
        raise NotebookError(f"{path}: not valid JSON ({where})") from None
    except Exception as exc:  # nbformat raises several types for structurally wrong files
        raise NotebookError(f"{path}: not a notebook: {exc}") from None
    notes: tuple[str, ...] = ()
    if "ValidationError" in invalid:
        nb, notes = repair(nb, invalid["ValidationError"], path)
    return nb, notes


def repair(nb: nbformat.NotebookNode, error, path: Path) -> tuple[nbformat.NotebookNode, tuple[str, ...]]:
    """A notebook that fails nbformat's schema, made valid where nbformat can, and what was done.

    Cell ids under ``nbformat_minor`` < 5 are what nbformat's v4 upgrade adds: the notebook becomes 4.5,
    keeping the ids it has. Unknown keys and metadata are dropped (``nbformat.validator.normalize``).
    Whatever is still invalid is noted; only a notebook without readable code cells is refused, as Jupyter
    shows nothing of it either.
    """
    from nbformat.v4.nbbase import random_cell_id

    cells = nb.get("cells")
    if not isinstance(cells, list) or not all(isinstance(c, dict) and "cell_type" in c for c in cells):
        raise NotebookError(f"{path}: invalid notebook: {error.message}")
    done = []
    if nb.get("nbformat_minor", 0) < 5 and any("id" in c for c in cells):
        for cell in cells:
            cell.setdefault("id", random_cell_id())
        nb.nbformat_minor = 5
        done.append("cell ids: read as nbformat 4.5")
    _, fixed = nbformat.validator.normalize(nb, 4, nb.nbformat_minor, relax_add_props=True, strip_invalid_metadata=True)
    nb = nbformat.from_dict(fixed)
    if any(not isinstance(c.get("source", ""), str) for c in nb.cells):
        raise NotebookError(f"{path}: invalid notebook: {error.message}")
    still = next(nbformat.validator.iter_validate(nb), None)
    if still is not None:
        done.append(f"still {still.message}")
    note = f"{path.name} is not valid nbformat ({error.message}); read as Jupyter reads it"
    return nb, (note + (f" ({'; '.join(done)})" if done else ""),)


def notebook_cells(nb: nbformat.NotebookNode, origin: str = "<notebook>") -> list[Cell]:
    """The code cells of a notebook already in memory, less those tagged ``nbddp-skip``."""
    return [
        Cell(index=i, source=cell.get("source", ""), origin=origin)
        for i, cell in enumerate(nb.cells, start=1)
        if cell.cell_type == "code" and SKIP_TAG not in cell.get("metadata", {}).get("tags", [])
    ]


def cells_from_sources(sources: list[str], origin: str = "<cells>") -> list[Cell]:
    """Cells from plain source strings, numbered 1, 2, …"""
    return [Cell(index=i, source=src, origin=origin) for i, src in enumerate(sources, start=1)]

