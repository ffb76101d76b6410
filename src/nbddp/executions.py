"""A kernel's execution record: every cell the kernel ran since ``%load_ext nbddp`` — its source as run, the
front end's cell id where one is sent, whether it raised, its ``[N]`` — and, for the cells run before, what
IPython's history keeps.

IPython announces each execution through its ``pre_run_cell`` and ``post_run_cell`` events (``ExecutionInfo``,
``ExecutionResult``); nothing in IPython keeps the cell ids or the outcomes of past executions, hence this record.
``kernel_cells.select_cells`` reads a ``KernelRuns`` snapshot of it.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Execution:
    """One cell the kernel ran: ``In [count]``.

    ``ok`` is None where nobody can tell whether it raised: a cell run before nbddp was loaded, on an IPython
    that keeps no record of exceptions (before 9). ``followed`` is False for such cells: they come from the
    history, without a cell id.
    """

    count: int
    source: str
    cell_id: str | None = None
    ok: bool | None = True
    followed: bool = True


@dataclass(frozen=True)
class KernelRuns:
    """What a kernel ran, as a job selects its cells from it: the finished executions in order, and the cell
    running now (the ``%%ddp_train`` cell; its ``ok`` is None), and the cells deleted from the notebook."""

    runs: tuple[Execution, ...]
    running: Execution
    deleted: frozenset[str] = frozenset()  # ids of cells the front end said were deleted

    @classmethod
    def from_inputs(cls, inputs: Sequence[str]) -> KernelRuns:
        """From IPython's ``In`` alone (``inputs[n]`` is ``In[n]``, the last one running): no ids, outcomes unknown."""
        last = len(inputs) - 1
        runs = tuple(Execution(n, src, ok=None, followed=False) for n, src in enumerate(inputs) if 0 < n < last)
        return cls(runs, Execution(max(len(inputs) - 1, 0), inputs[-1] if inputs else "", ok=None))

    @property
    def ids_sent(self) -> bool:
        """Whether the front end sends cell ids: any followed execution carries one."""
        return any(r.cell_id for r in (*self.runs, self.running) if r.followed)


class ExecutionRecord:
    """The executions of one shell, kept from the events IPython triggers around each cell.

    A cell may run another (``%%ddp_setup --also-here`` does, without storing history): the events nest, so the
    cells being run are a stack, and only those stored in the history (``store_history``) are recorded.
    """

    def __init__(self, shell=None) -> None:
        self._shell = weakref.ref(shell) if shell is not None else lambda: None  # weak: the shell holds the record
        self._runs: dict[int, Execution] = {}
        self._running: list[tuple[object, str | None]] = []  # (ExecutionInfo, cell id) of each cell under way
        self.deleted: set[str] = set()

    def pre_run_cell(self, info) -> None:
        """IPython's ``pre_run_cell`` event. JupyterLab also sends the ids of the cells deleted since its last
        request (``deletedCells``): a cell the notebook no longer holds is no cell of it."""
        meta = request_metadata(self._shell(), info)
        deleted = meta.get("deletedCells")
        if isinstance(deleted, list):
            self.deleted.update(d for d in deleted if isinstance(d, str))
        self.before(info, cell_id_of(info, meta))

    def post_run_cell(self, result) -> None:
        """IPython's ``post_run_cell`` event."""
        self.after(result)

    def before(self, info, cell_id: str | None) -> None:
        self._running.append((info, cell_id))

    def after(self, result) -> None:
        """Record a finished cell. The cell that loaded nbddp finishes without having started here: its id is
        read from the result's info."""
        info = getattr(result, "info", None)
        cell_id = getattr(info, "cell_id", None)
        for i in range(len(self._running) - 1, -1, -1):
            if self._running[i][0] is info:
                cell_id = self._running.pop(i)[1] or cell_id
                break
        count = getattr(result, "execution_count", None)
        if info is None or not getattr(info, "store_history", False) or not count:
            return
        self._runs[count] = Execution(count, info.raw_cell, cell_id, _succeeded(result))

    def fill_from_history(self, inputs: Sequence[str], exceptions: dict | None, upto: int) -> None:
        """Take ``In[1]`` … ``In[upto - 1]`` that ran unseen (before nbddp was loaded, or while it was unloaded)
        from the history. IPython 9 and later keep each execution's exception (``exceptions``); before, whether
        such a cell raised is not known."""
        for n in range(1, min(upto, len(inputs))):
            if n not in self._runs:
                ok = None if exceptions is None else n not in exceptions
                self._runs[n] = Execution(n, inputs[n], ok=ok, followed=False)

    @property
    def running_cell_id(self) -> str | None:
        """The front end's id of the innermost cell being run, if it sent one."""
        return self._running[-1][1] if self._running else None

    def snapshot(self, running_count: int, running_source: str) -> KernelRuns:
        """The record now, while the cell ``In [running_count]`` runs."""
        runs = tuple(self._runs[n] for n in sorted(self._runs) if n < running_count)
        running = Execution(running_count, running_source, self.running_cell_id, ok=None)
        return KernelRuns(runs, running, frozenset(self.deleted))


