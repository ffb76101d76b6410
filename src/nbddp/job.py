"""One job from start to end: convert, install once, launch, collect. The CLI, the magics and the
templates all go through ``run_script``/``run_notebook`` so they behave the same."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Iterable

from . import launch as _launch
from .convert import Script, convert_notebook
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
    collective_timeout_s: float | None = None,
    resume: bool = False,
    sink: Sink | None = None,
    on_metrics: Callable[[dict], None] | None = None,
) -> RunResult:
    """Write the script into a new run directory, run its installs once, then launch it under torchrun.

    ``cwd`` is where the ranks start (default: here); run directories go under ``runs_dir``, ``$NBDDP_RUNS``
    or ``./nbddp_runs``. ``timeout_s`` bounds the job, ``collective_timeout_s`` each collective; ``resume``
    continues ``trainer.train()`` from the last checkpoint (see ``launch.plan``).
    """
    runs = Path(runs_dir or os.environ.get("NBDDP_RUNS") or DEFAULT_RUNS).resolve()
    run_dir = _launch.new_run_dir(runs, name)
    path = script.write(run_dir / "script.py")
    if script.installs and not skip_installs:
        _launch.run_installs((i.argv() for i in script.installs), sink)
    plan = _launch.plan(
        path, run_dir, nproc=nproc, torchrun_args=torchrun_args, cwd=cwd, env=env, timeout_s=timeout_s,
        collective_timeout_s=collective_timeout_s, resume=resume,
    )
    return _launch.launch(plan, sink=sink, on_metrics=on_metrics)


def run_notebook(path: str | os.PathLike, *, skip_bad_cells: bool = False, **kwargs) -> tuple[Script, RunResult]:
    """Convert a notebook and run it; ranks start in the notebook's folder, as its kernel would."""
    path = Path(path)
    script = convert_notebook(path, skip_bad_cells=skip_bad_cells)
    kwargs.setdefault("cwd", path.resolve().parent)
    return script, run_script(script, name=path.stem, **kwargs)
