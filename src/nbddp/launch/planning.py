"""Plan a job: its run directory, torchrun's command line and environment from the checked ``RunOptions``, its
installs, and where torchrun lays out each rank's files in the run directory.

A single-node job gets torchrun's ``--standalone`` rendezvous on a free port; a multi-node one the
arguments ``options.node_args`` gives. The ranks find the records they write through the environment the plan
sets (``NBDDP_METRICS``, ``NBDDP_FAILURES``, ``NBDDP_RUN_DIR``; file names from ``runtime.records``).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from .. import guard
from ..errors import LaunchError
from ..options import RunOptions
from ..runtime import records, selflaunch, shell_lines

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
        return self.run_dir / records.METRICS_FILE

    @property
    def failures_path(self) -> Path:
        """torch elastic's failure record, written by ``nbddp.agent`` when a rank fails."""
        return self.run_dir / records.FAILURES_FILE


def default_nproc() -> int:
    """One process per visible GPU; two on a machine without GPUs (CPU/gloo): ``gpus.Machine.processes``, the
    one place that decides it, on a fresh reading (a job passes the ``nproc`` its plan decided instead)."""
    from ..gpus import read_machine

    return read_machine(memory=False).processes()


def new_run_dir(base: str | os.PathLike, name: str) -> Path:
    """A fresh, private (0700) run directory ``base/YYYYmmdd-HHMMSS-name[-k]``; a ``LaunchError`` naming the
    folder where it cannot be made."""
    base = Path(base)
    try:
        base.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise LaunchError(f"cannot make a run directory under {base} ({exc.strerror or exc}): --runs-dir or "
                          "NBDDP_RUNS chooses where run directories go") from None
    stem = time.strftime("%Y%m%d-%H%M%S") + "-" + re.sub(r"[^A-Za-z0-9_.-]+", "_", name)[:40]
    for k in range(1000):
        path = base / (stem if k == 0 else f"{stem}-{k}")
        try:
            path.mkdir(mode=0o700)
            guard.remember_run_dir(path)  # an internal error from here on saves its traceback there
            return path
        except FileExistsError:
            continue
    raise LaunchError(f"cannot make a run directory under {base}")


def plan(
    script: str | os.PathLike,
    run_dir: str | os.PathLike,
    options: RunOptions | None = None,
    *,
    nproc: int | None = None,
    cwd: str | os.PathLike | None = None,
    env: dict[str, str] | None = None,
) -> LaunchPlan:
    """The torchrun command and environment for a script. Arguments are argv items, never shell text.

    ``options`` are the run options, checked when they were made (a busy ``--master-port`` among them);
    from them come torchrun's arguments (``RunOptions.torchrun_argv``), ``collective_timeout_s``, which
    bounds each collective (``NBDDP_TIMEOUT``, the process group's timeout), ``timeout_s``, the whole job's,
    and ``resume`` (``trainer.train()`` continues from the last checkpoint). What the job decided from them
    is passed beside: ``nproc`` (a job's plan decided it, ``job_plan.JobPlan.processes``; default, for a plan
    made without a job: ``options.nproc``, else one per GPU) and ``env``, the ranks' own
    variables (default: ``options.rank_env``). A single-node job gets torchrun's ``--standalone``
    rendezvous, which listens on a free port, so jobs side by side and a busy 29500 never collide.
    """
    options = options or RunOptions()
    nproc = (options.nproc if nproc is None else nproc) or default_nproc()
    env = options.rank_env if env is None else env
    script, run_dir = Path(script).resolve(), Path(run_dir).resolve()
    extra = list(options.torchrun_argv)
    rendezvous = selflaunch.rendezvous(extra)
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
    src_root = str(Path(__file__).resolve().parents[2])  # so ranks import this nbddp, installed or not
    full_env["PYTHONPATH"] = os.pathsep.join(p for p in (src_root, full_env.get("PYTHONPATH", "")) if p)
    full_env.setdefault("PYTHONUNBUFFERED", "1")
    full_env["NBDDP_METRICS"] = str(run_dir / records.METRICS_FILE)
    full_env["NBDDP_RUN_DIR"] = str(run_dir)
    full_env["NBDDP_FAILURES"] = str(run_dir / records.FAILURES_FILE)
    full_env["NBDDP_LAUNCHER_PID"] = str(os.getpid())
    full_env.update(options.job_env)  # NBDDP_TIMEOUT, NBDDP_RESUME
    return LaunchPlan(
        argv=tuple(argv), env=full_env, cwd=Path(cwd or script.parent).resolve(), run_dir=run_dir,
        script=script, nproc=nproc, timeout_s=options.timeout_s,
    )


