"""A papermill template's front end: its last cell calls ``run_template`` with the kernel's ``globals()``.

Beside the other front ends (``cli.py``, ``magics.py``), it hands its job to ``job.run_job``, with its run
options (``RunOptions``, from the keywords the template's cell passes) and its view (``TemplateView``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

from .cells import notebook_cells
from .convert import Script, convert_cells
from .display.panel import in_kernel, publish_display
from .display.view import PrintView
from .errors import NbddpError, NotebookError
from .guard import guard
from .job import Job, JobResult, run_job
from .options import RunOptions


class TemplateView(PrintView):
    """A template's view in a kernel (papermill's): rank 0's text printed, its ``display()`` shown as rich output
    of the template's cell, which papermill keeps."""

    def rank_env(self) -> dict[str, str]:
        return {"NBDDP_RICH_DISPLAY": "1"}

    def on_metrics(self, record: dict) -> None:
        publish_display(record)


@guard("training a template")
def run_template(
    path: str | os.PathLike, namespace: Mapping[str, object], **options
) -> tuple[Script, JobResult]:
    """Train a papermill template's cells under torchrun with the parameter values a kernel holds.

    A template's kernel (papermill's, or Jupyter's) runs only the cell tagged ``parameters`` (and the one
    papermill injects); its training cells are tagged ``skip-execution`` and its last cell, tagged
    ``nbddp-skip``, calls this with ``globals()``. The parameter names papermill finds in the saved notebook
    take their values from ``namespace`` and are injected after the ``parameters`` cell by papermill's own
    ``parameterize_notebook``, as in papermill's output notebook; then the notebook is converted and run
    by ``run_job``, its ranks starting in the notebook's folder. ``options`` are ``RunOptions``' keywords
    (``nproc=``, ``strategy=``), checked first. Returns the script and the ``JobResult`` a kernel's next cell
    reads, as ``%%ddp_train`` leaves it.
    """
    checked = RunOptions(**options)
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
    view = TemplateView() if in_kernel() else PrintView()  # papermill's kernel keeps rank 0's display() as output
    job = run_job(Job(script, path.resolve().parent, path.stem), checked, view)
    return job.script, job
