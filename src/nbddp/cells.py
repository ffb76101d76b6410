"""Where a job's cells come from: a notebook file read with nbformat, sources handed over directly, or —
for a job started from a kernel — the cells ``%%ddp_setup`` registered, the notebook file above the magic
cell with each cell as the kernel last ran it, or the kernel's history (``executions.py`` records what the
kernel ran)."""

from __future__ import annotations

import dataclasses
import json
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

import nbformat
from nbformat.warnings import MissingIDFieldWarning

from .errors import NbddpError, NotebookError
from .executions import Execution, KernelRuns

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


@dataclass(frozen=True)
class _FileCell:
    """A code cell of the saved notebook, with the id the file gives it."""

    index: int
    cell_id: str | None
    source: str
    tags: tuple[str, ...] = ()

    @property
    def skipped(self) -> bool:
        return SKIP_TAG in self.tags


def _normal_code(text: str) -> str:
    """A cell's code as compared between versions: front ends may add or drop trailing blanks."""
    return "\n".join(line.rstrip() for line in text.strip().splitlines())


def _same_code(a: str, b: str) -> bool:
    return _normal_code(a) == _normal_code(b)


def _is_train_cell(source: str, body: str | None = None) -> bool:
    """Whether ``source`` is a ``%%ddp_train`` cell (whose body is ``body``, if given)."""
    magic = split_cell_magic(source)
    return bool(magic and magic[0] == "ddp_train" and (body is None or _same_code(magic[2], body)))


def _train_cell_in(cells: list[_FileCell], kernel: KernelRuns, body: str, path: Path) -> _FileCell | None:
    """The running ``%%ddp_train`` cell in the saved notebook: by the front end's cell id, else by its text,
    else by an earlier version of it that ran here (a front end whose ids are not the file's: VS Code).
    Raises ``NbddpError`` where several saved cells are it and nothing tells which one runs."""
    running_id = kernel.running.cell_id
    by_id = [c for c in cells if running_id and c.cell_id == running_id]
    if by_id:
        return by_id[0]
    by_text = [c for c in cells if _is_train_cell(c.source, body)]
    if not by_text and running_id:  # its earlier runs, as saved
        earlier = [r.source for r in kernel.runs if r.cell_id == running_id]
        by_text = [c for c in cells if _is_train_cell(c.source) and any(_same_code(c.source, e) for e in earlier)]
    if len(by_text) > 1:
        which = ", ".join(str(c.index) for c in by_text[:-1]) + f" and {by_text[-1].index}"
        raise NbddpError(f"cells {which} of {path.name} hold this %%ddp_train cell, and nbddp cannot tell which one "
                         "runs: make them differ (a comment will do), or train with --source history")
    return by_text[0] if by_text else None


def _runs_by_cell(cells: list[_FileCell], kernel: KernelRuns
                  ) -> tuple[dict[int, list[Execution]], list[list[Execution]]]:
    """The kernel's runs of each saved cell, and the runs of cells the saved file does not hold.

    A run belongs to a cell by the cell's id where the front end sends the file's ids (JupyterLab, Notebook 7);
    else by its code: a run whose code is a saved cell's, and with it every run of the same front-end id
    (VS Code's cell URI), so a cell edited after a saved version ran is still known."""
    by_id = {c.cell_id: c for c in cells if c.cell_id}
    by_code: dict[str, list[_FileCell]] = {}
    for c in cells:
        by_code.setdefault(_normal_code(c.source), []).append(c)
    groups: dict[str, list[Execution]] = {}
    for run in kernel.runs:
        groups.setdefault(f"id:{run.cell_id}" if run.cell_id else f"run:{run.count}", []).append(run)
    mine: dict[int, list[Execution]] = {}
    strays = []
    for runs in groups.values():
        cell = by_id.get(runs[0].cell_id)
        if cell is None:
            saved = (by_code.get(_normal_code(r.source)) for r in runs)
            cell = next((found[0] for found in saved if found), None)
        if cell is None:
            strays.append(runs)
        else:
            mine.setdefault(cell.index, []).extend(runs)
    return {i: sorted(runs, key=lambda r: r.count) for i, runs in mine.items()}, strays


def _first_code_line(source: str) -> str:
    line = next((ln.strip() for ln in source.splitlines() if ln.strip() and not ln.lstrip().startswith("#")), "")
    return line if len(line) <= 60 else line[:57] + "..."


