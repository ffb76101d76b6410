"""A papermill template's front end: its last cell calls ``run_template`` with the kernel's ``globals()``.

Beside the other front ends (``cli.py``, ``magics.py``), it hands its job to ``job.run_job``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

from .cells import notebook_cells
from .convert import Script, convert_cells
from .errors import NbddpError, NotebookError
from .guard import guard
from .job import Job, JobResult, run_job


@guard("training a template")
def run_template(
    path: str | os.PathLike, namespace: Mapping[str, object], **kwargs
) -> tuple[Script, JobResult]:
    """Train a papermill template's cells under torchrun with the parameter values a kernel holds.

    A template's kernel (papermill's, or Jupyter's) runs only the cell tagged ``parameters`` (and the one
    papermill injects); its training cells are tagged ``skip-execution`` and its last cell, tagged
    ``nbddp-skip``, calls this with ``globals()``. The parameter names papermill finds in the saved notebook
    take their values from ``namespace`` and are injected after the ``parameters`` cell by papermill's own
    ``parameterize_notebook``, as in papermill's output notebook; then the notebook is converted and run
    by ``run_job``, its ranks starting in the notebook's folder. Returns the script and the
    ``JobResult`` a kernel's next cell reads, as ``%%ddp_train`` leaves it.
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
    _show_rich_output_in_kernel(kwargs)
    job = run_job(Job(script, path.resolve().parent, path.stem), **kwargs)
    return job.script, job


def _show_rich_output_in_kernel(kwargs: dict) -> None:
    """In a kernel (papermill's), rank 0's ``display()`` becomes rich output of the template's cell."""
    from .display.panel import in_kernel, publish_display

    if in_kernel() and kwargs.get("on_metrics") is None:
        kwargs["on_metrics"] = publish_display
        kwargs["env"] = {**(kwargs.get("env") or {}), "NBDDP_RICH_DISPLAY": "1"}
