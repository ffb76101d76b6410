"""One job from start to end: convert, install once, launch, collect. ``nbddp run``, ``%%ddp_train``, the
templates (and any other front end) all call ``run_job``, so they behave the same."""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from . import launch as _launch
from . import outputs
from .convert import Script
from .convert.launches import leading_launch
from .display.view import JobView, PrintView
from .errors import NbddpError
from .gpus import Machine, read_machine
from .job_plan import (LOOKED_FOR, Job, JobPlan, JobSource, check_trains, decide_mode, decide_strategy,  # noqa: F401
                       plan_job, prepare_job)
from .launch import RankFailure, RunResult, Sink
from .options import RunOptions
from .runtime.records import Event

#: Where run directories go unless told otherwise (``NBDDP_RUNS``).
DEFAULT_RUNS = "nbddp_runs"


def run_job(source: JobSource, options: RunOptions | None = None, view: JobView | None = None, *,
            keep=None) -> JobResult:
    """Train ``source`` (see ``prepare_job``) under torchrun and say what it left: the one call every front
    end makes.

    ``source`` may be a ``JobPlan`` already made (``plan_job``; a front end that shows the plan or sizes its
    panel first): then nothing is decided again. Otherwise the plan is made here, from ``options``
    (``RunOptions``, default: none given, checked when made): the mode (a notebook with no training call
    nbddp recognises is refused before launch unless ``options.every_rank``), the strategy, the processes.
    ``view`` (a ``JobView``, default ``PrintView``: rank 0's text on stdout) is told the strategy decision
    (where the plan is made here; a front end that planned said it), the run directory once it is made, rank 0's output and each Trainer event. Run directories go under
    ``options.runs_dir``, ``$NBDDP_RUNS`` or ``./nbddp_runs``. ``keep`` (a ``kept.Channel``) keeps the ranks
    up after the notebook's cells: the result's ``run.process`` is torchrun, left running.
    """
    view = view or PrintView()  # the strategy decision said on it where this call makes the plan
    plan = plan_job(source, options, keep=keep is not None, say=lambda text: view.sink("stdout", text + "\n"))
    if plan.keep != (keep is not None):
        raise NbddpError("the job was planned with" + ("" if plan.keep else "out") + " --keep, and run otherwise")
    if plan.launched:
        view.sink("stderr", f"nbddp: the notebook starts its training from a shell line ({leading_launch(plan.script.launches)}): "
                            f"its cells run once, in one process, and the command it launches on {plan.launched} processes\n")
    env, until = {**plan.env, **view.rank_env()}, None
    if keep is not None:
        env, until = {**env, **keep.env()}, keep.ready
    run = _run_script(plan.job, plan.options, view, nproc=plan.processes, env=env, until=until, launched=plan.launched,
                      on_interrupt=keep.stop_at_step if keep is not None else None)
    return JobResult.from_run(run, plan.job.cwd, plan.script)


def _run_script(job: Job, options: RunOptions, view: JobView, *, nproc: int | None, env: dict[str, str],
                until: Callable[[], bool] | None = None, launched: int | None = None,
                on_interrupt: Callable[[], None] | None = None) -> RunResult:
    """Write the job's script into a new run directory, run its installs once, then launch it under torchrun
    with ``nproc`` processes and the ranks' ``env``, as the job decided; the output folders the script names
    are checked and claimed for the launch (``outputs.py``). ``launched``: the processes the notebook's own
    launch command runs with, through the stand-ins (``nbddp.launched``)."""
    script = job.script
    folders = outputs.output_folders(script, job.cwd)
    outputs.check_writable(folders)
    runs = Path(options.runs_dir or os.environ.get("NBDDP_RUNS") or DEFAULT_RUNS).resolve()
    run_dir = _launch.new_run_dir(runs, job.name)
    view.on_run_dir(run_dir)
    path = script.write(run_dir / "script.py")
    if launched:
        from .launched import launched_env

        written = {launch.script: (launch.written_by, launch.first_line) for launch in script.launches
                   if launch.written_by}
        env = launched_env(dict(env), run_dir, launched, written)
    if script.installs and not options.skip_installs:
        _launch.run_installs(script.installs, view.sink)  # Installs: a failure names its cell
    plan = _launch.plan(path, run_dir, options, nproc=nproc, cwd=job.cwd, env=env)
    with outputs.claimed(folders, run_dir) as shared:
        for warning in shared:
            view.sink("stderr", f"nbddp: warning: {warning}\n")
        result = _launch.launch(plan, sink=view.sink, on_metrics=view.on_metrics, until=until, on_interrupt=on_interrupt)
    if launched:  # the notebook went on after its launched training failed, as in the kernel
        from .launched import with_launched_failure

        result = with_launched_failure(result, run_dir / "launched")
    failure = outputs.explain_no_space(result.failure, plan.cwd, list(result.log_history))
    return dataclasses.replace(result, failure=failure) if failure is not result.failure else result


