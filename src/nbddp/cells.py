"""Where a job's cells come from: a notebook file read with nbformat, sources handed over directly, or —
for a job started from a kernel — the cells ``%%ddp_setup`` registered, the notebook file above the magic
cell, or the kernel's input history."""

from __future__ import annotations

import json
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

import nbformat
from nbformat.warnings import MissingIDFieldWarning

from .errors import NbddpError, NotebookError

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
    repaired to read it.

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
    return notebook_cells(nb, origin=str(path)), notes


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


#: Where a ``%%ddp_train`` job's cells can come from, in the order ``auto`` tries them.
SOURCES = ("registered", "notebook", "history")

#: nbddp's own line magics, which have no place in a training script.
_NBDDP_LINE = re.compile(r"^\s*%(?:ddp_\w+|(?:re)?load_ext\s+nbddp\b)")


@dataclass(frozen=True)
class Selection:
    """The cells of a job started from a kernel, and where they came from.

    ``numbering`` says what ``Cell.index`` counts: ``"notebook"``, the position among the notebook's cells,
    or ``"execution"``, the kernel's execution count shown beside a cell as ``[N]``.
    """

    cells: tuple[Cell, ...]
    source: str
    origin: str
    numbering: str = "notebook"
    notes: tuple[str, ...] = ()

    def label(self, index: int | None) -> str:
        return f"In [{index}]" if self.numbering == "execution" else f"cell {index}"

    def describe(self) -> str:
        """One line a person checks before training: which cells, from where."""
        taken = ", ".join(self.label(c.index) for c in self.cells)
        if self.source == "registered":  # the last one is the magic's own cell, not a %%ddp_setup cell
            setup = len(self.cells) - 1
            return f"nbddp: {setup} cell{'s' * (setup != 1)} from {self.origin} ({self.source}) and this cell: {taken}"
        return f"nbddp: {len(self.cells)} cells from {self.origin} ({self.source}): {taken}"


def split_cell_magic(source: str) -> tuple[str, str, str] | None:
    """``(name, arguments, body)`` when ``source`` starts with a ``%%name arguments`` line, else None."""
    lines = source.splitlines()
    first = next((i for i, ln in enumerate(lines) if ln.strip()), None)
    if first is None or not lines[first].lstrip().startswith("%%"):
        return None
    name, _, args = lines[first].strip()[2:].partition(" ")
    return name, args.strip(), "\n".join(lines[first + 1 :])


def job_source(source: str) -> str | None:
    """A cell's source as a job takes it, or None for a cell that belongs to no job.

    ``%%ddp_train`` cells are other jobs and are left out. The ``%%ddp_setup`` line and nbddp's own line
    magics (``%load_ext nbddp``, ``%ddp_doctor``, …) become comments, so every other line keeps its number.
    """
    magic = split_cell_magic(source)
    if magic and magic[0] == "ddp_train":
        return None
    setup = bool(magic and magic[0] == "ddp_setup")
    out = []
    for text in source.splitlines():
        if _NBDDP_LINE.match(text) or (setup and text.lstrip().startswith("%%ddp_setup")):
            text = "# " + text.strip()
        out.append(text)
    if not any(ln.strip() and not ln.lstrip().startswith("#") for ln in out):
        return None
    return "\n".join(out)


def train_cell(index: int, args: str, body: str, origin: str) -> Cell:
    """The ``%%ddp_train`` cell itself: its header becomes a comment, so body lines keep their numbers."""
    return Cell(index=index, source=f"# %%ddp_train {args}".rstrip() + "\n" + body, origin=origin)


class Registry:
    """The cells ``%%ddp_setup`` registered in this kernel, in the order they were first run.

    Running a cell again replaces what it registered before, in its place: the cell is known by the front
    end's cell id where one is sent, else by its source.
    """

    def __init__(self) -> None:
        self._cells: dict[str, Cell] = {}

    def add(self, source: str, execution_count: int, cell_id: str | None = None) -> Cell | None:
        code = job_source(source)
        if code is None:
            return None
        cell = Cell(index=execution_count, source=code, origin="In")
        self._cells[f"id:{cell_id}" if cell_id else f"source:{code}"] = cell
        return cell

    def clear(self) -> None:
        self._cells.clear()

    @property
    def cells(self) -> tuple[Cell, ...]:
        return tuple(self._cells.values())

    def __len__(self) -> int:
        return len(self._cells)

    def describe(self) -> str:
        """How many cells are registered, and each one's ``[N]`` and first line of code."""
        lines = [f"nbddp: {len(self)} cell(s) registered for the job"]
        for c in self.cells:
            code = next((ln.strip() for ln in c.source.splitlines() if ln.strip() and not ln.lstrip().startswith("#")), "")
            lines.append(f"  In [{c.index}]: {code}")
        return "\n".join(lines)