def run_installs(commands: Iterable, sink: Sink | None = None, replace_stack: bool | None = None) -> None:
    """Run each install once, in this process's Python environment (``pip`` → ``python -m pip``).

    ``commands``: argument lists, or the script's ``Install``s (a failure then names the install's cell and line).
    An install that would replace the running torch or CUDA stack (``stack_replacement``) is named and
    skipped: the ranks would start on a half-replaced torch. ``replace_stack`` (default: ``NBDDP_REPLACE_TORCH=1``)
    runs it anyway.
    """
    if replace_stack is None:
        replace_stack = shell_lines.replace_stack_allowed()
    say = sink or stdout_sink
    for command in commands:
        argv, where = (command.argv(), f"cell {command.cell}, line {command.line}: ") if hasattr(command, "argv") \
            else (command, "")
        guard_modules = getattr(command, "unless_importable", ())
        if guard_modules and _all_importable(guard_modules):
            say("stdout", f"nbddp: {where}not installing `{' '.join(argv)}`: {', '.join(guard_modules)} imports here, "
                          f"and the notebook installs it only where the import fails\n")
            continue
        reason = None if replace_stack else shell_lines.stack_replacement(argv)
        if reason:
            say("stdout", f"nbddp: not installing `{' '.join(argv)}`: {reason} (NBDDP_REPLACE_TORCH=1 installs it)\n")
            continue
        argv = selflaunch.install_argv(argv)
        say("stdout", f"nbddp: installing: {' '.join(argv)}\n")
        proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if proc.returncode:
            raise LaunchError(f"{where}the notebook's install failed before launch (exit {proc.returncode}): "
                              f"{' '.join(argv)}; nbddp runs the notebook's installs once before launch (one in an "
                              f"`except ImportError:` only where that import fails). Fix the line, or pass --skip-installs to "
                              f"run without them where the packages are here already\n{proc.stdout[-2000:]}")


def _all_importable(modules: Iterable[str]) -> bool:
    """Whether each module is found by this Python, the ranks' (an earlier install may just have added it)."""
    import importlib
    import importlib.util

    importlib.invalidate_caches()
    try:
        return all(importlib.util.find_spec(name) is not None for name in modules)
    except (ImportError, ValueError):
        return False


def find_rank_log(log_dir: Path, rank: int, stream: str = "stdout") -> Path | None:
    """The newest attempt's log of a local rank: ``<log_dir>/<run id>/attempt_N/<rank>/<stream>.log``."""
    found = sorted(log_dir.glob(f"*/attempt_*/{rank}/{stream}.log"), key=attempt)
    return found[-1] if found else None


def attempt(path: Path) -> int:
    """The attempt a file under the log directory belongs to (torchrun restarts count up from 0)."""
    m = re.search(r"attempt_(\d+)", str(path))
    return int(m.group(1)) if m else 0


def newest_attempt(log_dir: Path, name: str) -> list[Path]:
    """``<log_dir>/<run id>/attempt_N/<local rank>/<name>`` files of the newest attempt only."""
    found = list(log_dir.glob(f"*/attempt_*/*/{name}"))
    newest = max((attempt(p) for p in found), default=None)
    return [p for p in found if attempt(p) == newest]


def stdout_sink(stream: str, text: str) -> None:
    """The sink when none is given: this process's stdout and stderr."""
    out = sys.stdout if stream == "stdout" else sys.stderr
    out.write(text)
    out.flush()