def _strays_warning(strays: list[list[Execution]], above: list[_FileCell], path: Path, most: int = 6) -> str | None:
    """A warning naming the cells that ran here with code the saved file does not hold (a cell added or edited
    and not saved, where the front end's ids do not say which), each with the saved cell it most resembles;
    the first ``most`` of them, then how many more."""
    import difflib

    lasts = [good[-1] for runs in strays
             if (good := [r for r in runs if r.ok is not False and job_source(r.source) is not None])]
    if not lasts:
        return None
    named = []
    for last in lasts[:most]:
        scores = [(difflib.SequenceMatcher(None, last.source, c.source).ratio(), c.index) for c in above]
        score, index = max(scores, default=(0.0, 0))
        like = f", an edit of cell {index}?" if score >= 0.6 else ""
        named.append(f"In [{last.count}] `{_first_code_line(last.source)}`{like}")
    more = f" and {len(lasts) - most} more" if len(lasts) > most else ""
    return (f"ran here but not in the saved {path.name}, so not in the job: {'; '.join(named)}{more}. Save the "
            "notebook to train what ran here, or train with --source history")


#: The comment papermill's Python translator heads the cell of parameters it injects with.
_PAPERMILL_HEADER = "# Parameters"


def _papermill_parameters(strays: list[list[Execution]], above: list[_FileCell]
                          ) -> tuple[_FileCell, Execution] | None:
    """The cell papermill injected after the cell tagged ``parameters`` (it is in the output notebook, not in
    the input file the kernel names), and that cell: the job takes both, as papermill's output holds them."""
    tagged = next((c for c in above if "parameters" in c.tags), None)
    injected = [r for runs in strays for r in runs if r.ok is not False and r.source.startswith(_PAPERMILL_HEADER)]
    return (tagged, injected[-1]) if tagged and injected else None


def _take(cell: _FileCell, runs: list[Execution]) -> tuple[Origin, str | None, str | None]:
    """Where a saved cell's code comes from, that code (None: left out), and a note: its last run that did not
    raise, else the saved file for a cell never run here; a cell whose every run raised is left out."""
    good = [r for r in runs if r.ok is not False]
    if runs and not good:
        return Origin(cell.index, FAILED, runs[-1].count), None, None
    if not good:
        return Origin(cell.index, SAVED), cell.source, None
    last = good[-1]
    note = None
    if last is not runs[-1]:
        note = (f"cell {cell.index} raised when last run (In [{runs[-1].count}]): its last run that did not raise "
                f"is taken (In [{last.count}])")
    return Origin(cell.index, RAN if _same_code(last.source, cell.source) else EDITED, last.count), last.source, note


def cells_above(path: str | Path, args: str, body: str, kernel: KernelRuns | None = None) -> Selection | None:
    """The code cells of the saved notebook above the running ``%%ddp_train`` cell, plus that cell as it runs;
    None when the saved file does not hold the cell (see ``_train_cell_in``).

    Each cell the ``kernel`` ran is taken as it last ran without raising, whatever the saved file says; a cell
    whose every run raised is left out; a cell never run here comes from the file.
    """
    path = Path(path)
    kernel = kernel or KernelRuns((), Execution(0, f"%%ddp_train {args}\n{body}", ok=None))
    nb, _ = read_nbformat(path)
    cells = [_FileCell(i, c.get("id"), c.get("source", ""), tuple(c.get("metadata", {}).get("tags", [])))
             for i, c in enumerate(nb.cells, start=1) if c.cell_type == "code"]
    at = _train_cell_in(cells, kernel, body, path)
    if at is None:
        return None
    above = [c for c in cells if c.index < at.index and not c.skipped]
    runs_of, strays = _runs_by_cell(cells, kernel)
    papermill = _papermill_parameters(strays, above)
    taken, origins, notes = [], [], []
    for cell in above:
        origin, code, note = _take(cell, runs_of.get(cell.index, []))
        if job_source(code if code is not None else cell.source) is None:
            continue
        if papermill and cell is papermill[0] and code is not None:
            code, origin = f"{code.rstrip()}\n{papermill[1].source}", Origin(cell.index, EDITED, papermill[1].count)
            note = f"cell {cell.index}: with the parameters papermill injected after it (In [{origin.run}])"
        origins.append(origin)
        notes += [note] if note else []
        if code is not None:
            taken.append(Cell(cell.index, job_source(code), str(path)))
    edited = [o.index for o in origins if o.how == EDITED]
    if edited:
        which = ", ".join(map(str, edited))
        notes.append(f"cell{'s' * (len(edited) > 1)} {which} differ{'s' * (len(edited) == 1)} from the saved "
                     f"{path.name}: the job takes {'them' if len(edited) > 1 else 'it'} as run here")
    if not _same_code(split_cell_magic(at.source)[2] if _is_train_cell(at.source) else at.source, body):
        notes.append(f"this cell differs from the saved {path.name}: the job takes it as it runs")
    strays = [g for g in strays if g[0].cell_id not in kernel.deleted and not (papermill and papermill[1] in g)]
    stray = _strays_warning(strays, above, path)
    here = train_cell(at.index, args, body, str(path))
    return Selection((*taken, here), source="notebook", origin=path.name, notes=tuple(notes),
                     origins=(*origins, Origin(at.index, THIS)), warnings=(stray,) if stray else ())


