"""A job started from a kernel: the ``Selection`` of its cells and where each cell's code came from (``Origin``),
the ``%%ddp_train``/``%%ddp_setup`` cell magics read, ``%%ddp_setup``'s ``Registry``, and the notebook file the
kernel runs (``find_notebook``, ``notebook_holding``, ``vscode_notebook``). ``kernel_cells.py`` makes the
selection."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from .cells import Cell, read_nbformat
from .errors import NotebookError


#: Where a ``%%ddp_train`` job's cells can come from, in the order ``auto`` tries them.
SOURCES = ("registered", "notebook", "history")

#: nbddp's own line magics, which have no place in a training script.
_NBDDP_LINE = re.compile(r"^\s*%(?:ddp_\w+|(?:re|un)?load_ext\s+nbddp\b)")


#: Where one cell's code came from (``Origin.how``), and how ``--dry-run`` says it.
REGISTERED, RAN, EDITED, SAVED = "registered", "ran", "edited", "saved"
FAILED, REPLACED, THIS = "failed", "replaced", "this"
_SAID = {
    REGISTERED: "registered with %%ddp_setup",
    RAN: "as run here",
    EDITED: "as run here, not as saved",
    SAVED: "the saved file (not run in this kernel)",
    FAILED: "left out: it raised here",
    REPLACED: "left out: the same cell ran again since",
    THIS: "this %%ddp_train cell, as it runs",
}


@dataclass(frozen=True)
class Origin:
    """Where the code of one cell came from, or why a cell the kernel ran was left out: ``how`` is one of
    ``REGISTERED`` … ``THIS``; ``run`` is the kernel's ``In [N]`` whose code was taken, or that raised."""

    index: int
    how: str
    run: int | None = None


@dataclass(frozen=True)
class Selection:
    """The cells of a job started from a kernel, and where they came from.

    ``numbering`` says what ``Cell.index`` counts: ``"notebook"``, the position among the notebook's cells,
    or ``"execution"``, the kernel's execution count shown beside a cell as ``[N]``. ``origins`` says where
    each cell's code came from, in order, with the cells left out.
    """

    cells: tuple[Cell, ...]
    source: str
    origin: str
    numbering: str = "notebook"
    notes: tuple[str, ...] = ()
    origins: tuple[Origin, ...] = ()
    warnings: tuple[str, ...] = ()

    def label(self, index: int | None) -> str:
        return f"In [{index}]" if self.numbering == "execution" else f"cell {index}"

    def describe(self) -> str:
        """One line a person checks before training: which cells, from where."""
        taken = ", ".join(self.label(c.index) for c in self.cells)
        if self.source == "registered":  # the last one is the magic's own cell, not a %%ddp_setup cell
            setup = len(self.cells) - 1
            return f"nbddp: {setup} cell{'s' * (setup != 1)} from {self.origin} ({self.source}) and this cell: {taken}"
        return f"nbddp: {len(self.cells)} cells from {self.origin} ({self.source}): {taken}{self._where_from()}"

    def _where_from(self) -> str:
        """Where the code came from, compactly: ' · as run here: 2, 3 (not as saved: 3) · saved file: 4 · …'."""
        def numbers(*hows: str) -> str:
            picked = [o.index for o in self.origins if o.how in hows]
            return ", ".join(str(i) if self.numbering == "notebook" else self.label(i) for i in picked)

        parts = []
        if self.source == "notebook" and numbers(RAN, EDITED):
            edited = numbers(EDITED)
            parts.append(f"as run here: {numbers(RAN, EDITED)}" + (f" (not as saved: {edited})" if edited else ""))
        if numbers(SAVED):
            parts.append(f"saved file: {numbers(SAVED)}")
        if numbers(FAILED):
            parts.append(f"left out, raised here: {numbers(FAILED)}")
        return "".join(f" · {part}" for part in parts)

    def report(self, per_cell: bool = False) -> str:
        """What ``%%ddp_train`` prints before converting: the line, the notes, the warnings, and with
        ``per_cell`` (``--dry-run``) where each cell's code comes from."""
        lines = [self.describe(), *(f"nbddp: note: {n}" for n in self.notes),
                 *(f"nbddp: warning: {w}" for w in self.warnings)]
        if per_cell and self.origins:
            lines.append("nbddp: where each cell's code comes from:")
            for o in self.origins:
                run = f" (In [{o.run}])" if o.run and (self.numbering == "notebook" or o.run != o.index) else ""
                lines.append(f"  {self.label(o.index):<9} {_SAID[o.how]}{run}")
        return "\n".join(lines)


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



def notebook_holding(folder: Path, cell_id: str, skip: Sequence[Path] = ()) -> Path | None:
    """The notebook in ``folder`` that holds a cell with id ``cell_id`` (the kernel's notebook renamed since the
    kernel started: the name it was given then is gone, or another notebook's now), newest first."""
    try:
        found = sorted(folder.glob("*.ipynb"), key=lambda p: p.stat().st_mtime, reverse=True)
    except OSError:
        return None
    for path in found[:200]:
        if path.resolve() in skip or path.stat().st_size > 64 * 2**20:
            continue
        try:
            if cell_id not in path.read_text(encoding="utf-8", errors="replace"):
                continue
            if any(c.get("id") == cell_id for c in read_nbformat(path)[0].cells):
                return path
        except (OSError, NotebookError):
            continue
    return None


def vscode_notebook(cell_id: str | None) -> Path | None:
    """The notebook file a VS Code cell id names: VS Code sends the cell's document URI,
    ``vscode-notebook-cell:/path/to/nb.ipynb#…``, which follows the notebook where it is renamed or moved."""
    from urllib.parse import unquote, urlparse

    if not cell_id or not cell_id.startswith("vscode-notebook-cell:"):
        return None
    path = Path(unquote(urlparse(cell_id).path))
    return path if path.suffix == ".ipynb" and path.is_file() else None
