"""Start torchrun on a script, stream rank 0 live, keep every rank's log, and report failures by cell and line.

torchrun (started through ``nbddp.agent``, which is torchrun's own ``main`` plus a failure record) writes
each rank's stdout and stderr to files under the run directory (``--log-dir``, ``--redirects 3``). Three
records say how a job ended, all structured, none grepped from text:

- ``error.json`` per failed rank: its uncaught exception (torch elastic's error files, written by
  ``nbddp.runtime``'s excepthook);
- ``failures.json``: torch elastic's ``ChildFailedError`` — every failed rank's exit code or signal, the
  only trace of a rank killed by a signal;
- ``stacks.txt`` per rank: every thread's stack, dumped by ``faulthandler`` when the launcher asks before
  stopping the job (SIGUSR1), when the rank is stopped, or when it crashes — what a stuck rank was doing.

The launcher follows rank 0's files as they grow and hands new text to a sink, reads the metrics rank 0
writes, and when the job ends maps the root failure and the stacks back to notebook cells through the
script's source map. Whatever ends the wait — the job, an interrupt, a timeout — every process the job
started is gone before ``launch`` returns.
"""

from __future__ import annotations

import codecs
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import psutil

from .convert.script import SourceMap, map_path
from .errors import LaunchError
from .runtime import selflaunch, shell_lines
from .runtime.metrics import read_last_step

#: Seconds between two looks at the log files.
POLL_S = 0.05
#: Seconds the processes get to exit after SIGTERM before SIGKILL.
GRACE_S = 3.0
#: Seconds the ranks get to write their stacks before a timeout or an interrupt stops them.
STACKS_WAIT_S = 2.0

Sink = Callable[[str, str], None]  # (stream name "stdout"/"stderr", text)


@dataclass(frozen=True)
class LaunchPlan:
    """Everything needed to start one job: the command line, its environment, and where things go."""

    argv: tuple[str, ...]
    env: dict[str, str]
    cwd: Path
    run_dir: Path
    script: Path
    nproc: int
    timeout_s: float | None = None

    @property
    def log_dir(self) -> Path:
        return self.run_dir / "logs"

    @property
    def metrics_path(self) -> Path:
        return self.run_dir / "metrics.jsonl"

    @property
    def failures_path(self) -> Path:
        """torch elastic's failure record, written by ``nbddp.agent`` when a rank fails."""
        return self.run_dir / "failures.json"


@dataclass(frozen=True)
class RankFailure:
    """The rank whose failure ended the job: where, why, and its traceback with script lines mapped to cells.

    ``signal`` is set when the rank was killed by a signal (it then has no Python traceback; its cell and
    line, when known, come from the stack ``faulthandler`` dumped, e.g. on a segfault).
    """

    rank: int
    message: str
    traceback: str
    cell: int | None = None
    line: int | None = None
    source: str = ""
    exitcode: int | None = None
    signal: int | None = None

    def __str__(self) -> str:
        where = f" in cell {self.cell}, line {self.line}" if self.cell else ""
        src = f"\n    {self.source.strip()}" if self.source.strip() else ""
        what = f"was killed (signal {self.signal})" if self.signal else "failed"
        return f"rank {self.rank} {what}{where}: {self.message}{src}"


@dataclass(frozen=True)
class RankStack:
    """Where a rank was when it was stopped or crashed: its innermost notebook line and its stack dump."""

    rank: int
    cell: int | None
    line: int | None
    source: str
    stack: str

    def __str__(self) -> str:
        if self.cell is None:
            return f"rank {self.rank} was outside the notebook's code (see its stack in the run directory)"
        src = f": {self.source.strip()}" if self.source.strip() else ""
        return f"rank {self.rank} was at cell {self.cell}, line {self.line}{src}"


@dataclass(frozen=True)
class RunResult:
    """What a finished job left: exit code, where its files are, rank 0's training log."""

    returncode: int
    run_dir: Path
    script: Path
    duration_s: float
    log_history: tuple[dict, ...] = ()
    failure: RankFailure | None = None
    interrupted: bool = False
    timed_out: bool = False
    stacks: tuple[RankStack, ...] = ()  # where each stopped rank was, when the job did not finish by itself
    stopped_by: int | None = None  # SIGTERM or SIGHUP that stopped the launcher (then ``interrupted`` too)

    @property
    def ok(self) -> bool:
        """Finished by itself with exit code 0 (a job that was stopped may still have exited 0)."""
        return self.returncode == 0 and not self.interrupted and not self.timed_out

    @property
    def losses(self) -> list[float]:
        return [float(h["loss"]) for h in self.log_history if h.get("event") == "log" and "loss" in h]

    @property
    def last_step(self) -> tuple[int, int] | None:
        """The last Trainer step rank 0 reported, with the planned total: ``(step, max_steps)``."""
        steps = [h for h in self.log_history if "step" in h]
        return (int(steps[-1]["step"]), int(steps[-1].get("max_steps") or 0)) if steps else None

    def rank_log(self, rank: int, stream: str = "stdout") -> Path | None:
        return find_rank_log(self.run_dir / "logs", rank, stream)


