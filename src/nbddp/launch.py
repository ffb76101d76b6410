"""Start torchrun on a script, stream rank 0 live, keep every rank's log, and report failures by cell and line.

torchrun writes each rank's stdout and stderr to files under the run directory (``--log-dir``,
``--redirects 3``) and each failing rank's exception to an ``error.json`` (torch elastic's error files;
``nbddp.runtime`` records uncaught exceptions there). The launcher follows rank 0's files as they grow and
hands new text to a sink, reads the metrics rank 0 writes, and when the job ends maps the first failure's
traceback back to the notebook through the script's source map. Whatever ends the wait — the job, an
interrupt, a timeout — every process the job started is gone before ``launch`` returns.
"""

from __future__ import annotations

import codecs
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import psutil

from .convert.script import SourceMap, map_path
from .errors import LaunchError

#: Seconds between two looks at the log files.
POLL_S = 0.05
#: Seconds the processes get to exit after SIGTERM before SIGKILL.
GRACE_S = 3.0

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


@dataclass(frozen=True)
class RankFailure:
    """The first rank that failed: where, why, and its traceback with script lines mapped to cells."""

    rank: int
    message: str
    traceback: str
    cell: int | None = None
    line: int | None = None
    source: str = ""
    exitcode: int | None = None

    def __str__(self) -> str:
        where = f" in cell {self.cell}, line {self.line}" if self.cell else ""
        src = f"\n    {self.source.strip()}" if self.source.strip() else ""
        return f"rank {self.rank} failed{where}: {self.message}{src}"


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

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    @property
    def losses(self) -> list[float]:
        return [float(h["loss"]) for h in self.log_history if h.get("event") == "log" and "loss" in h]

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


def plan(
    script: str | os.PathLike,
    run_dir: str | os.PathLike,
    *,
    nproc: int | None = None,
    torchrun_args: Iterable[str] = (),
    cwd: str | os.PathLike | None = None,
    env: dict[str, str] | None = None,
    timeout_s: float | None = None,
) -> LaunchPlan:
    """The torchrun command and environment for a script. Arguments are argv items, never shell text."""
    script, run_dir = Path(script).resolve(), Path(run_dir).resolve()
    nproc = nproc or default_nproc()
    extra = list(torchrun_args)
    rendezvous = [] if any(a.startswith(("--nnodes", "--rdzv", "--master")) for a in extra) else ["--standalone"]
    argv = (
        sys.executable, "-m", "torch.distributed.run",
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
    return LaunchPlan(
        argv=tuple(argv), env=full_env, cwd=Path(cwd or script.parent).resolve(), run_dir=run_dir,
        script=script, nproc=nproc, timeout_s=timeout_s,
    )


def run_installs(commands: Iterable[list[str]], sink: Sink | None = None) -> None:
    """Run each install once, in this process's Python environment (``pip`` → ``python -m pip``)."""
    for argv in commands:
        if argv and re.fullmatch(r"pip[0-9.]*", argv[0]):
            argv = [sys.executable, "-m", "pip", *argv[1:]]
        (sink or _stdout_sink)("stdout", f"nbddp: installing: {' '.join(argv)}\n")
        proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if proc.returncode:
            raise LaunchError(f"install failed (exit {proc.returncode}): {' '.join(argv)}\n{proc.stdout[-2000:]}")


def launch(plan: LaunchPlan, sink: Sink | None = None, on_metrics: Callable[[dict], None] | None = None) -> RunResult:
    """Run the plan to the end; stream rank 0 to ``sink``; leave no process behind whatever happens."""
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
            terminate_tree(proc)
        for f in followers:
            f.poll(final=True)
        metrics.poll()
    code = proc.returncode
    failure = None
    if code != 0 and not interrupted:
        failure = read_failure(plan.log_dir, plan.script)
    if interrupted:
        sink("stderr", "\nnbddp: interrupted; every rank has been stopped.\n")
    if timed_out:
        sink("stderr", f"\nnbddp: timed out after {plan.timeout_s:.0f} s; every rank has been stopped.\n")
    return RunResult(
        returncode=code if code is not None else -1,
        run_dir=plan.run_dir,
        script=plan.script,
        duration_s=time.monotonic() - started,
        log_history=tuple(metrics.records),
        failure=failure,
        interrupted=interrupted,
        timed_out=timed_out,
    )


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
            self.records.append(record)
            if self.callback:
                self.callback(record)


_FRAME = re.compile(r'^(\s*)File "(?P<file>[^"]+)", line (?P<line>\d+)(?P<rest>.*)$')


def read_failure(log_dir: Path, script: Path) -> RankFailure | None:
    """The root-cause failure from torch elastic's error files, its traceback mapped to notebook cells."""
    errors = []
    for path in log_dir.glob("*/attempt_*/*/error.json"):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        msg = data.get("message", {})
        if isinstance(msg, str):  # torch writes a string message for some failures
            msg = {"message": msg, "extraInfo": {}}
        info = msg.get("extraInfo", {})
        stamp = int(info.get("timestamp", 0) or 0)
        errors.append((stamp, _attempt(path), int(path.parent.name), msg.get("message", ""), info.get("py_callstack", "")))
    if not errors:
        return None
    # newest attempt first, then the earliest failure within it
    errors.sort(key=lambda e: (-e[1], e[0]))
    _, _, rank, message, callstack = errors[0]
    try:
        smap = SourceMap.from_json(map_path(script).read_text())
    except (OSError, ValueError):
        smap = None
    mapped, cell, line = map_traceback(callstack, script, smap)
    source = _cell_line_text(script, smap, cell, line)
    return RankFailure(rank=rank, message=message.strip(), traceback=mapped, cell=cell, line=line, source=source)


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