def find_notebook(user_ns: Mapping, environ: Mapping, cwd: str | Path) -> Path | None:
    """The notebook file the kernel runs, where the front end tells: VS Code's ``__vsc_ipynb_file__``,
    papermill's ``PAPERMILL_INPUT_PATH``, Jupyter's ``__session__``/``JPY_SESSION_NAME`` (a path relative to
    the server's root, while the kernel starts in the notebook's folder)."""
    cwd = Path(cwd)
    candidates = (
        user_ns.get("__vsc_ipynb_file__"),
        user_ns.get("PAPERMILL_INPUT_PATH"),
        environ.get("PAPERMILL_INPUT_PATH"),
        user_ns.get("__session__"),
        environ.get("JPY_SESSION_NAME"),
    )
    for value in candidates:
        if not isinstance(value, str) or not value.endswith(".ipynb"):
            continue
        path = Path(value).expanduser()
        for candidate in [path] if path.is_absolute() else [cwd / path, cwd / path.name]:
            if candidate.is_file():
                return candidate.resolve()
    return None


def cells_above(path: str | Path, args: str, body: str) -> Selection | None:
    """The code cells of the saved notebook above the ``%%ddp_train`` cell whose body is ``body``, plus that
    cell; None when the saved file holds no such cell (not saved since the cell was edited)."""
    path = Path(path)
    cells = read_notebook(path)
    at = None
    for pos, cell in enumerate(cells):
        magic = split_cell_magic(cell.source)
        if magic and magic[0] == "ddp_train" and magic[2].rstrip() == body.rstrip():
            at = pos
    if at is None:
        return None
    taken = [Cell(c.index, src, c.origin) for c in cells[:at] if (src := job_source(c.source)) is not None]
    here = train_cell(cells[at].index, args, body, str(path))
    return Selection(cells=(*taken, here), source="notebook", origin=path.name)


def cells_from_history(inputs: Sequence[str], args: str, body: str) -> Selection:
    """The kernel's history: ``inputs[n]`` is ``In[n]``, the last one the running ``%%ddp_train`` cell.

    Cells run more than once with the same source are taken once, at their first run.
    """
    current = len(inputs) - 1
    taken, seen, repeated = [], set(), 0
    for n in range(1, current):
        src = job_source(inputs[n])
        if src is None:
            continue
        if src in seen:
            repeated += 1
            continue
        seen.add(src)
        taken.append(Cell(n, src, "In"))
    notes = (f"{repeated} cell(s) run again with the same code were taken once",) if repeated else ()
    here = train_cell(current, args, body, "In")
    return Selection((*taken, here), source="history", origin="the kernel's history", numbering="execution", notes=notes)


def select_cells(
    args: str,
    body: str,
    *,
    source: str = "auto",
    registered: Sequence[Cell] = (),
    notebook: str | Path | None = None,
    history: Sequence[str] = (),
) -> Selection:
    """The cells of a ``%%ddp_train`` job: ``registered`` cells if any, else the ``notebook`` file above the
    magic cell, else the kernel's ``history`` (``In``). ``source`` forces one of them.

    Raises ``NbddpError`` when the forced source has nothing to give.
    """
    if source not in ("auto", *SOURCES):
        raise NbddpError(f"--source must be one of auto, {', '.join(SOURCES)}; got {source!r}")
    current = max(len(history) - 1, 0)
    if source == "registered" or (source == "auto" and registered):
        if not registered:
            raise NbddpError("no cells registered: mark the cells of the job with %%ddp_setup first")
        here = train_cell(current, args, body, "In")
        return Selection((*registered, here), source="registered", origin="%%ddp_setup cells", numbering="execution")
    notes: tuple[str, ...] = ()
    if source in ("auto", "notebook"):
        if notebook is None:
            reason = "the kernel does not say which notebook file it runs"
        else:
            found = cells_above(notebook, args, body)
            if found is not None:
                return found
            reason = f"{Path(notebook).name} on disk does not hold this cell as it is now (save the notebook)"
        if source == "notebook":
            raise NbddpError(f"cannot take the cells from the notebook file: {reason}")
        notes = (f"{reason}; the kernel's history is used",)
    selection = cells_from_history(history, args, body)
    return Selection(selection.cells, selection.source, selection.origin, selection.numbering, notes + selection.notes)