def default_nproc() -> int:
    """One process per visible GPU; two on a machine without GPUs (CPU/gloo)."""
    try:
        import torch

        return torch.cuda.device_count() or 2
    except ImportError:
        return 2


def new_run_dir(base: str | os.PathLike, name: str) -> Path:
    """A fresh, private (0700) run directory ``base/YYYYmmdd-HHMMSS-name[-k]``."""
    base = Path(base)
    base.mkdir(parents=True, exist_ok=True)
    stem = time.strftime("%Y%m%d-%H%M%S") + "-" + re.sub(r"[^A-Za-z0-9_.-]+", "_", name)[:40]
    for k in range(1000):
        path = base / (stem if k == 0 else f"{stem}-{k}")
        try:
            path.mkdir(mode=0o700)
            return path
        except FileExistsError:
            continue
    raise LaunchError(f"cannot make a run directory under {base}")


def node_args(nnodes: int | str | None = None, node_rank: int | None = None, rdzv_endpoint: str | None = None) -> list[str]:
    """torchrun's multi-node arguments: ``--nnodes``, ``--node-rank``, and a c10d rendezvous at an endpoint.

    Every node runs the same job with the same ``nnodes`` and ``rdzv_endpoint`` (``host:port`` of one of
    them); the c10d rendezvous assigns ranks, ``node_rank`` only orders nodes under the static backend.
    """
    args = []
    if nnodes is not None:
        args.append(f"--nnodes={nnodes}")
    if node_rank is not None:
        args.append(f"--node-rank={node_rank}")
    if rdzv_endpoint:
        args += ["--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}"]
    return args


def plan(
    script: str | os.PathLike,
    run_dir: str | os.PathLike,
    *,
    nproc: int | None = None,
    torchrun_args: Iterable[str] = (),
    cwd: str | os.PathLike | None = None,
    env: dict[str, str] | None = None,
    timeout_s: float | None = None,
    collective_timeout_s: float | None = None,
    resume: bool = False,
) -> LaunchPlan:
    """The torchrun command and environment for a script. Arguments are argv items, never shell text.

    A single-node job gets torchrun's ``--standalone`` rendezvous, which listens on a free port, so jobs
    side by side and a busy 29500 never collide. A ``--master-port`` the user chose is checked first:
    busy, it is a ``LaunchError`` rather than a rendezvous that fails or hangs later.
    ``collective_timeout_s`` bounds each collective (``NBDDP_TIMEOUT``, the process group's timeout);
    ``timeout_s`` the whole job. ``resume`` lets ``trainer.train()`` continue from the last checkpoint.
    """
    script, run_dir = Path(script).resolve(), Path(run_dir).resolve()
    nproc = nproc or default_nproc()
    extra = list(torchrun_args)
    rendezvous = selflaunch.rendezvous(extra)
    check_master_port(extra)
    argv = (
        sys.executable, "-m", "nbddp.agent",
        *rendezvous,
        f"--nproc_per_node={nproc}",
        f"--log-dir={run_dir / 'logs'}",
        "--redirects=3",
        *extra,
        str(script),
    )
    full_env = dict(os.environ)
    full_env.update(env or {})
    src_root = str(Path(__file__).resolve().parent.parent)  # so ranks import this nbddp, installed or not
    full_env["PYTHONPATH"] = os.pathsep.join(p for p in (src_root, full_env.get("PYTHONPATH", "")) if p)
    full_env.setdefault("PYTHONUNBUFFERED", "1")
    full_env["NBDDP_METRICS"] = str(run_dir / "metrics.jsonl")
    full_env["NBDDP_RUN_DIR"] = str(run_dir)
    full_env["NBDDP_FAILURES"] = str(run_dir / "failures.json")
    full_env["NBDDP_LAUNCHER_PID"] = str(os.getpid())
    if collective_timeout_s:
        full_env["NBDDP_TIMEOUT"] = str(max(1, round(collective_timeout_s)))
    if resume:
        full_env["NBDDP_RESUME"] = "1"
    return LaunchPlan(
        argv=tuple(argv), env=full_env, cwd=Path(cwd or script.parent).resolve(), run_dir=run_dir,
        script=script, nproc=nproc, timeout_s=timeout_s,
    )


