"""The job's run directory (``NBDDP_RUN_DIR``) is not the notebook's to delete while the job runs.

It holds the script every rank runs, every rank's logs and the records the launcher reads (``records``):
a notebook that tidies up (``shutil.rmtree("nbddp_runs")``, or a folder holding it) would take them away
mid-run, and the job would then fail far from the cause (``FileNotFoundError … metrics.jsonl`` in the
Trainer). ``protect()`` adds an audit hook (PEP 578, the standard library's own events) that refuses such a
deletion at the line that asks for it, with ``RunDirectoryInUse`` saying what and why: the rank's traceback
then names the notebook's cell and line. Shell deletions (``!rm -rf``) run in another process, beyond an
audit hook: the launcher says so when the run directory is gone at the end.
"""

from __future__ import annotations

import os
import sys

from . import settings

#: The audit events that delete a path (``shutil.rmtree``, ``os.remove``/``unlink``, ``os.rmdir``), with the
#: index of the path among their arguments.
_DELETING = {"shutil.rmtree": 0, "os.remove": 0, "os.rmdir": 0}

_protected: str | None = None


class RunDirectoryInUse(RuntimeError):
    """The notebook's code would delete the run directory of the job it runs in."""


def protect(run_dir: str | None = None) -> bool:
    """Refuse, in this process, deletions of ``run_dir`` (default ``NBDDP_RUN_DIR``) and of the folders holding
    it; the files inside are left to their writers (nbddp's own atomic saves remove their temporary files
    there). Once per process (an audit hook cannot be removed); False without a run directory."""
    global _protected
    run_dir = run_dir or settings.current().run_dir  # NBDDP_RUN_DIR
    if not run_dir:
        return False
    first = _protected is None
    _protected = os.path.realpath(run_dir)
    if first:
        sys.addaudithook(_refuse_deleting_the_run_dir)
    return True


def _refuse_deleting_the_run_dir(event: str, args: tuple) -> None:
    at = _DELETING.get(event)
    if at is None or _protected is None:  # every audited event comes here: the common case returns at once
        return
    path = args[at] if len(args) > at else None
    if not isinstance(path, (str, bytes, os.PathLike)) or (len(args) > at + 1 and args[at + 1] is not None):
        return  # a descriptor, or a path relative to a directory descriptor (rmtree's own inner steps)
    target = os.path.realpath(os.fsdecode(path))
    if target == _protected or _protected.startswith(target.rstrip(os.sep) + os.sep):
        raise RunDirectoryInUse(
            f"this deletes {target}, which holds nbddp's run directory for this job ({_protected}: the script every "
            "rank runs, their logs, the records the launcher reads), while the job runs: leave it out of the deletion, "
            "or have run directories made elsewhere (nbddp run --runs-dir DIR, or NBDDP_RUNS)")