def _succeeded(result) -> bool:
    """``ExecutionResult.success``; its parts where an IPython lacks the property."""
    success = getattr(result, "success", None)
    if isinstance(success, bool):
        return success
    return getattr(result, "error_before_exec", None) is None and getattr(result, "error_in_exec", None) is None


def request_metadata(shell, info) -> dict:
    """The metadata of the execute request that runs ``info``'s cell, where the front end sent one: IPython 9
    hands it over (``ExecutionInfo.cell_meta``); before, ipykernel still holds the request being served (IPython 7,
    Colab's and Kaggle's, drops the cell id the front end sends), which is this cell's if it holds its code."""
    meta = getattr(info, "cell_meta", None)
    if isinstance(meta, dict):
        return meta
    get_parent = getattr(getattr(shell, "kernel", None), "get_parent", None)
    try:
        parent = get_parent("shell") if callable(get_parent) else None
    except Exception:  # an ipykernel whose get_parent takes no channel: no metadata
        return {}
    if not isinstance(parent, dict) or (parent.get("content") or {}).get("code") != getattr(info, "raw_cell", None):
        return {}
    meta = parent.get("metadata")
    return meta if isinstance(meta, dict) else {}


def cell_id_of(info, meta: dict) -> str | None:
    """The front end's id of the cell: ``ExecutionInfo.cell_id`` (IPython 8 and later), else the request's
    ``cellId``. JupyterLab and Notebook 7 send the notebook's own cell id, VS Code the cell's document URI."""
    cell_id = getattr(info, "cell_id", None) or meta.get("cellId")
    return cell_id if isinstance(cell_id, str) and cell_id else None


#: One record per shell, kept across ``%reload_ext nbddp`` (which re-imports ``nbddp``, not this module).
_records: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def follow(shell) -> ExecutionRecord:
    """Start recording ``shell``'s executions (again, after ``unfollow``): the cells it ran unseen so far are
    taken from its history."""
    record = _records.get(shell)
    if record is None:
        record = _records[shell] = ExecutionRecord(shell)
    unfollow(shell)
    history = shell.history_manager
    inputs = history.input_hist_raw
    record.fill_from_history(inputs, getattr(history, "exceptions", None), upto=len(inputs) - 1)
    shell.events.register("pre_run_cell", record.pre_run_cell)
    shell.events.register("post_run_cell", record.post_run_cell)
    return record


def unfollow(shell) -> None:
    """Stop recording ``shell``'s executions (``%unload_ext nbddp``); the record is kept for ``follow``."""
    record = _records.get(shell)
    for event, handler in (("pre_run_cell", getattr(record, "pre_run_cell", None)),
                           ("post_run_cell", getattr(record, "post_run_cell", None))):
        if handler in shell.events.callbacks[event]:
            shell.events.unregister(event, handler)
