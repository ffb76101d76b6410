"""The cells of a job started from a kernel, as the kernel ran them: the saved notebook above the magic cell,
each cell taken as it last ran without raising (``cells_above``), or the kernel's history
(``cells_from_history``); ``select_cells`` picks the source (``executions.py`` records what the kernel ran)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from .cells import SKIP_TAG, Cell, read_nbformat
from .errors import NbddpError
from .executions import Execution, KernelRuns
from .selection import (
    EDITED,
    FAILED,
    RAN,
    REGISTERED,
    REPLACED,
    SAVED,
    SOURCES,
    THIS,
    Origin,
    Selection,
    job_source,
    notebook_holding,
    split_cell_magic,
    train_cell,
    vscode_notebook,
)


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



def _from_notebook(args: str, body: str, notebook: Path | None, kernel: KernelRuns,
                   folder: Path | None) -> tuple[Selection | None, str]:
    """The job from the saved notebook, or None and why not: the file the kernel names (VS Code's cell URI
    first), else one in its folder holding this cell's id (renamed since the kernel started)."""
    named = list(dict.fromkeys(p.resolve() for p in (vscode_notebook(kernel.running.cell_id), notebook) if p))
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
