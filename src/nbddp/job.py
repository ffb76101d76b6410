"""One job from start to end: convert, install once, launch, collect. The CLI, the magics and the
templates all go through ``run_script``/``run_notebook`` so they behave the same."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Iterable, Mapping

from . import launch as _launch
from .cells import notebook_cells
from .convert import Script, convert_cells, convert_notebook
from .errors import NbddpError, NotebookError
from .launch import RunResult, Sink

#: Where run directories go unless told otherwise (``NBDDP_RUNS``).
DEFAULT_RUNS = "nbddp_runs"


def run_script(
    script: Script,
    *,
    name: str = "job",
    nproc: int | None = None,
    cwd: str | os.PathLike | None = None,
    runs_dir: str | os.PathLike | None = None,
    torchrun_args: Iterable[str] = (),
    env: dict[str, str] | None = None,
    skip_installs: bool = False,
    timeout_s: float | None = None,
    sink: Sink | None = None,
    on_metrics: Callable[[dict], None] | None = None,
) -> RunResult:
    """Write the script into a new run directory, run its installs once, then launch it under torchrun.

    ``cwd`` is where the ranks start (default: here); run directories go under ``runs_dir``, ``$NBDDP_RUNS``
    or ``./nbddp_runs``.
    """
    runs = Path(runs_dir or os.environ.get("NBDDP_RUNS") or DEFAULT_RUNS).resolve()
    run_dir = _launch.new_run_dir(runs, name)
    path = script.write(run_dir / "script.py")
    if script.installs and not skip_installs:
        _launch.run_installs((i.argv() for i in script.installs), sink)
    plan = _launch.plan(path, run_dir, nproc=nproc, torchrun_args=torchrun_args, cwd=cwd, env=env, timeout_s=timeout_s)
    return _launch.launch(plan, sink=sink, on_metrics=on_metrics)


def run_notebook(path: str | os.PathLike, *, skip_bad_cells: bool = False, **kwargs) -> tuple[Script, RunResult]:
    """Convert a notebook and run it; ranks start in the notebook's folder, as its kernel would."""
    path = Path(path)
    script = convert_notebook(path, skip_bad_cells=skip_bad_cells)
    kwargs.setdefault("cwd", path.resolve().parent)
    return script, run_script(script, name=path.stem, **kwargs)


def run_template(
    path: str | os.PathLike, namespace: Mapping[str, object], **kwargs
) -> tuple[Script, RunResult]:
    """Train a papermill template's cells under torchrun with the parameter values a kernel holds.

    A template's kernel (papermill's, or Jupyter's) runs only the cell tagged ``parameters`` (and the one
    papermill injects); its training cells are tagged ``skip-execution`` and its last cell, tagged
    ``nbddp-skip``, calls this with ``globals()``. The parameter names papermill finds in the saved notebook
    take their values from ``namespace`` and are injected after the ``parameters`` cell by papermill's own
    ``parameterize_notebook``, as in papermill's output notebook; then the notebook is converted and run
    like ``run_notebook``, its ranks starting in the notebook's folder.
    """
    try:
        from papermill.inspection import inspect_notebook
        from papermill.iorw import load_notebook_node
        from papermill.parameterize import parameterize_notebook
    except ImportError:
        raise NbddpError("templates need papermill to read their parameters: pip install papermill") from None
    path = Path(path)
    if not path.exists():
        raise NotebookError(
            f"{path}: no such notebook in {Path.cwd()}; a template looks for its own saved file from the kernel's "
            "working directory (papermill: --cwd FOLDER_OF_THE_TEMPLATE)"
        )
    names = inspect_notebook(path)
    missing = [n for n in names if n not in namespace]
    if missing:
        raise NbddpError(f"{path.name}: parameters not set in this kernel: {', '.join(missing)}; run the parameters cell first")
    nb = parameterize_notebook(load_notebook_node(str(path)), {n: namespace[n] for n in names})
    script = convert_cells(notebook_cells(nb, origin=str(path)), origin=path.name)
    kwargs.setdefault("cwd", path.resolve().parent)
    return script, run_script(script, name=path.stem, **kwargs)
