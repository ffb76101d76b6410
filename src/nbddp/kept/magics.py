"""``%%ddp``, ``%ddp_pull``, ``%ddp_push``, ``%ddp_status``, ``%ddp_stop``: the kept job's magics.

``%%ddp_train --keep`` (``nbddp.magics``) starts the kept job and hands it to ``KeptMagics.start``.
"""

from __future__ import annotations

import pickle
import threading
import time

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from ..display import outcome_error
from ..display.progress import warm as warm_plot
from ..display.text import cell_label
from ..errors import JobFailed, JobInterrupted, NbddpError
from ..guard import guard
from ..job import JobResult
from ..launch import RankFailure, RunResult, map_traceback
from ..launch.supervise import poll_in_written_order
from ..runtime.kept_protocol import Failed, Interrupted, Ok, Pull, Push, Run, Status
from ..runtime.sourcemap import read_source_map
from .cell import convert_kept_cell
from .changed import refuse_changed
from .controller import KeptJob
from .view import CellView

#: The idle limit's default, in minutes: Kaggle counts GPU quota (30 h a week) while a session holds GPUs,
#: so kept ranks nobody uses are ended after half an hour.
DEFAULT_IDLE_MIN = 30.0


def _no_job() -> NbddpError:
    return NbddpError("no kept job: run %%ddp_train --keep first (its ranks stay up for %%ddp cells)")