def _history_groups(kernel: KernelRuns) -> list[list[Execution]]:
    """The runs of each cell, in the order the cells first ran: a cell is known by the front end's id where one
    is sent, else by its code (a run without an id whose code ran under an id joins that id's cell). The
    running cell's earlier runs and ``%%ddp_train`` cells (other jobs) belong to no group."""
    runs = [r for r in kernel.runs if job_source(r.source) is not None
            and not (r.cell_id and r.cell_id == kernel.running.cell_id)]
    id_of_code = {job_source(r.source): r.cell_id for r in runs if r.cell_id}
    groups: dict[str, list[Execution]] = {}
    for run in runs:
        code = job_source(run.source)
        cell_id = run.cell_id or id_of_code.get(code)
        groups.setdefault(f"id:{cell_id}" if cell_id else f"code:{code}", []).append(run)
    return sorted(groups.values(), key=lambda g: g[0].count)


def cells_from_history(kernel: KernelRuns | Sequence[str], args: str, body: str) -> Selection:
    """The kernel's history: each cell once, at its last version that did not raise, in the order the cells
    first ran; runs that raised are left out. ``kernel`` may be IPython's ``In`` alone (no ids, no outcomes)."""
    if not isinstance(kernel, KernelRuns):
        kernel = KernelRuns.from_inputs(kernel)
    taken, origins = [], []
    groups = _history_groups(kernel)
    for group in groups:
        good = [r for r in group if r.ok is not False]
        origins += [Origin(r.count, FAILED, r.count) for r in group if r.ok is False]
        if good:
            taken.append(Cell(good[-1].count, job_source(good[-1].source), "In"))
            origins += [Origin(r.count, REPLACED, good[-1].count) for r in good[:-1]]
            origins.append(Origin(good[-1].count, RAN, good[-1].count))
    here = train_cell(kernel.running.count, args, body, "In")
    origins = sorted(origins, key=lambda o: o.index)
    notes = (*_history_notes(kernel, taken, origins), *_reruns_overtaken(groups))
    return Selection((*taken, here), source="history", origin="the kernel's history", numbering="execution",
                     notes=notes, origins=(*origins, Origin(here.index, THIS)))


def _bound_names(code: str) -> set[str]:
    """The names a cell's top-level statements bind (assignments, imports, definitions); none for a cell
    Python cannot read as it stands (IPython syntax)."""
    import ast

    try:
        tree = ast.parse(code)
    except SyntaxError:
        return set()
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
    return names


def _reruns_overtaken(groups: list[list[Execution]]) -> list[str]:
    """Where a cell known by its code ran again after another cell rebound its names (``lr = 1e-3``, then
    ``lr = 1e-4``, then ``lr = 1e-3`` again, with no cell ids): the job runs it where it first ran, so the
    other cell's value wins there while the kernel holds this one's. Said, since only the person knows."""
    notes = []
    chosen = [[r for r in g if r.ok is not False] for g in groups]
    for group, good in zip(groups, chosen):
        if group[0].cell_id or len(good) < 2:
            continue
        names = _bound_names(job_source(good[-1].source) or "")
        for other in chosen:
            if other and other is not good and good[0].count < other[-1].count < good[-1].count:
                shared = sorted(names & _bound_names(job_source(other[-1].source) or ""))
                if shared:
                    notes.append(f"In [{good[-1].count}] ran the code of In [{good[0].count}] again after "
                                 f"In [{other[-1].count}] rebound {', '.join(shared)}: the job runs it where it first "
                                 f"ran, so {shared[0]} is In [{other[-1].count}]'s there; run the cell of "
                                 f"In [{good[-1].count}] edited (a comment will do) to take it last")
    return notes


