"""A job's plan: every fact of how it runs, decided once, before anything is made or started.

``plan_job(source, options, keep=...)`` converts the source (``prepare_job``), reads the machine once
(``gpus.read_machine``: the GPU count and each GPU's free memory) and decides, in this order: the mode (the
converted notebook on every rank, launched — its training is a command a shell line starts —, or refused with
the reason, ``decide_mode``), the strategy and why (``choose_strategy.settle``), the processes
(``Machine.processes``; split: one), the ranks' environment. The frozen ``JobPlan`` is what ``run_job``, the
panel, the kept channel and both dry runs (``nbddp run --dry-run``, ``%%ddp_train --dry-run``) read: none of
them decides a field of it again, and a dry run refuses exactly what the run refuses, with the same error.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence, Union

from .cells import Cell
from .convert import Script, convert_cells, convert_notebook
from .convert.launches import leading_launch
from .errors import NbddpError
from .gpus import GiB, Machine, read_machine
from . import preflight
from .options import RunOptions
from .selection import Selection


@dataclass(frozen=True)
class Job:
    """A job ready to launch: its converted script, the folder its ranks start in, its run directory's name,
    and, for cells a kernel selected, the ``Selection`` (where each cell came from)."""

    script: Script
    cwd: Path
    name: str
    selection: Selection | None = field(default=None, compare=False)


#: What ``run_job`` trains: a notebook file, the cells a kernel selected, cells, a job converted or planned.
JobSource = Union[str, os.PathLike, Selection, Sequence[Cell], Job, "JobPlan"]


def prepare_job(source: JobSource, *, skip_bad_cells: bool = False, keep: bool = False,
                every_rank: bool = False) -> Job:
    """Convert ``source``: a notebook file's ranks start in its folder, as its kernel would, and its run
    directory takes its name; cells (a kernel's ``Selection``) start here, named after their notebook file
    or ``kernel``. ``keep`` (``--keep``): later cells run on every rank, so the code after the last training
    runs there too, but its writes (``convert_cells(kept_tail=True)``). ``every_rank`` (``--every-rank``): a
    notebook that does not train is converted whole, its prediction loops unsplit."""
    if isinstance(source, JobPlan):
        return source.job
    if isinstance(source, Job):
        return source
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        return Job(convert_notebook(path, skip_bad_cells=skip_bad_cells, kept_tail=keep, every_rank=every_rank),
                   path.resolve().parent,
                   path.stem)
    if isinstance(source, Selection):
        script = convert_cells(list(source.cells), origin=source.origin, skip_bad_cells=skip_bad_cells, kept_tail=keep,
                               every_rank=every_rank)
        return Job(script, Path.cwd(), Path(source.origin).stem if source.source == "notebook" else "kernel", source)
    return Job(convert_cells(list(source), skip_bad_cells=skip_bad_cells, kept_tail=keep, every_rank=every_rank),
               Path.cwd(), "job")


#: The modes a job runs in (``JobPlan.mode``).
EVERY_RANK, LAUNCHED, PREDICT = "every-rank", "launched", "predict"


@dataclass(frozen=True)
class JobPlan:
    """How one job runs, decided once (``plan_job``): read by everything after, never re-derived.

    ``mode``: ``every-rank`` or ``launched``; ``why``: the reason in words; ``processes``: torchrun's processes;
    ``launched``: in launched mode, the processes the notebook's own launch command gets; ``decision``: the
    strategy and why (None in launched mode); ``env``: the ranks' variables the options and the strategy set
    (the view's and the kept channel's are added at launch); ``machine``: the one reading of the GPUs.
    """

    job: Job
    options: RunOptions
    machine: Machine
    mode: str
    why: str
    processes: int
    env: dict[str, str]
    launched: int | None = None
    decision: object | None = None  # choose_strategy.Decision
    keep: bool = False

    @property
    def script(self) -> Script:
        return self.job.script

    @property
    def label(self) -> str:
        """The mode as a person names it: DDP (a training call found), predict (no training, prediction loops
        split), every rank (asked for, or a kept job's cells without one), launched."""
        if self.mode in (LAUNCHED, PREDICT):
            return self.mode
        return "DDP" if self.script.trains else "every rank"

    @property
    def strategy(self) -> str | None:
        return self.env.get("NBDDP_STRATEGY")

    def describe(self) -> str:
        """The plan as a person reads it before anything starts (the dry runs print it)."""
        o = self.options
        lines = [f"nbddp: plan for {self.script.source_map.origin} (nothing started)",
                 f"  mode:        {self.label}: {self.why}"]
        why_n = ("--nproc" if o.nproc else "one per GPU" if self.machine.gpus else "two gloo processes: no GPU")
        if self.launched:
            lines.append(f"  processes:   1 runs the notebook; its launch command gets {self.launched} ({why_n})")
        elif self.strategy == "split":
            lines.append("  processes:   1 (split: one process drives every GPU)")
        else:
            lines.append(f"  processes:   {self.processes} ({why_n})")
        if self.decision is not None:
            said = self.decision.summary().splitlines()
            lines.append("  strategy:    " + said[0].removeprefix("nbddp: strategy "))
            lines += ["               " + line.removeprefix("nbddp: ") for line in said[1:]]
        free = self.machine.free_bytes
        lines.append(f"  machine:     {self.machine.gpus} GPU(s)"
                     + (f", smallest free {min(free) / GiB:.1f} GiB" if free else "") if self.machine.gpus
                     else "  machine:     no GPU: the ranks run on CPU with gloo")
        env = " ".join(f"{k}={v}" for k, v in sorted(self.env.items()))
        lines.append(f"  ranks' env:  {env or '(none set by nbddp)'}")
        if o.torchrun_argv:
            lines.append(f"  torchrun:    {' '.join(o.torchrun_argv)}")
        lines.append(f"  installs:    {len(self.script.installs)}" + (" (skipped: --skip-installs)" if o.skip_installs else ""))
        lines += self._cells()
        return "\n".join(lines)

    def _cells(self) -> list[str]:
        selection = self.job.selection
        if selection is not None:  # its notes and warnings were said as it was made; here, each cell's origin
            where = selection.report(per_cell=True).splitlines()
            per_cell = where[where.index("nbddp: where each cell's code comes from:") + 1:] if selection.origins else []
            return [f"  cells:       {selection.describe().removeprefix('nbddp: ')}", *("  " + line for line in per_cell)]
        taken = ", ".join(str(c.index) for c in self.script.cells)
        return [f"  cells:       {taken} from {self.script.source_map.origin}" if taken else "  cells:       none"]


def plan_job(source: JobSource, options: RunOptions | None = None, *, keep: bool = False,
             machine: Machine | None = None, say: Callable[[str], None] | None = None) -> JobPlan:
    """The job's plan, or its refusal (``NbddpError``, the words the run says). ``keep`` (``--keep``): the ranks
    stay up after the cells. ``machine``: a reading already taken (default: read here, once). ``say`` hears the
    strategy decision before a refusal of it (so the refusal is read with it)."""
    if isinstance(source, JobPlan):
        return source
    options = options or RunOptions()
    job = prepare_job(source, skip_bad_cells=options.skip_bad_cells, keep=keep, every_rank=options.every_rank)
    script = job.script
    if not options.skip_installs:  # read as the run reads them before it installs: a line it cannot read is refused
        for install in script.installs:
            install.argv()
    mode = decide_mode(script, options.every_rank, keep=keep)
    if mode == LAUNCHED:
        if keep:
            raise NbddpError("--keep keeps a job whose cells train on every rank; this notebook starts its training "
                             f"from a shell line ({leading_launch(script.launches)}): run it without --keep")
        machine = machine or options.machine or read_machine(memory=False)  # no strategy: the count is enough
        return JobPlan(job, options, machine, mode, f"the notebook starts its training from a shell line "
                       f"({leading_launch(script.launches)}): its cells run once, in one process",
                       processes=1, env=dict(options.rank_env), launched=machine.processes(options.nproc), keep=keep)
    taken = options.machine  # read when --nproc was checked: its memory too, where nvidia-smi gave it
    machine = machine or (taken if taken and taken.memory_read else read_machine())
    decision = decide_strategy(script, job.cwd, options.strategy, machine, say)
    if keep and decision.strategy != "ddp":
        raise NbddpError(f"--keep keeps DDP jobs only: this one runs {decision.strategy}, whose sharded or "
                         "split state a later cell could break; train it without --keep")
    why = ("each rank predicts its own block of the rows, gathered in order; the code after on rank 0"
           if mode == PREDICT
           else "every cell on every rank, as asked (--every-rank)" if options.every_rank and not script.trains
           else "the ranks are kept up for later cells (--keep)" if not script.trains
           else "the converted notebook on every rank, its training call distributed")
    processes = 1 if decision.strategy == "split" else machine.processes(options.nproc)
    if not machine.gpus and machine.here:
        _check_cpu_memory(processes, decision, say)
    env = {**options.rank_env, "NBDDP_STRATEGY": decision.strategy}
    return JobPlan(job, options, machine, mode, why, processes, env, decision=decision, keep=keep)


def _check_cpu_memory(processes: int, decision, say: Callable[[str], None] | None) -> None:
    """CPU ranks, each with a copy of the model's weights once the notebook says which (the estimate its config
    gave): refused where they cannot fit the memory available, said where they may not. Before the notebook was
    converted only torch's own cost a rank was counted (``RunOptions``' check)."""
    weights = decision.estimate.parts.get("weights", 0) if decision.estimate is not None else 0
    if weights:
        for warning in preflight.check_cpu_memory(processes, model_bytes=weights):
            if say is not None:
                say(f"nbddp: warning: {warning}")


def decide_strategy(script: Script, cwd, requested: str, machine: Machine, say: Callable[[str], None] | None = None):
    """``choose_strategy.settle`` on the job's one reading of the machine; the decision handed to ``say``
    (before a refusal of it, so the two are read together) unless ``auto`` found no GPU (plain DDP on CPU, as
    before strategies existed; a fallback is always said)."""
    from . import choose_strategy

    def said(decision) -> None:
        if say is not None and (requested != "auto" or decision.gpu_free or decision.fallback):
            say(decision.summary())

    return choose_strategy.settle(script, cwd, requested, gpu_free=machine.free_bytes, say=said,
                                  gpu_count=machine.gpus)


#: What the converter recognises as training, as the refusal words it.
LOOKED_FOR = ("a Trainer's or TRL trainer's .train(), unsloth_train(…), a loop calling loss.backward(), "
              "notebook_launcher(…), an imported training helper given a model and its optimizer")


def decide_mode(script: Script, every_rank: bool = False, keep: bool = False) -> str:
    """How the job runs: ``every-rank`` (the converted notebook on every rank: a training call was found, or
    ``--every-rank`` asks for it), ``launched`` (its training is a command a shell line launches: the
    notebook once, that command on every GPU, ``nbddp.launched``); else refused before launch. A kept job
    (``keep``) needs no training call: its cells may only load the model, which later ``%%ddp`` cells train."""
    if script.trains or every_rank:
        return EVERY_RANK
    if script.launches:
        return LAUNCHED
    if script.predicts:  # no training, prediction loops: each rank predicts its share (convert/rules/predict.py)
        return PREDICT
    if keep:
        return EVERY_RANK
    check_trains(script, every_rank)
    return EVERY_RANK


def check_trains(script: Script, every_rank: bool = False) -> None:
    """Refuse, before anything is made or started, a script in which the converter found no training call
    and no shell line launching one: launched N times, every cell would run on every rank, each training
    alone. ``every_rank`` (``--every-rank``) runs it so all the same, as asked."""
    if script.trains or script.launches or every_rank:
        return
    if script.seems:  # --every-rank would train a copy alone on each rank, never synchronised: not offered
        seems, fix = (f"its training seems to be at {script.seems}",
                      "Make the training one of those (every cell on every rank would train a copy alone on "
                      "each rank, never synchronised), or run the notebook in its kernel")
    else:
        seems, fix = ("nbddp cannot tell where it trains",
                      "Make the training one of those, or, where the notebook does not train, pass --every-rank "
                      "to run every cell on every rank")
    raise NbddpError(
        f"{script.source_map.origin}: no training call found (looked for {LOOKED_FOR}, and for a shell line "
        f"launching torchrun, accelerate launch, deepspeed or python SCRIPT.py); {seems}. {fix}"
    )