def check_master_port(torchrun_args: list[str]) -> None:
    """Refuse a user-chosen ``--master-port`` that is no port number, or that something on this machine
    already listens on.

    Busy is checked only for a single-node job: across nodes the port is on the master's host, not
    necessarily this one.
    """
    port = _arg_value(torchrun_args, "master-port")
    if port is not None and not (port.isdigit() and 1 <= int(port) <= 65535):
        raise LaunchError(f"--master-port takes a port number from 1 to 65535, not {port!r}")
    if _arg_value(torchrun_args, "nnodes") not in (None, "1", "1:1"):
        return
    if port and not port_is_free(int(port)):
        raise LaunchError(
            f"port {port} (--master-port) is already in use on this machine; "
            "leave --master-port out and torchrun picks a free port"
        )


def _arg_value(args: list[str], name: str) -> str | None:
    """The last value of a torchrun option, given as ``--name=v`` or ``--name v`` (``-`` or ``_`` inside)."""
    pattern = re.compile("--" + re.escape(name).replace("\\-", "[-_]") + r"(?:=(.*))?")
    value = None
    for i, a in enumerate(args):
        m = pattern.fullmatch(a)
        if m:
            value = m.group(1) if m.group(1) is not None else (args[i + 1] if i + 1 < len(args) else None)
    return value


