"""Run a planned job to its end: start torchrun, stream rank 0 live, read its metrics, stop it cleanly.

torchrun (started through ``nbddp.agent``, which is torchrun's own ``main`` plus a failure record) writes
each rank's stdout and stderr to files under the run directory (``--log-dir``, ``--redirects 3``). The
launcher follows rank 0's files as they grow and hands new text to a sink, reads the metrics rank 0
writes, and when the job ends has the post-mortem (``postmortem``) map the root failure and the stacks
back to notebook cells. Whatever ends the wait — the job, an interrupt, a timeout — every process the job
started is gone before ``launch`` returns: a rank asked first to dump its stacks (``ask_for_stacks``), then
the whole tree ended (``terminate_tree``).
"""

from __future__ import annotations

import codecs
import contextlib
import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Callable

import psutil

from ..errors import LaunchError
from ..runtime import records
from ..runtime.sourcemap import read_source_map
from . import warm_start
from .planning import LaunchPlan, Sink, find_rank_log, newest_attempt, stdout_sink
from .postmortem import RunResult, full_disk, read_failure, read_stacks, where_ranks_were

#: Seconds between two looks at the log files.
POLL_S = 0.05
#: Seconds the processes get to exit after SIGTERM before SIGKILL.
GRACE_S = 2.5
#: Seconds the ranks get to write their stacks before a timeout or an interrupt stops them (a dump takes
#: milliseconds; the time is for a rank a loaded machine has not scheduled yet). With ``GRACE_S``, 4 s: an
#: interrupt ends every rank within 5 s with a second to spare for the kernel to reap them (2 + 3 s was the
#: 5 s exactly).
STACKS_WAIT_S = 1.5
#: Seconds the processes of a job being ended may take, together, to stop before their children are listed
#: (``stopped_tree``): milliseconds, unless the machine is loaded.
FREEZE_S = 0.5


