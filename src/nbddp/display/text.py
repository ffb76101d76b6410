"""The words of a job's end: the summary, the failure's headline and its one traceback, the cell's error.

A rank's traceback arrives with its script frames already mapped to cells (``launch.map_traceback``:
``File "<origin>", cell N, line L``). Here it becomes what a person reads: each cell named as the notebook
shows it (``In [11]``, ``cell 4``, the ``%%ddp_train`` cell said so), library frames kept, and nbddp's own
frames (its runtime and shims, the script's generated lines) left out; the raw per-rank tracebacks stay in
the run's log directory, which the report names.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Sequence

from ..errors import JobFailed, JobInterrupted, NbddpError
from ..launch.postmortem import RankFailure

if TYPE_CHECKING:
    from ..cells import Cell
    from ..job import JobResult

#: nbddp's own source folder: frames in it are the machinery around the user's code, not the user's code.
PACKAGE_DIR = Path(__file__).resolve().parent.parent

_MAPPED = re.compile(r'^(?P<indent>\s*)File "(?P<origin>[^"]*)", cell (?P<cell>\d+), line (?P<line>\d+)(?P<rest>.*)$')
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line \d+')


def summary(job: "JobResult") -> str:
    """A few lines: outcome, steps, time, throughput, loss first → last, where the adapter and files are."""
    if job.ok:
        outcome = "finished"
    elif job.interrupted:
        outcome = "interrupted"
    elif job.timed_out:
        outcome = "timed out"
    else:
        outcome = "failed"
    parts = [f"{outcome} in {job.duration_s:.1f} s"]
    if job.steps:
        total = f"/{job.max_steps}" if job.max_steps and job.max_steps != job.steps else ""
        parts.append(f"{job.steps}{total} steps")
    metrics = job.metrics
    if metrics.get("train_steps_per_second"):
        parts.append(f"{metrics['train_steps_per_second']:.2f} steps/s")
    if metrics.get("train_samples_per_second"):
        parts.append(f"{metrics['train_samples_per_second']:.1f} samples/s")
    losses = job.losses
    if losses:
        parts.append(f"loss {losses[0]:.3f} → {losses[-1]:.3f}")
    lines = ["nbddp: " + " · ".join(parts)]
    if job.adapters:
        lines.append("nbddp: adapter saved in " + ", ".join(str(p) for p in job.adapters))
    if job.output_dir:
        lines.append(f"nbddp: Trainer output_dir {job.output_dir}")
    if not job.run.stopped_by:  # a stop signal's report named it already, as the last thing a dying kernel says
        lines.append(f"nbddp: run directory {job.run_dir} (script.py, logs/)")
    return "\n".join(lines)


def cell_label(cells: Sequence["Cell"], numbering: str = "notebook") -> Callable[[int], str]:
    """How a job's cells are named to a person: ``In [11]`` (kernel numbering) or ``cell 4`` (the notebook
    file's), with the ``%%ddp_train`` cell said so."""
    train = {c.index for c in cells if c.source.lstrip().startswith("# %%ddp_train")}

    def label(index: int) -> str:
        name = f"In [{index}]" if numbering == "execution" else f"cell {index}"
        return f"the %%ddp_train cell ({name})" if index in train else name

    return label


def failure_headline(failure: RankFailure, label: Callable[[int], str] | None = None) -> str:
    """``rank 1 failed in cell 3, line 2: ValueError: …`` and the line's code.

    ``label`` names a cell by its number (``cell 3``, or ``In [7]`` for cells taken from a kernel).
    """
    if label is None or failure.cell is None:
        return str(failure)
    src = f"\n    {failure.source.strip()}" if failure.source.strip() else ""
    what = f"was killed (signal {failure.signal})" if failure.signal else "failed"
    return f"{failure.who} {what} in {label(failure.cell)}, line {failure.line}: {failure.message}{src}"