def port_is_free(port: int) -> bool:
    """True when a server could listen on ``port`` on every interface, as torchrun's TCPStore does."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("", port))
        except OSError:
            return False
    return True


def run_installs(commands: Iterable[list[str]], sink: Sink | None = None, replace_stack: bool | None = None) -> None:
    """Run each install once, in this process's Python environment (``pip`` → ``python -m pip``).

    An install that would replace the running torch or CUDA stack (``stack_replacement``) is named and
    skipped: the ranks would start on a half-replaced torch. ``replace_stack`` (default: ``NBDDP_REPLACE_TORCH=1``)
    runs it anyway.
    """
    if replace_stack is None:
        replace_stack = shell_lines.replace_stack_allowed()
    say = sink or _stdout_sink
    for argv in commands:
        reason = None if replace_stack else shell_lines.stack_replacement(argv)
        if reason:
            say("stdout", f"nbddp: not installing `{' '.join(argv)}`: {reason} (NBDDP_REPLACE_TORCH=1 installs it)\n")
            continue
        argv = selflaunch.install_argv(argv)
        say("stdout", f"nbddp: installing: {' '.join(argv)}\n")
        proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if proc.returncode:
            raise LaunchError(f"install failed (exit {proc.returncode}): {' '.join(argv)}\n{proc.stdout[-2000:]}")


def launch(plan: LaunchPlan, sink: Sink | None = None, on_metrics: Callable[[dict], None] | None = None) -> RunResult:
    """Run the plan to the end; stream rank 0 to ``sink``; leave no process behind whatever happens.

    A Ctrl-C (``KeyboardInterrupt``), SIGTERM or SIGHUP (a scheduler's stop, a closed terminal) or the
    plan's timeout stops every rank; another of those signals while they are being stopped is held back until
    they are gone, so it cannot leave ranks running. A SIGTERM or SIGHUP that would have ended this process
    ends it once the ranks are gone and the stop is reported (``_StopSignals``).
    """
    sink = sink or _stdout_sink
    plan.log_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with open(plan.run_dir / "torchrun.log", "wb") as agent_log:
        try:
            proc = subprocess.Popen(
                plan.argv, cwd=plan.cwd, env=plan.env, stdout=agent_log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )
        except OSError as exc:
            raise LaunchError(f"cannot start torchrun: {exc}") from None
        followers = [_Follower(plan.log_dir, 0, stream, sink) for stream in ("stdout", "stderr")]
        metrics = _MetricsReader(plan.metrics_path, on_metrics)
        interrupted = timed_out = False
        with _StopSignals() as stop:
            try:
                while proc.poll() is None:
                    for f in followers:
                        f.poll()
                    metrics.poll()
                    if plan.timeout_s and time.monotonic() - started > plan.timeout_s:
                        timed_out = True
                        break
                    time.sleep(POLL_S)
            except KeyboardInterrupt:
                interrupted = True
            finally:
                stop.waiting = False  # from here a stop signal is only noted
                with _interrupts_held() as held:
                    if (timed_out or interrupted) and proc.poll() is None:
                        ask_for_stacks(proc, plan.log_dir)
                    terminate_tree(proc)
                interrupted = interrupted or bool(held)
                stop.note(next((h for h in held if h != signal.SIGINT), None))
                stopped_by = stop.received
        for f in followers:
            f.poll(final=True)
        metrics.poll()
        metrics.add_last_step()
    code = proc.returncode
    failure, stacks = None, ()
    if code != 0 or timed_out or interrupted:
        stacks = read_stacks(plan.log_dir, plan.script, _read_map(plan.script))
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
    )
    if interrupted or timed_out:  # a hang is often ended this way: say where each rank was
        what = "interrupted" if interrupted else f"timed out after {plan.timeout_s:.0f} s"
        if stopped_by:
            what = f"stopped by {signal.Signals(stopped_by).name}"
        where = "".join(f"nbddp:   {line}\n" for line in where_ranks_were(result))
        run_dir = f"nbddp:   run directory: {plan.run_dir}\n" if stopped_by else ""
        with contextlib.suppress(OSError):  # a closed terminal (SIGHUP) cannot be written to
            sink("stderr", f"\nnbddp: {what}; every rank has been stopped.\n{where}{run_dir}")
    stop.pass_on()
    return result


def where_ranks_were(result: RunResult) -> list[str]:
    """Lines saying where each stopped rank was in the notebook and the last Trainer step, for a failure or a
    timeout. Ranks stopped outside the notebook's code (starting up, shutting down) are left out."""
    lines = [str(st) for st in result.stacks if st.cell is not None]
    if result.last_step:
        step, total = result.last_step
        lines.append(f"last Trainer step: {step}" + (f" of {total}" if total else ""))
    return lines


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
    (``runtime.dist``). Only pids of processes under ``proc`` are signalled.
    """
    if not hasattr(signal, "SIGUSR1"):
        return
    try:
        family = {p.pid for p in psutil.Process(proc.pid).children(recursive=True)}
    except psutil.NoSuchProcess:
        return
    asked = []
    for path in _newest_attempt(log_dir, "stacks.txt"):
        try:
            header = path.read_text(errors="replace").partition("\n")[0]
        except OSError:
            continue
        m = re.search(r"\(pid (\d+)\)", header)
        if m and int(m.group(1)) in family:
            with contextlib.suppress(OSError):
                os.kill(int(m.group(1)), signal.SIGUSR1)
                asked.append(path)
    deadline = time.monotonic() + wait_s
    while asked and time.monotonic() < deadline:
        asked = [p for p in asked if not p.read_text(errors="replace").partition("\n")[2].strip()]
        time.sleep(POLL_S)
    time.sleep(POLL_S)  # a dump seen begun is written whole within the signal handler: let it end


def terminate_tree(proc: subprocess.Popen, grace_s: float = GRACE_S) -> None:
    """End torchrun and every process under it (its workers run in sessions of their own).

    SIGTERM first so torchrun and the ranks can clean up, SIGKILL for whatever is left after ``grace_s``.
    """
    try:
        parent = psutil.Process(proc.pid)
        family = [parent] + parent.children(recursive=True)
    except psutil.NoSuchProcess:
        family = []
    if proc.poll() is None or any(p.is_running() for p in family[1:]):
        for p in family:
            _signal(p, signal.SIGTERM)
        _, alive = psutil.wait_procs(family, timeout=grace_s)
        for p in alive:
            _signal(p, signal.SIGKILL)
        psutil.wait_procs(alive, timeout=grace_s)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _signal(p: psutil.Process, sig: int) -> None:
    try:
        p.send_signal(sig)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        pass


def find_rank_log(log_dir: Path, rank: int, stream: str = "stdout") -> Path | None:
    """The newest attempt's log of a local rank: ``<log_dir>/<run id>/attempt_N/<rank>/<stream>.log``."""
    found = sorted(log_dir.glob(f"*/attempt_*/{rank}/{stream}.log"), key=lambda p: _attempt(p))
    return found[-1] if found else None


def _attempt(path: Path) -> int:
    m = re.search(r"attempt_(\d+)", str(path))
    return int(m.group(1)) if m else 0


class _Follower:
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


class _MetricsReader:
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
        last = read_last_step(self.path)
        seen = max((int(r.get("step") or 0) for r in self.records), default=0)
        if last and last[0] > seen:
            self._add({"event": "step", "step": last[0], "max_steps": last[1], "time": time.time()})


_FRAME = re.compile(r'^(\s*)File "(?P<file>[^"]+)", line (?P<line>\d+)(?P<rest>.*)$')
#: A frame in a ``faulthandler`` dump: ``  File "…", line N in func`` (no comma before "in").
_DUMP_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>.*)$')