def launch(plan: LaunchPlan, sink: Sink | None = None, on_metrics: Callable[[dict], None] | None = None,
           until: Callable[[], bool] | None = None, on_interrupt: Callable[[], None] | None = None) -> RunResult:
    """Run the plan to the end; stream rank 0 to ``sink``; leave no process behind whatever happens.

    A Ctrl-C (``KeyboardInterrupt``), SIGTERM or SIGHUP (a scheduler's stop, a closed terminal) or the
    plan's timeout stops every rank; another of those signals while they are being stopped is held back until
    they are gone, so it cannot leave ranks running. A SIGTERM or SIGHUP that would have ended this process
    ends it once the ranks are gone and the stop is reported (``_StopSignals``).

    ``until`` (a kept job: every rank has finished the notebook's cells and is waiting for the kernel) returns
    with the processes left running: ``RunResult.process`` is torchrun's, for the kept job to end later. With
    ``on_interrupt`` too (the kept job's Stop), a Ctrl-C calls it and waits on for ``until`` (``_kept_after_stop``):
    the ranks stop their training at a step and are kept, interrupted; a second Ctrl-C stops them as above.
    """
    sink = sink or stdout_sink
    plan.log_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with open(plan.run_dir / "torchrun.log", "wb") as agent_log:
        proc = warm_start.start_agent(plan, plan.run_dir / "torchrun.log") or _fresh_agent(plan, agent_log)
        followers = [Follower(plan.log_dir, 0, stream, sink) for stream in ("stdout", "stderr")]
        followers.append(_Notices(plan.run_dir / records.NOTICES_FILE, sink))  # from other jobs (outputs.claimed)
        metrics = MetricsReader(plan.metrics_path, on_metrics)
        interrupted = timed_out = kept = False
        with _StopSignals() as stop:
            try:
                while job_running(proc):
                    poll_in_written_order(followers)
                    metrics.poll()
                    if until is not None and until():
                        kept = True
                        break
                    if plan.timeout_s and time.monotonic() - started > plan.timeout_s:
                        timed_out = True
                        break
                    time.sleep(POLL_S)
            except KeyboardInterrupt:
                interrupted = True
                if on_interrupt is not None and until is not None:
                    kept = _kept_after_stop(proc, on_interrupt, until, followers, metrics, sink)
            finally:
                stop.waiting = False  # from here a stop signal is only noted
                with _interrupts_held() as held:
                    if (timed_out or interrupted) and job_running(proc) and not kept:
                        ask_for_stacks(proc, plan.log_dir)
                    if not kept:
                        terminate_tree(proc)
                interrupted = interrupted or bool(held)
                stop.note(next((h for h in held if h != signal.SIGINT), None))
                stopped_by = stop.received
        poll_in_written_order(followers, final=True)
        metrics.poll()
        metrics.add_last_step()
    code = 0 if kept else proc.returncode
    failure, stacks = None, ()
    if code != 0 or timed_out or interrupted:
        stacks = read_stacks(plan.log_dir, plan.script, read_source_map(plan.script))
        if not (timed_out or interrupted):  # ranks failing as they are stopped are not the cause
            failure = read_failure(plan.log_dir, plan.script, failures=plan.failures_path)
        if failure:  # the failed rank's own place is in the failure itself
            stacks = tuple(st for st in stacks if st.rank != failure.rank)
    result = RunResult(
        returncode=code if code is not None else -1,
        run_dir=plan.run_dir,
        script=plan.script,
        duration_s=time.monotonic() - started,
        log_history=tuple(metrics.records),
        failure=failure,
        interrupted=interrupted,
        timed_out=timed_out,
        stacks=stacks,
        stopped_by=stopped_by,
        process=proc if kept else None,
    )
    if (interrupted or timed_out) and not kept:  # a hang is often ended this way: say where each rank was
        what = "interrupted" if interrupted else f"timed out after {plan.timeout_s:.0f} s"
        if stopped_by:
            what = f"stopped by {signal.Signals(stopped_by).name}"
        where = "".join(f"nbddp:   {line}\n" for line in where_ranks_were(result))
        run_dir = f"nbddp:   run directory: {plan.run_dir}\n" if stopped_by else ""
        with contextlib.suppress(OSError):  # a closed terminal (SIGHUP) cannot be written to
            sink("stderr", f"\nnbddp: {what}; every rank has been stopped.\n{where}{run_dir}")
    if not plan.run_dir.is_dir():  # the ranks refuse Python's deletions of it (runtime.rundir), not a shell's
        with contextlib.suppress(OSError):
            sink("stderr", f"\nnbddp: the run directory {plan.run_dir} was deleted while the job ran, with every "
                           "rank's logs and records: by a shell line of the notebook (!rm -rf …) or another program? "
                           "Leave it out, or have run directories made elsewhere (--runs-dir DIR, or NBDDP_RUNS)\n")
    _say_if_full(plan.run_dir, sink)
    stop.pass_on()
    return result


def _say_if_full(run_dir: Path, sink: Sink) -> None:
    """The job's end says so when the disk of its run directory is full (``postmortem.full_disk``)."""
    line = full_disk(run_dir)
    if line:
        with contextlib.suppress(OSError):
            sink("stderr", line)


#: Seconds a kept job's ranks get, after a Stop, to stop their training at a step and finish the cells.
KEPT_STOP_WAIT_S = 60.0


def _kept_after_stop(proc, on_interrupt, until, followers, metrics, sink) -> bool:
    """A kept job's Stop: the ranks are asked to stop their training at a step (``on_interrupt``) and the wait
    goes on for them; True once every rank is kept (``until``), False on a second Ctrl-C, the ranks' exit or
    ``KEPT_STOP_WAIT_S`` passing (the job is then stopped as any)."""
    on_interrupt()
    sink("stderr", "\nnbddp: stopping the training at the next step; the ranks are kept (interrupt again to end them)\n")
    deadline = time.monotonic() + KEPT_STOP_WAIT_S
    try:
        while job_running(proc) and time.monotonic() < deadline:
            poll_in_written_order(followers)
            metrics.poll()
            if until():
                return True
            time.sleep(POLL_S)
    except KeyboardInterrupt:
        pass
    return False