@magics_class
class KeptMagics(Magics):
    def __init__(self, shell, setup_cells=lambda: (), record=None):
        super().__init__(shell)
        self.record = record  # the kernel's executions (``executions.ExecutionRecord``), for cells run again
        self.job: KeptJob | None = None
        self.count = 0
        self._warming = False
        self.setup_cells = setup_cells  # the %%ddp_setup cells registered now

    def start(self, job: KeptJob | None) -> None:
        """A new kept job (or none) replaces the previous one, which is stopped first. Called as every
        ``%%ddp_train`` begins: matplotlib is made ready meanwhile, in a thread, while the ranks start."""
        if self.job is not None:
            self.job.stop()
        self.job = job
        if not self._warming:
            self._warming = True
            threading.Thread(target=warm_plot, daemon=True, name="nbddp-warm-plot").start()

    def _job(self) -> KeptJob:
        if self.job is None:
            raise _no_job()
        self.job.check_alive()
        return self.job

    @magic_arguments()
    @argument("--timeout", type=float, default=None, metavar="S",
              help="interrupt the cell on every rank after S seconds, as Stop does (default: none)")
    @cell_magic
    @guard("running a %%ddp cell", passthrough=(UsageError,))
    def ddp(self, line: str, cell: str):
        """Run this cell on every rank of the kept job (%%ddp_train --keep), converted by the same rules as
        the job's cells: another trainer.train() trains on every rank from the weights they hold; generation,
        saving, printing and plotting after a training run on rank 0. Rank 0's output is shown here; a failing
        rank's traceback at this cell's line. Stop interrupts every rank where it is (a training at its next
        step) and keeps the ranks; a cell that some ranks finished and others not says where those are."""
        args = parse_argstring(self.ddp, line)
        if args.timeout is not None and not args.timeout > 0:
            raise UsageError(f"--timeout takes seconds above 0, not {args.timeout:g}")
        job = self._job()
        self._refuse_changed_setup(job)
        if self.record is not None and job.ran_here:
            count = len(self.shell.history_manager.input_hist_raw) - 1
            refuse_changed(job.ran_here, self.record.snapshot(count, cell), job.started_at)
        self.count += 1
        kept = convert_kept_cell(cell, job.cells, job.run_dir, self.count)
        for warning in kept.script.warnings:
            if "no training call found" not in warning:
                print(f"nbddp: warning: {warning}")
        view = CellView(job.nproc, job.run_dir)
        followers, metrics = job.followers(view.sink, view.on_metrics)

        def follow():
            poll_in_written_order(followers)
            metrics.poll()
            view.poll()

        started = time.monotonic()
        waits = Waits(job, kept, self._label(job, kept))
        answer = job.request(Run(str(kept.path), kept.first, kept.last), follow=follow,
                             timeout_s=args.timeout, waiting=waits.note)
        poll_in_written_order(followers, final=True)
        metrics.poll()
        failure = self._failure(answer, kept)
        stopped = answer.interrupted or any(isinstance(rep, Interrupted) or _stopped_at_step(rep)
                                            for rep in answer.replies.values())
        run = RunResult(returncode=1 if failure or answer.ended else 0, run_dir=job.run_dir, script=kept.path,
                        duration_s=time.monotonic() - started, log_history=tuple(metrics.records),
                        failure=failure, interrupted=stopped and not failure)
        result = JobResult.from_run(run, job.cwd, kept.script)
        view.close(result)
        if not failure and not answer.ended:
            job.cells.append(kept.cell)
            self.shell.user_ns["_ddp"] = result if metrics.records else self.shell.user_ns.get("_ddp")
        if stopped and not failure:
            raise JobInterrupted(self._interrupted(answer, kept, job, args.timeout))
        if answer.ended and not failure:
            raise JobFailed(f"the kept job was ended: {job.ended_because}")
        error = outcome_error(result, self._label(job, kept))
        if error:
            if answer.ended:
                error.args = (f"{error.args[0]}; the other ranks did not finish, so the kept job was ended",)
            raise error

    def _refuse_changed_setup(self, job: KeptJob) -> None:
        """The %%ddp_setup cells the ranks ran are not those registered now: the ranks hold what the old cells
        made (a model, a dataset), so a cell reading them would not run what the notebook says."""
        now = tuple(c.source for c in self.setup_cells())
        if job.setup is not None and now != job.setup:
            raise NbddpError("the %%ddp_setup cells changed since the kept job started, and its ranks hold what the "
                             "old ones made: run %%ddp_train --keep again to start from the cells as they are now")

    def _interrupted(self, answer, kept, job: KeptJob, timeout_s: float | None) -> str:
        """What an interrupted cell says: where the ranks were stopped, and whether they are kept (an interrupt
        is not a failure: never said as one)."""
        what = f"timed out after {timeout_s:g} s (--timeout)" if answer.timed_out else "interrupted"
        places = [place(job, kept, self._label(job, kept), rep.traceback)
                  for _, rep in sorted(answer.replies.items()) if isinstance(rep, Interrupted)]
        if places:
            where = f" at {places[0]}"
        elif any(_stopped_at_step(rep) for rep in answer.replies.values()):
            where = ": the training stopped together at a step boundary"
        else:
            where = " after the cell had finished on every rank"
        if answer.ended:
            stuck = "".join(f"; rank {r} was at {place(job, kept, self._label(job, kept), line)}"
                            for r, line in sorted(answer.where.items()) if r not in answer.replies)
            return f"{what}{where}; the kept job was ended: {job.ended_because}{stuck}"
        return f"{what}{where}, the ranks are kept: %%ddp cells run on them"

    @staticmethod
    def _label(job: KeptJob, kept):
        base = cell_label(job.cells, "execution")
        return lambda index: "this %%ddp cell" if index == kept.cell.index else base(index)

    @staticmethod
    def _failure(answer, kept) -> RankFailure | None:
        errors = sorted((r, rep) for r, rep in answer.replies.items() if isinstance(rep, Failed))
        if not errors:
            return None
        rank, failed = errors[0]
        message = failed.message
        text, cell, line = map_traceback(failed.traceback, kept.path, read_source_map(kept.path))
        source = ""
        if cell == kept.cell.index and line:
            source = kept.cell.source.splitlines()[line - 1] if line <= len(kept.cell.source.splitlines()) else ""
        return RankFailure(rank=rank, message=message, traceback=text, cell=cell, line=line, source=source)

    @magic_arguments()
    @argument("name", help="a variable of the ranks' namespace")
    @argument("--rank", type=int, default=0, help="the rank to take it from (default: 0)")
    @line_magic
    @guard("running %ddp_pull", passthrough=(UsageError,))
    def ddp_pull(self, line: str):
        """Bring a picklable value from rank 0 (or --rank R) of the kept job into this kernel, under its name."""
        args = parse_argstring(self.ddp_pull, line)
        job = self._job()
        if args.rank not in job.channel.ranks:
            raise UsageError(f"--rank takes 0 to {job.nproc - 1}, not {args.rank}")
        reply = job.request(Pull(args.name), ranks=[args.rank]).replies[args.rank]
        if not isinstance(reply, Ok):
            raise NbddpError(f"%ddp_pull {args.name}: rank {args.rank}: {_said(reply)}")
        self.shell.user_ns[args.name] = reply.value

    @magic_arguments()
    @argument("name", help="a variable of this kernel")
    @line_magic
    @guard("running %ddp_push", passthrough=(UsageError,))
    def ddp_push(self, line: str):
        """Send a picklable value of this kernel to every rank of the kept job, under its name."""
        args = parse_argstring(self.ddp_push, line)
        if args.name not in self.shell.user_ns:
            raise UsageError(f"{args.name} is not defined in this kernel")
        value = self.shell.user_ns[args.name]
        try:
            pickle.dumps(value)
        except Exception as exc:
            raise NbddpError(f"%ddp_push {args.name}: the value cannot be sent to the ranks: {type(exc).__name__}: {exc}") from None
        answer = self._job().request(Push(args.name, value))
        bad = [f"rank {r}: {rep.message}" for r, rep in sorted(answer.replies.items()) if isinstance(rep, Failed)]
        if bad:
            raise NbddpError(f"%ddp_push {args.name}: " + "; ".join(bad))
        ranks = ", ".join(str(r) for r in sorted(answer.replies))
        print(f"nbddp: sent {args.name} ({type(value).__name__}, {_size(len(pickle.dumps(value)))}) to rank(s) {ranks}")

    @line_magic
    @guard("running %ddp_status", passthrough=(UsageError,))
    def ddp_status(self, line: str = ""):
        """What is kept: ranks, their devices and memory, idle time, how the job ends."""
        if self.job is None or not self.job.alive:
            why = f" (the last one {self.job.ended_because})" if self.job and self.job.ended_because else ""
            print(f"nbddp: no kept job{why}")
            return
        job = self.job
        idle = time.monotonic() - job.last_used
        answer = job.request(Status())
        print(f"nbddp: kept job, {job.nproc} rank(s), up {_duration(job.up_s())}, idle {_duration(idle)}"
              f"{_limit(job)}; run directory {job.run_dir}")
        for rank, reply in sorted(answer.replies.items()):
            if not isinstance(reply, Ok):
                print(f"  rank {rank}: {_said(reply)}")
                continue
            s = reply.value
            gpu = f", GPU memory {s['gpu_memory'] / 2**30:.2f} GiB" if s.get("gpu_memory") is not None else ""
            print(f"  rank {rank}: pid {s['pid']}, {s['device']}, host memory {s['rss'] / 2**30:.2f} GiB{gpu}")

    @line_magic
    @guard("running %ddp_stop", passthrough=(UsageError,))
    def ddp_stop(self, line: str = ""):
        """End the kept job: every rank leaves the process group and exits."""
        if self.job is None or not self.job.alive:
            print("nbddp: no kept job to stop")
            return
        self.job.stop()
        print("nbddp: the kept job has ended; every rank has exited")