def clean_traceback(traceback: str, label: Callable[[int], str] | None = None, hidden: Iterable[Path] = ()) -> str:
    """One readable traceback: mapped cell frames named by ``label``, frames in nbddp's package or in any of
    ``hidden`` (the generated script) left out with their code lines, everything else as it was."""
    folders = [PACKAGE_DIR, *(Path(p) for p in hidden)]
    out: list[str] = []
    skipping = False
    for text in traceback.rstrip().splitlines():
        mapped = _MAPPED.match(text)
        frame = _FRAME.match(text)
        if mapped:
            skipping = False
            out.append(_cell_frame(mapped, label))
        elif frame:
            skipping = _is_hidden(frame.group("file"), folders)
            if not skipping:
                out.append(text)
        elif skipping and text.startswith("    "):
            continue  # the hidden frame's code line and its ^^^ markers
        else:
            skipping = False
            out.append(text)
    return "\n".join(out)


def _cell_frame(m: re.Match, label: Callable[[int], str] | None) -> str:
    cell, line = int(m.group("cell")), m.group("line")
    name = label(cell) if label else f"cell {cell}"
    bare = name.removeprefix("the %%ddp_train cell (").removesuffix(")")
    where = f'File "{bare}", line {line}' if bare.startswith("In [") else f'File "{m.group("origin")}", {bare}, line {line}'
    note = "  (the %%ddp_train cell)" if bare != name else ""
    return f"{m.group('indent')}{where}{m.group('rest')}{note}"


def own_stop(traceback: str) -> bool:
    """Whether a rank stopped on one of nbddp's own checks (the same-samples check, the replica guard: an
    exception of ``nbddp.runtime``): its message holds the reason, the cell and line and the fix, so no traceback
    follows it (one would go through torch's hook frames and end in nbddp's class, saying it all again)."""
    lines = [line for line in traceback.rstrip().splitlines() if line.strip()]
    return bool(lines) and lines[-1].startswith("nbddp.runtime.")


def _is_hidden(file: str, folders: list[Path]) -> bool:
    path = Path(file)
    return any(path == f or f in path.parents for f in folders)


def failure_report(failure: RankFailure, label: Callable[[int], str] | None = None, others: Iterable[str] = (),
                   hidden: Iterable[Path] = ()) -> str:
    """The failing rank, the notebook cell and line, its traceback with script lines mapped, then ``others``:
    lines on where the other ranks were when stopped (``launch.where_ranks_were``)."""
    tb = "" if own_stop(failure.traceback) else clean_traceback(failure.traceback, label, hidden)
    tb = f"\n\n{tb}\n" if tb.strip() else "\n"
    rest = "".join(f"nbddp:   {line}\n" for line in others)
    return f"nbddp: {failure_headline(failure, label)}{tb}" + (f"nbddp: when the job stopped:\n{rest}" if rest else "")


def outcome_error(job: "JobResult", label: Callable[[int], str] | None = None) -> NbddpError | None:
    """The error a notebook cell ends with when its job did not finish; None when it did.

    A failing rank gives its one traceback (cells named, nbddp's frames left out), shown in the cell as the
    error's traceback, with where every rank's raw traceback is.
    """
    if job.ok:
        return None
    if job.interrupted and job.run.process is not None:  # a kept job (--keep): stopped at a step, ranks up
        done = f" at step {job.steps}/{job.max_steps}" if job.max_steps else " at a step boundary"
        return JobInterrupted(f"interrupted: the training stopped together{done}, the ranks are kept: "
                              "%%ddp cells run on them")
    if job.interrupted:
        done = f" at step {job.steps}/{job.max_steps}" if job.max_steps else ""
        return JobInterrupted(f"training stopped{done}; every rank and torchrun have exited. "
                              f"Run the cell again to start over (logs: {job.log_dir})")
    if job.timed_out:
        return JobFailed(f"timed out after {job.duration_s:.0f} s; every rank has been stopped (logs: {job.log_dir})")
    if job.failure:
        tb = "" if own_stop(job.failure.traceback) else clean_traceback(job.failure.traceback, label,
                                                                        hidden=[job.script_path])
        raw = f"\n(every rank's own traceback and output: {job.log_dir})" if tb.strip() else ""
        return JobFailed(failure_headline(job.failure, label), report=tb + raw)
    return JobFailed(f"torchrun exited with {job.run.returncode}; see {job.run_dir / 'torchrun.log'}")