def job_running(proc) -> bool:
    """Whether the job's agent still runs, asked where a Ctrl-C may land: without ``Popen.poll``.

    ``poll`` takes the ``Popen``'s lock, then enters the ``try`` that gives it back; a ``KeyboardInterrupt``
    raised between the two (a SIGINT reaching a launcher preempted there, on a loaded machine) leaves it taken,
    and every later ``wait`` without a timeout waits for it forever, the ranks gone. ``waitid`` with ``WNOWAIT``
    asks the kernel, takes no lock and leaves the exit status to be collected by ``wait`` (``terminate_tree``).
    """
    if not isinstance(proc, subprocess.Popen) or not hasattr(os, "waitid"):
        return proc.poll() is None  # a warm start's agent (``warm_start``): its state comes from the warm process
    if proc.returncode is not None:
        return False
    try:
        return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None
    except ChildProcessError:  # collected already (by ``psutil``'s wait, say)
        return False


def _fresh_agent(plan: LaunchPlan, log) -> subprocess.Popen:
    try:
        return subprocess.Popen(
            plan.argv, cwd=plan.cwd, env=plan.env, stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )
    except OSError as exc:
        raise LaunchError(f"cannot start torchrun: {exc}") from None


#: Signals that stop a job the way Ctrl-C does: a scheduler's stop, a terminal closed under the launcher.
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))


class JobStopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP reached the launcher while it waited for the job: handled as an interrupt."""


def raise_job_stopped(signum, frame) -> None:
    """A SIGTERM/SIGHUP handler for a program that reads ``RunResult.stopped_by`` itself (the CLI): outside a
    job it raises ``JobStopped``; after a job ``launch`` leaves the signal to the program's return value."""
    raise JobStopped(signum)


class _StopSignals:
    """While entered (main thread only), SIGTERM and SIGHUP raise ``JobStopped`` where the launcher waits.

    A signal this process ignored stays ignored (``nohup``). ``pass_on()``, once the ranks are gone and the
    stop reported, gives the signal to whatever handled it before: a handler is called (but for
    ``raise_job_stopped``, whose program reads ``RunResult.stopped_by``), and the default action (ending
    this process, e.g. a kernel being shut down) is carried out, so a stop is never swallowed.
    """

    def __init__(self):
        self.previous: dict[int, object] = {}
        self.received: int | None = None
        self.waiting = True  # raise while the launcher waits for the job; afterwards only note

    def __enter__(self) -> "_StopSignals":
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                if signal.getsignal(sig) is not signal.SIG_IGN:
                    self.previous[sig] = signal.signal(sig, self._raise)
        return self

    def _raise(self, signum, frame) -> None:
        first = self.received is None
        self.note(signum)
        if first and self.waiting:
            raise JobStopped(signum)

    def note(self, signum: int | None) -> None:
        """Remember the first stop signal, to report it and pass it on."""
        self.received = self.received or signum

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def pass_on(self) -> None:
        handler = self.previous.get(self.received)
        if self.received is None or handler is None:
            return
        if callable(handler) and handler is not raise_job_stopped:
            handler(self.received, None)
        elif handler == signal.SIG_DFL:
            os.kill(os.getpid(), self.received)