def place(job: KeptJob, kept, label, traceback_or_line) -> str:
    """Where in the notebook a rank was: a traceback's innermost frame in the cell's script, or a script line."""
    smap = read_source_map(kept.path)
    if isinstance(traceback_or_line, int):
        cell, line = (smap.lookup(traceback_or_line) if smap else None) or (None, None)
    else:
        _, cell, line = map_traceback(traceback_or_line, kept.path, smap)
    if cell is None or not line:
        return "a line of a library (not the notebook's)"
    if cell == kept.cell.index:
        lines = kept.cell.source.splitlines()
        source = f" ({lines[line - 1].strip()})" if line <= len(lines) and lines[line - 1].strip() else ""
        return f"line {line} of this %%ddp cell{source}"
    return f"{label(cell)}, line {line}"


class Waits:
    """While some ranks have answered a cell and others not: which rank, at which line, for how long — said
    after ``FIRST_S``, then every ``EVERY_S`` (asked of the rank itself, ``KeptJob.ask_where``)."""

    FIRST_S, EVERY_S = 5.0, 30.0

    def __init__(self, job: KeptJob, kept, label):
        self.job, self.kept, self.label = job, kept, label
        self.asked: dict[int, float] = {}  # rank → the wait (s) at which it was last asked
        self.said: dict[int, float] = {}

    def note(self, rank: int, waited_s: float, answer) -> None:
        due = self.FIRST_S if rank not in self.said else self.said[rank] + self.EVERY_S
        if waited_s < due - 0.5:
            return
        if self.asked.get(rank, -1.0) < due - 0.5:
            self.job.ask_where(rank)
            self.asked[rank] = waited_s
            return
        if rank not in answer.where and waited_s < due + 1.0:  # its answer is on the way
            return
        done = ", ".join(str(r) for r in sorted(answer.replies))
        at = place(self.job, self.kept, self.label, answer.where[rank]) if rank in answer.where else "an unknown line"
        print(f"nbddp: rank {rank} is still running this cell, at {at}, {waited_s:.0f} s after rank(s) {done} "
              "finished it (Stop interrupts every rank)", flush=True)
        self.said[rank] = waited_s
        answer.where.pop(rank, None)


def _size(n: float) -> str:
    """A byte count as a person reads it: 812 bytes, 4.9 KiB, 3.0 MiB, 1.2 GiB."""
    if n < 1024:
        return f"{int(n)} bytes"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}"


def _duration(seconds: float) -> str:
    minutes, s = divmod(int(seconds), 60)
    return f"{minutes} min {s} s" if minutes else f"{s} s"


def _limit(job: KeptJob) -> str:
    limit = job.channel.idle_limit_s
    return f" (ended after {limit / 60:g} min idle)" if limit else " (no idle limit)"


def _stopped_at_step(reply) -> bool:
    """A cell's answer saying its training stopped at an agreed step (the Stop reached it there)."""
    return isinstance(reply, Ok) and bool(reply.value)


def _said(reply) -> str:
    """What a rank's answer that is not ``Ok`` says: a failure's message, an interrupted cell's traceback."""
    return reply.message if isinstance(reply, Failed) else reply.traceback
