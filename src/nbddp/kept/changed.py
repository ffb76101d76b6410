"""Cells of a kept job changed under it: a cell the job took as the kernel ran it (its loader, say) edited and
run again here after the job started. The ranks hold what the old code made (the model it loaded), so a
``%%ddp`` cell would work on something the notebook no longer says; it is refused, naming the cell, with the
fix. Cells are known by the front end's cell id (JupyterLab, Notebook 7, VS Code, nbclient send one); where
none was sent, a re-run cannot be told from a new cell and nothing is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import NbddpError
from ..executions import KernelRuns
from ..selection import EDITED, RAN, Selection


@dataclass(frozen=True)
class RanCell:
    """A cell of the kept job whose code came from the kernel's ``In [run]``, known by ``cell_id``."""

    run: int
    cell_id: str
    source: str


def cells_ran_here(selection: Selection | None, kernel: KernelRuns | None) -> tuple[RanCell, ...]:
    """The job's cells taken as the kernel ran them, with the id of the cell each run came from."""
    if selection is None or kernel is None:
        return ()
    runs = {r.count: r for r in kernel.runs}
    taken = (runs.get(o.run) for o in selection.origins if o.how in (RAN, EDITED) and o.run is not None)
    return tuple(RanCell(r.count, r.cell_id, r.source) for r in taken if r is not None and r.cell_id)


def refuse_changed(ran: tuple[RanCell, ...], kernel: KernelRuns, since: int) -> None:
    """Raise when a cell in ``ran`` was run again after ``In [since]`` (the job's start) with other code."""
    by_id = {c.cell_id: c for c in ran}
    for run in kernel.runs:
        old = by_id.get(run.cell_id) if run.cell_id else None
        if old is None or run.count <= since or run.ok is False or run.source == old.source:
            continue
        raise NbddpError(
            f"the cell the kept job ran as In [{old.run}] was changed and run again here (In [{run.count}]) after "
            "the job started, and its ranks hold what the old code made: run %ddp_stop, then %%ddp_train --keep "
            "again, so the ranks run the cells as they are now")