@contextlib.contextmanager
def _interrupts_held():
    """Hold SIGINT, SIGTERM and SIGHUP back for the duration of the block (main thread only); yields the
    list of those held."""
    held: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield held
        return
    previous = {}
    for sig in (signal.SIGINT, *STOP_SIGNALS):
        if signal.getsignal(sig) is not signal.SIG_IGN:
            previous[sig] = signal.signal(sig, lambda signum, frame: held.append(signum))
    try:
        yield held
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def ask_for_stacks(proc: subprocess.Popen, log_dir: Path, wait_s: float = STACKS_WAIT_S) -> None:
    """Have every rank of the job write its stacks, and wait for them, before any rank is stopped.

    Stopped all at once, a rank waiting in a collective can see a peer go first and leave the collective
    with an error: its stack would then say where it died, not where it hung. Each rank's ``stacks.txt``
    names its pid; SIGUSR1 makes ``faulthandler`` dump every thread there without stopping the rank
    (``runtime.lifecycle``). Only pids of processes under ``proc`` are signalled.
    """
    if not hasattr(signal, "SIGUSR1"):
        return
    try:
        family = {p.pid for p in psutil.Process(proc.pid).children(recursive=True)}
    except psutil.NoSuchProcess:
        return
    asked = []
    for path, header, _ in records.read_stacks_files(newest_attempt(log_dir, records.STACKS_FILE)):
        if header and header.pid in family:
            with contextlib.suppress(OSError):
                os.kill(header.pid, signal.SIGUSR1)
                asked.append(path)
    deadline = time.monotonic() + wait_s
    while asked and time.monotonic() < deadline:
        asked = [p for p in asked if not records.read_stacks_file(p)[1].strip()]
        time.sleep(POLL_S)
    time.sleep(POLL_S)  # a dump seen begun is written whole within the signal handler: let it end


def terminate_tree(proc: subprocess.Popen, grace_s: float = GRACE_S) -> None:
    """End torchrun and every process under it (its workers run in sessions of their own).

    SIGTERM first so torchrun and the ranks can clean up, SIGKILL for whatever is left after ``grace_s``. Each
    time, the processes are stopped (``stopped_tree``) before their children are listed, so that none starts a
    process the signal misses: torchrun stopped while it was starting its workers left the one it had just started
    running for good, in a session of its own and no longer anyone's child (1 launch in about 12 timed out within
    a second on a loaded machine). Every wait is bounded: a ``Popen`` whose ``poll`` was interrupted holds its
    lock for good (``job_running``), and a wait without a timeout would keep the launcher from ever returning;
    its exit status is then unknown (``returncode`` None), the processes gone all the same.
    """
    family = _family(proc)
    if job_running(proc) or any(p.is_running() for p in family[1:]):
        family = stopped_tree(family)
        for p in family:
            _signal(p, signal.SIGTERM)
        for p in family:
            _signal(p, signal.SIGCONT)
        _, alive = psutil.wait_procs(family, timeout=grace_s)
        if alive:
            alive = stopped_tree(alive)  # with what they started after the SIGTERM
            for p in alive:
                _signal(p, signal.SIGKILL)
            psutil.wait_procs(alive, timeout=grace_s)
        _keep_exit_status(proc, family)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        if job_running(proc):  # not a pid the kernel may have given to another process since
            proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace_s)


def _keep_exit_status(proc, family: list[psutil.Process]) -> None:
    """``proc``'s exit status as ``psutil`` collected it: ``Popen.wait`` finds its child collected already and
    says 0, a stopped job's torchrun read as a success."""
    collected = next((p for p in family if p.pid == proc.pid), None)
    if isinstance(proc, subprocess.Popen) and proc.returncode is None and collected is not None \
            and getattr(collected, "returncode", None) is not None:
        proc.returncode = collected.returncode


def _family(proc) -> list[psutil.Process]:
    """The job's agent and every process under it, as they are now; none once the agent is collected (its pid
    may be another process's by then)."""
    if proc.returncode is not None:
        return []
    try:
        parent = psutil.Process(proc.pid)
        return [parent] + parent.children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def stopped_tree(roots: list[psutil.Process]) -> list[psutil.Process]:
    """``roots`` and every process under them, each stopped (SIGSTOP) before its children are listed: a stopped
    process starts no other, so the list is whole. They stay stopped; a SIGCONT after the signal that ends them
    lets them act on it. A process the machine has not scheduled within ``FREEZE_S`` is listed as it is."""
    deadline = time.monotonic() + FREEZE_S
    found: dict[int, psutil.Process] = {}
    todo = list(roots)
    while todo:
        p = todo.pop()
        if p.pid in found:
            continue
        found[p.pid] = p
        _signal(p, signal.SIGSTOP)
        _wait_stopped(p, deadline)
        with contextlib.suppress(psutil.Error):
            todo.extend(p.children())
    return list(found.values())