#: A death by signal is stamped by torch elastic in whole seconds when its agent notices it (every 0.1 s).
#: It is taken as this much earlier than its stamp, so that an exception another rank raised within that
#: second — most often its consequence, a collective whose peer vanished — does not pass for the cause.
_SIGNAL_LEAD_S = 0.2

#: What a signal most likely means, for the ones a training job meets.
_SIGNAL_HINTS = {
    signal.SIGKILL: "killed outright, most often by the system running out of memory (the OOM killer)",
    signal.SIGSEGV: "crashed (segmentation fault) in native code",
    signal.SIGABRT: "aborted by native code: a failed check in a C++ or CUDA library, or NCCL's watchdog "
                    "ending a collective that timed out (the rank's log says which)",
    signal.SIGTERM: "stopped from outside the job",
    signal.SIGBUS: "crashed (bus error), often shared memory (/dev/shm) running out",
}


def _newest_attempt(log_dir: Path, name: str) -> list[Path]:
    """``<log_dir>/<run id>/attempt_N/<local rank>/<name>`` files of the newest attempt only."""
    found = list(log_dir.glob(f"*/attempt_*/*/{name}"))
    newest = max((_attempt(p) for p in found), default=None)
    return [p for p in found if _attempt(p) == newest]


def _read_map(script: Path) -> SourceMap | None:
    try:
        return SourceMap.from_json(map_path(script).read_text())
    except (OSError, ValueError):
        return None


def read_failure(log_dir: Path, script: Path, failures: Path | None = None) -> RankFailure | None:
    """The root-cause failure of the newest attempt, its traceback mapped to notebook cells.

    Candidates are every rank's ``error.json`` (an exception) and, from torch elastic's failure record
    (``failures``, written by ``nbddp.agent``), every rank that ended without one: killed by a signal, or
    exited non-zero without a Python traceback. The earliest is the root cause, but a rank ended by SIGTERM
    without an error file comes after all others: that is how torchrun stops the survivors.
    """
    smap = _read_map(script)
    candidates: dict[int, dict] = {}
    for path in _newest_attempt(log_dir, "error.json"):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        msg = data.get("message", {})
        if isinstance(msg, str):  # torch writes a string message for some failures
            msg = {"message": msg, "extraInfo": {}}
        info = msg.get("extraInfo", {})
        rank = int(info.get("rank", path.parent.name))
        when = float(info.get("time") or info.get("timestamp") or 0)
        candidates[rank] = dict(time=when, message=msg.get("message", ""), callstack=info.get("py_callstack", ""))
    for rec in _read_failure_record(failures):
        rank = rec["rank"]
        if rank in candidates:
            candidates[rank]["exitcode"] = rec["exitcode"]
            continue
        exitcode = int(rec["exitcode"])
        candidates[rank] = dict(time=rec["timestamp"] - _SIGNAL_LEAD_S, exitcode=exitcode, callstack="",
                                signal=-exitcode if exitcode < 0 else None, local_rank=rec.get("local_rank"))
    if not candidates:
        return None
    # torchrun stops the other ranks with SIGTERM once one fails: such deaths come last
    rank = min(candidates, key=lambda r: (candidates[r].get("signal") == signal.SIGTERM, candidates[r]["time"], r))
    c = candidates[rank]
    if c.get("signal"):
        return _signal_failure(rank, c, log_dir, script, smap)
    if not c.get("message"):
        message = f"exited with code {c['exitcode']} without a Python traceback (sys.exit or os._exit?)"
        return RankFailure(rank=rank, message=message, traceback="", exitcode=c["exitcode"])
    mapped, cell, line = map_traceback(c["callstack"], script, smap)
    source = _cell_line_text(script, smap, cell, line)
    return RankFailure(rank=rank, message=c["message"].strip(), traceback=mapped, cell=cell, line=line,
                       source=source, exitcode=c.get("exitcode"))