def strategy_launch(script: Script, cwd, requested: str, nproc: int | None, env: dict[str, str] | None,
                    sink: Sink, machine: Machine | None = None) -> tuple[int | None, dict[str, str]]:
    """The processes and environment of the strategy ``script`` runs with (``job_plan.decide_strategy`` on one
    reading of the machine), its decision said on the sink as the run says it. Split mode is one process
    driving every GPU; the ranks learn the strategy from ``NBDDP_STRATEGY``."""
    decision = decide_strategy(script, cwd, requested, machine or read_machine(),
                               say=lambda text: sink("stdout", text + "\n"))
    env = {**(env or {}), "NBDDP_STRATEGY": decision.strategy}
    return (1 if decision.strategy == "split" else nproc), env


#: Keys nbddp adds to each Trainer log record (``runtime/metrics.py``); the rest is the Trainer's own.
_RECORD_KEYS = frozenset({"event", "max_steps", "time", "output_dir"})
#: Folders never searched for adapters a run wrote.
_SKIP_DIRS = frozenset({"__pycache__", "node_modules", "site-packages", "wandb"})


@dataclass(frozen=True, repr=False)
class JobResult:
    """What a finished job leaves for the next cell (``_ddp`` after ``%%ddp_train``): the Trainer's logs and
    final metrics, where its outputs and adapters went, the script and every rank's logs.

    ``output_dir`` is the Trainer's ``output_dir`` as rank 0 saw it; ``adapters`` are the folders holding an
    ``adapter_config.json`` written during the run, under ``output_dir`` or the folder the ranks ran in;
    ``script`` is the converted ``Script`` (its text, changes and warnings).
    """

    run: RunResult
    cwd: Path
    output_dir: Path | None = None
    adapters: tuple[Path, ...] = ()
    script: Script | None = None

    @classmethod
    def from_run(cls, run: RunResult, cwd: str | os.PathLike, script: Script | None = None) -> "JobResult":
        """The result of ``run`` of ``script``, whose ranks started in ``cwd``: looks for what the run wrote there."""
        cwd = Path(cwd).resolve()
        begin = next((r for r in run.log_history if r.get("event") == Event.BEGIN and r.get("output_dir")), None)
        output_dir = (cwd / begin["output_dir"]).resolve() if begin else None
        since = time.time() - run.duration_s - 1.0
        roots = [p for p in (output_dir, cwd) if p is not None and p.is_dir()]
        return cls(run, cwd, output_dir, _adapters_written(roots, since, skip=run.run_dir.parent), script)

    @property
    def ok(self) -> bool:
        """Finished by itself with exit code 0 (``RunResult.ok``: a stopped job is never ok)."""
        return self.run.ok

    @property
    def failure(self) -> RankFailure | None:
        return self.run.failure

    @property
    def interrupted(self) -> bool:
        return self.run.interrupted

    @property
    def timed_out(self) -> bool:
        return self.run.timed_out

    @property
    def duration_s(self) -> float:
        return self.run.duration_s

    @property
    def run_dir(self) -> Path:
        return self.run.run_dir

    @property
    def script_path(self) -> Path:
        return self.run.script

    @property
    def log_dir(self) -> Path:
        return self.run.run_dir / "logs"

    @property
    def log_history(self) -> list[dict]:
        """The Trainer's ``state.log_history`` as rank 0 logged it: one dict per ``on_log``."""
        return [
            {k: v for k, v in r.items() if k not in _RECORD_KEYS} for r in self.run.log_history if r.get("event") == Event.LOG
        ]

    @property
    def metrics(self) -> dict:
        """The Trainer's final metrics (``train_runtime``, ``train_loss``, ``train_samples_per_second``, …)."""
        return next((h for h in reversed(self.log_history) if "train_runtime" in h), {})

    @property
    def steps(self) -> int:
        return max((int(r.get("step") or 0) for r in self.run.log_history), default=0)

    @property
    def max_steps(self) -> int:
        return max((int(r.get("max_steps") or 0) for r in self.run.log_history), default=0)

    @property
    def losses(self) -> list[float]:
        return self.run.losses

    def rank_log(self, rank: int, stream: str = "stdout") -> Path | None:
        return self.run.rank_log(rank, stream)

    def __repr__(self) -> str:
        state = "ok" if self.ok else ("interrupted" if self.interrupted else "failed")
        loss = f", loss={self.losses[-1]:.4g}" if self.losses else ""
        out = f", output_dir='{self.output_dir}'" if self.output_dir else ""
        return f"JobResult({state}, steps={self.steps}{loss}{out}, run_dir='{self.run_dir}')"


def _adapters_written(roots: list[Path], since: float, skip: Path, depth: int = 3, limit: int = 5000) -> tuple[Path, ...]:
    """Folders under ``roots`` (at most ``depth`` levels down) with an ``adapter_config.json`` newer than
    ``since`` and the whole adapter saved (``outputs.saved_whole``); hidden folders, the runs folder and
    package trees are not searched."""
    found: dict[Path, None] = {}
    seen = 0
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            here = Path(dirpath)
            seen += 1
            if seen > limit:
                return tuple(found)
            if ("adapter_config.json" in filenames and (here / "adapter_config.json").stat().st_mtime >= since
                    and outputs.saved_whole(here, filenames)):  # not a save a full disk or a failure cut short
                found[here] = None
            level = len(here.relative_to(root).parts)
            dirnames[:] = [
                d for d in sorted(dirnames)
                if level < depth and not d.startswith(".") and d not in _SKIP_DIRS and here / d != skip
            ]
    return tuple(found)