def _history_notes(kernel: KernelRuns, taken: list[Cell], origins: list[Origin]) -> tuple[str, ...]:
    """What a person should know of a job taken from the history."""
    notes = []
    if not taken:
        notes.append("nothing else ran in this kernel without raising: the job is this cell alone")
    replaced = sum(o.how == REPLACED for o in origins)
    if replaced:
        notes.append(f"{replaced} earlier version{'s' * (replaced > 1)} of cells run again left out: each cell is "
                     "taken at its last version")
    followed = [r for r in kernel.runs if r.followed]
    if followed and not kernel.ids_sent and len(taken) > 1:
        notes.append("no cell ids from this front end: a cell is known by its code, so an edited cell run again "
                     "counts as a new cell (both versions run, in order)")
    unknown = [r.count for r in kernel.runs if r.ok is None and any(c.index == r.count for c in taken)]
    if unknown:
        which = f"In [{unknown[0]}]" + (f" to In [{unknown[-1]}]" if len(unknown) > 1 else "")
        notes.append(f"{which} ran before %load_ext nbddp: whether {'they' if len(unknown) > 1 else 'it'} raised is "
                     "not known, so taken (load nbddp first)")
    return tuple(notes)


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


def _vscode_notebook(cell_id: str | None) -> Path | None:
    """The notebook file a VS Code cell id names: VS Code sends the cell's document URI,
    ``vscode-notebook-cell:/path/to/nb.ipynb#…``, which follows the notebook where it is renamed or moved."""
    from urllib.parse import unquote, urlparse

    if not cell_id or not cell_id.startswith("vscode-notebook-cell:"):
        return None
    path = Path(unquote(urlparse(cell_id).path))
    return path if path.suffix == ".ipynb" and path.is_file() else None


def _from_notebook(args: str, body: str, notebook: Path | None, kernel: KernelRuns,
                   folder: Path | None) -> tuple[Selection | None, str]:
    """The job from the saved notebook, or None and why not: the file the kernel names (VS Code's cell URI
    first), else one in its folder holding this cell's id (renamed since the kernel started)."""
    named = list(dict.fromkeys(p.resolve() for p in (_vscode_notebook(kernel.running.cell_id), notebook) if p))
    for path in named:
        found = cells_above(path, args, body, kernel)
        if found is not None:
            return found, ""
    if kernel.running.cell_id:
        where = folder or (named[-1].parent if named else Path.cwd())
        other = notebook_holding(Path(where), kernel.running.cell_id, skip=named)
        found = cells_above(other, args, body, kernel) if other else None
        if found is not None:
            note = f"found by this cell's id in {other.name}, not in the notebook the kernel names: renamed since the "\
                   "kernel started?"
            return dataclasses.replace(found, notes=(note, *found.notes)), ""
    if not named:
        return None, ("the kernel does not say which notebook file it runs (or names one that is gone: renamed since "
                      "the kernel started?)")
    return None, f"{named[-1].name} on disk does not hold this cell (save the notebook)"


def select_cells(
    args: str,
    body: str,
    *,
    source: str = "auto",
    registered: Sequence[Cell] = (),
    notebook: str | Path | None = None,
    kernel: KernelRuns | None = None,
    folder: str | Path | None = None,
) -> Selection:
    """The cells of a ``%%ddp_train`` job: ``registered`` cells if any, else the ``notebook`` file above the
    magic cell, with each cell the ``kernel`` ran as it ran there, else the kernel's history. ``source`` forces
    one of them. ``folder`` is where a notebook renamed since the kernel started is looked for (default: the
    named notebook's folder, else the working directory).

    Raises ``NbddpError`` when the forced source has nothing to give.
    """
    if source not in ("auto", *SOURCES):
        raise NbddpError(f"--source must be one of auto, {', '.join(SOURCES)}; got {source!r}")
    kernel = kernel or KernelRuns((), Execution(0, "", ok=None))
    if source == "registered" or (source == "auto" and registered):
        if not registered:
            raise NbddpError("no cells registered: mark the cells of the job with %%ddp_setup first")
        here = train_cell(kernel.running.count, args, body, "In")
        origins = (*(Origin(c.index, REGISTERED) for c in registered), Origin(here.index, THIS))
        return Selection((*registered, here), source="registered", origin="%%ddp_setup cells", numbering="execution",
                         origins=origins)
    notes: tuple[str, ...] = ()
    if source in ("auto", "notebook"):
        found, reason = _from_notebook(args, body, Path(notebook) if notebook else None, kernel,
                                       Path(folder) if folder else None)
        if found is not None:
            return found
        if source == "notebook":
            raise NbddpError(f"cannot take the cells from the notebook file: {reason}")
        notes = (f"{reason}; the kernel's history is used",)
    selection = cells_from_history(kernel, args, body)
    return dataclasses.replace(selection, notes=notes + selection.notes)