def _read_failure_record(path: Path | None) -> list[dict]:
    if path is None:
        return []
    try:
        return list(json.loads(path.read_text()).get("failures", []))
    except (OSError, ValueError, AttributeError):
        return []


def _signal_failure(rank: int, c: dict, log_dir: Path, script: Path, smap: SourceMap | None) -> RankFailure:
    """A rank killed by a signal: what the signal most likely means, and its stack when it could dump one."""
    number = c["signal"]
    try:
        name = signal.Signals(number).name
        hint = _SIGNAL_HINTS.get(signal.Signals(number), "")
    except ValueError:
        name, hint = f"signal {number}", ""
    message = name + (f": {hint}" if hint else "")
    stack = next((st for st in read_stacks(log_dir, script, smap) if st.rank == rank), None)
    if stack is None:
        return RankFailure(rank=rank, message=message, traceback="", exitcode=c["exitcode"], signal=number)
    return RankFailure(rank=rank, message=message, traceback=stack.stack, cell=stack.cell, line=stack.line,
                       source=stack.source, exitcode=c["exitcode"], signal=number)


def read_stacks(log_dir: Path, script: Path, smap: SourceMap | None) -> tuple[RankStack, ...]:
    """Each rank's ``faulthandler`` dump of the newest attempt, its innermost notebook frame located.

    Only the first dump of a file counts (the one the launcher asked for before stopping the job, or the one
    written when the rank was stopped or crashed). Of its threads, the one running the script's
    module-level code is the rank's main thread.
    """
    stacks = []
    for path in _newest_attempt(log_dir, "stacks.txt"):
        try:
            header, _, dump = path.read_text(errors="replace").partition("\n")
        except OSError:
            continue
        m = re.search(r"stacks of rank (\d+)", header)
        if not dump.strip() or not m:
            continue
        threads = re.split(r"\n(?=(?:Current thread|Thread) 0x)", dump.strip())
        main = next((t for t in threads if _script_frames(t, script) and "in <module>" in t), threads[0])
        mapped, cell, line = _map_dump(main, script, smap)
        stacks.append(RankStack(rank=int(m.group(1)), cell=cell, line=line,
                                source=_cell_line_text(script, smap, cell, line), stack=mapped))
    return tuple(sorted(stacks, key=lambda st: st.rank))


def _script_frames(dump: str, script: Path) -> list[re.Match]:
    found = (_DUMP_FRAME.match(text) for text in dump.splitlines())
    return [m for m in found if m and Path(m.group("file")).resolve() == script.resolve()]


def _map_dump(dump: str, script: Path, smap: SourceMap | None) -> tuple[str, int | None, int | None]:
    """Like ``map_traceback`` for a ``faulthandler`` dump, where the innermost frame comes first."""
    cell = line = None
    out = []
    for text in dump.splitlines():
        m = _DUMP_FRAME.match(text)
        hit = smap.lookup(int(m.group("line"))) if m and smap and Path(m.group("file")).resolve() == script.resolve() else None
        if hit:
            if cell is None:
                cell, line = hit
            text = f'  File "{smap.origin}", cell {hit[0]}, line {hit[1]} in {m.group("func")}'
        out.append(text)
    return "\n".join(out), cell, line


def map_traceback(traceback: str, script: Path, smap: SourceMap | None) -> tuple[str, int | None, int | None]:
    """Rewrite frames in the script as ``File "<notebook>", cell N, line L``; return the innermost such frame."""
    cell = line = None
    out = []
    for text in traceback.splitlines():
        m = _FRAME.match(text)
        if m and smap and Path(m.group("file")).resolve() == script.resolve():
            hit = smap.lookup(int(m.group("line")))
            if hit:
                cell, line = hit
                text = f'{m.group(1)}File "{smap.origin}", cell {cell}, line {line}{m.group("rest")}'
        out.append(text)
    return "\n".join(out), cell, line


def _cell_line_text(script: Path, smap: SourceMap | None, cell: int | None, line: int | None) -> str:
    if not smap or cell is None:
        return ""
    for n, (c, ln) in smap.lines.items():
        if (c, ln) == (cell, line):
            lines = script.read_text().splitlines()
            return lines[n - 1] if n <= len(lines) else ""
    return ""


def _stdout_sink(stream: str, text: str) -> None:
    out = sys.stdout if stream == "stdout" else sys.stderr
    out.write(text)
    out.flush()
