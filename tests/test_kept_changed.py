"""A kept job's cells changed under it (no kernel): which of its cells came from kernel runs, and a re-run of
one of them with other code refused, naming it and the fix."""

from __future__ import annotations

import pytest

from nbddp.cells import Cell
from nbddp.errors import NbddpError
from nbddp.executions import Execution, KernelRuns
from nbddp.kept.changed import RanCell, cells_ran_here, refuse_changed
from nbddp.selection import RAN, SAVED, THIS, Origin, Selection

LOADER = "model = load('a')"


def kernel(*runs: Execution) -> KernelRuns:
    return KernelRuns(runs, Execution(99, "%%ddp\nprint(1)", "c-ddp", ok=None))


def test_the_cells_the_job_took_as_the_kernel_ran_them_are_known_by_their_id():
    runs = kernel(Execution(2, LOADER, "c-loader"), Execution(3, "x = 1", None), Execution(4, "%%ddp_train --keep", "c-t"))
    selection = Selection((Cell(2, LOADER), Cell(3, "x = 1"), Cell(5, "y")), "history", "<kernel>",
                          origins=(Origin(2, RAN, 2), Origin(3, RAN, 3), Origin(5, SAVED), Origin(4, THIS)))
    assert cells_ran_here(selection, runs) == (RanCell(2, "c-loader", LOADER),)  # no id, saved: not followed
    assert cells_ran_here(None, runs) == () == cells_ran_here(selection, None)


def test_a_re_run_with_other_code_after_the_start_is_refused():
    ran = (RanCell(2, "c-loader", LOADER),)
    before = Execution(2, LOADER, "c-loader")
    refuse_changed(ran, kernel(before, Execution(5, LOADER, "c-loader")), since=4)  # same code: what the ranks hold
    refuse_changed(ran, kernel(before, Execution(3, "model = load('b')", "c-loader")), since=4)  # before the start
    refuse_changed(ran, kernel(before, Execution(5, "model = load('b')", "c-loader", ok=False)), since=4)  # it raised
    refuse_changed(ran, kernel(before, Execution(5, "model = load('b')", "c-other")), since=4)  # another cell
    with pytest.raises(NbddpError, match=r"ran as In \[2\] was changed and run again here \(In \[6\]\).*%ddp_stop, "
                                         r"then %%ddp_train --keep again"):
        refuse_changed(ran, kernel(before, Execution(5, LOADER, "c-loader"), Execution(6, "model = load('b')", "c-loader")),
                       since=4)