def _wait_stopped(p: psutil.Process, deadline: float) -> None:
    """Until ``p`` has stopped (or ended), or ``deadline``."""
    while time.monotonic() < deadline:
        try:
            if p.status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP, psutil.STATUS_ZOMBIE,
                              psutil.STATUS_DEAD):
                return
        except psutil.Error:
            return
        time.sleep(0.001)


def _signal(p: psutil.Process, sig: int) -> None:
    try:
        p.send_signal(sig)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        pass


def poll_in_written_order(followers: list, final: bool = False) -> None:
    """Rank 0's stdout and stderr are two files: what one poll finds in both is passed on in the order it was
    written, the file written last going last (an evaluation's bar on stderr, then the metrics the notebook
    printed on stdout; in a fixed order stdout came first, the bar after the metrics). Anything with ``poll``
    and ``last_written`` follows (the logs and the job's notices; the metrics reader is polled on its own)."""
    for follower in sorted(followers, key=lambda f: f.last_written()):
        follower.poll(final=final)


def _modified_ns(path: Path | None) -> int:
    try:
        return path.stat().st_mtime_ns if path else 0
    except OSError:
        return 0


class Follower:
    """Follows one rank's log file as it grows and passes new text on, decoding UTF-8 across reads."""

    def __init__(self, log_dir: Path, rank: int, stream: str, sink: Sink):
        self.log_dir, self.rank, self.stream, self.sink = log_dir, rank, stream, sink
        self.path: Path | None = None
        self.offset = 0
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def poll(self, final: bool = False) -> None:
        newest = find_rank_log(self.log_dir, self.rank, self.stream)
        if newest is None:
            return
        if newest != self.path:  # first sight, or torchrun restarted the workers
            self.path, self.offset = newest, 0
        with open(self.path, "rb") as fh:
            fh.seek(self.offset)
            data = fh.read()
        self.offset += len(data)
        text = self.decoder.decode(data, final=final)
        if text:
            self.sink(self.stream, text)

    def last_written(self) -> int:
        """When its file was last written (ns), for ``poll_in_written_order``."""
        return _modified_ns(self.path or find_rank_log(self.log_dir, self.rank, self.stream))


class _Notices:
    """Passes on each whole line another process appends to the job's notices (``records.NOTICES_FILE``)."""

    def __init__(self, path: Path, sink: Sink):
        self.path, self.sink, self.offset = path, sink, 0

    def poll(self, final: bool = False) -> None:
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self.offset)
                data = fh.read()
        except OSError:
            return
        whole = data[: data.rfind(b"\n") + 1]
        self.offset += len(whole)
        if whole:
            self.sink("stderr", whole.decode("utf-8", "replace"))

    def last_written(self) -> int:
        return _modified_ns(self.path)


class MetricsReader:
    """Reads the JSON lines rank 0's metrics callback appends."""

    def __init__(self, path: Path, callback: Callable[[dict], None] | None):
        self.path, self.callback = path, callback
        self.offset, self.pending, self.records = 0, b"", []

    def poll(self) -> None:
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self.offset)
                data = fh.read()
        except FileNotFoundError:
            return
        self.offset += len(data)
        *lines, self.pending = (self.pending + data).split(b"\n")
        for raw in lines:
            try:
                record = json.loads(raw)
            except ValueError:
                continue
            self._add(record)

    def _add(self, record: dict) -> None:
        self.records.append(record)
        if self.callback:
            self.callback(record)

    def add_last_step(self) -> None:
        """A final "step" record for the last step rank 0 completed, when the "step" lines (written at most
        every ``metrics.STEP_INTERVAL_S``) stopped short of it."""
        last = records.read_last_step(self.path)
        seen = max((int(r.get("step") or 0) for r in self.records), default=0)
        if last and last[0] > seen:
            self._add({"event": records.Event.STEP, "step": last[0], "max_steps": last[1], "time": time.time()})
