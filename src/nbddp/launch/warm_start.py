"""Agents forked from a warm process of the launcher's, in place of a fresh ``python -m nbddp.agent`` per job.

Where ranks are forked from the agent (``agent/forked_ranks``: Linux), the agent first imports what every
rank imports (torch, ``torch._dynamo``, with transformers ``torch._inductor``): 4–5 CPU seconds at every launch
(``benchmarks/results/warm_start.md``). A launcher that lives on after a job (a kernel running ``%%ddp_train`` again,
a Python program calling ``run_job``) makes those imports once: its first job starts a warm process
(``agent/warm.py``) that imports them and forks that job's agent, and each later job's agent is forked from it
too. ``nbddp run`` launches once and goes without (``not_for_one_launch``).

A warm process serves the jobs that would import the same in the same way: those whose agent would preload the
same modules (``preload_for`` of the script), and whose environment agrees with the one it started with in every
variable an interpreter's start or those imports read (``STARTUP``: ``PYTHON*``, ``TORCH*``, thread counts, the
loader's, CUDA's; ``HOME``). Any other job, or one launched from a thread other than the main one (the warm process
dies with the thread that started it), gets a fresh agent as before, as does every job where the warm process
cannot start or answer. ``NBDDP_WARM_START=0`` turns it off.

What the launcher holds is a ``ReportedChild`` (``agent/forker.py``, as torchrun holds the ranks the forker
forks): ``pid``, ``poll``, ``wait``, ``returncode``, ``send_signal``, ``terminate`` and ``kill``, as of the
``Popen`` a fresh agent would be; the agent's exit status comes from the warm process, which reaps it.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import subprocess
import sys
import threading
from pathlib import Path

from ..agent.forker import ReportedChild, running

#: The switch: ``NBDDP_WARM_START=0`` starts a fresh agent for every job.
SWITCH = "NBDDP_WARM_START"
#: Variables an interpreter's start or the preloaded imports read: a warm process serves only jobs that agree
#: with it on every one of them.
STARTUP = ("PYTHON", "TORCH", "PYTORCH", "OMP_", "MKL_", "KMP_", "GOMP_", "OPENBLAS_", "LD_", "CUDA", "NVIDIA_",
           "HIP_", "ROCR_", "TRITON")
#: Seconds the warm process may take to answer a job (its first answer waits for its imports).
ANSWER_S = 120.0
#: Seconds it may take to report an agent that has exited.
REPORT_S = 5.0

_wanted = True
_warm: dict[tuple, "_WarmProcess"] = {}
#: Keys whose warm process answered a job with a refusal: their jobs get fresh agents from then on, rather than a
#: warm process started again for each (its imports are seconds).
_refused: set[tuple] = set()
_lock = threading.Lock()


@contextlib.contextmanager
def not_for_one_launch():
    """Fresh agents only, while in it: a launcher that launches once (``nbddp run``) gains nothing from a warm
    process, which would import what its one agent does."""
    global _wanted
    before, _wanted = _wanted, False
    try:
        yield
    finally:
        _wanted = before


def start_agent(plan, log: Path) -> ReportedChild | None:
    """The plan's agent forked from a warm process, its output appended to ``log``; None where this job gets a
    fresh agent (``usable_for``), or the warm process could not start or answer."""
    names = usable_for(plan)
    if names is None:
        return None
    key = (names, startup_environment(plan.env))
    with _lock:
        if key in _refused:
            return None
        warm = _warm.get(key)
        if warm is None or warm.gone or warm.owner != os.getpid():  # a forked launcher's copy is not its own
            try:
                warm = _warm[key] = _WarmProcess(plan.env, names)
            except OSError:
                return None
        try:
            return warm.fork_agent(plan, log)
        except Refused:
            _refused.add(key)
        except (OSError, ValueError, queue.Empty):
            pass
        warm.close()
        del _warm[key]
        return None


def usable_for(plan) -> tuple[str, ...] | None:
    """What the plan's agent would preload, where a warm process may fork it; else None."""
    from ..agent import forked_ranks, preload
    from ..runtime import settings

    switched_off = settings.parse(settings.BY_NAME[SWITCH], plan.env.get(SWITCH)) is False
    if not _wanted or switched_off or not forked_ranks.enabled(plan.env):
        return None
    if threading.current_thread() is not threading.main_thread():
        return None
    if tuple(plan.argv[:3]) != (sys.executable, "-m", "nbddp.agent"):
        return None
    return tuple(preload.PRELOAD) + preload.preload_for(str(plan.script))


def startup_environment(env: dict[str, str]) -> tuple:
    return tuple(sorted((k, v) for k, v in env.items() if k.startswith(STARTUP) or k == "HOME"))


class Refused(OSError):
    """The warm process will fork no agent for any job (``agent/warm._why_not_fork``)."""


class _WarmProcess:
    """One warm process: jobs written to its stdin, the agents' pids and exit statuses read from its stdout."""

    def __init__(self, env: dict[str, str], names: tuple[str, ...]):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "nbddp.agent.warm", *names], env=env, cwd="/", stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True,
        )
        self.gone = False
        self.owner = os.getpid()
        self._answers: queue.Queue = queue.Queue()
        self._ended: dict[int, int] = {}
        self._changed = threading.Condition()
        threading.Thread(target=self._read, daemon=True, name="nbddp-warm-start").start()

    def fork_agent(self, plan, log: Path) -> ReportedChild:
        job = {"argv": list(plan.argv[3:]), "env": dict(plan.env), "cwd": str(plan.cwd), "log": str(log)}
        self.proc.stdin.write((json.dumps(job) + "\n").encode())
        self.proc.stdin.flush()
        answer = self._answers.get(timeout=ANSWER_S)
        if "pid" not in answer:
            raise (Refused if answer.get("refused") else OSError)(answer.get("error", "no agent"))
        return ReportedChild(int(answer["pid"]), tuple(plan.argv), self)

    def exit_status(self, pid: int) -> int | None:
        """The agent's exit status once it ended, as ``Popen.poll`` would say it: an agent that has exited is
        waited for until the warm process reports it (it reaps every ``warm.REAP_S``), so a caller that saw it
        gone never hears it is still running. Where the warm process ended first (killed with its launcher's job,
        say), SIGTERM's, which it gave its agents, once the agent is gone."""
        with self._changed:
            if pid not in self._ended and not self.gone and not running(pid):
                self._changed.wait_for(lambda: pid in self._ended or self.gone, REPORT_S)
            if pid in self._ended:
                return self._ended[pid]
            gone = self.gone
        if gone and not running(pid):
            return -15
        return None

    def returncode(self, pid: int, timeout: float = 0.0) -> int | None:
        """``exit_status``, after waiting up to ``timeout`` seconds for the agent's end to be reported."""
        if timeout:
            self.wait_for(pid, timeout)
        return self.exit_status(pid)

    def wait_for(self, pid: int, timeout: float | None) -> None:
        with self._changed:
            self._changed.wait_for(lambda: pid in self._ended or self.gone, timeout)

    def close(self) -> None:
        self.gone = True
        try:
            self.proc.kill()
            self.proc.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            pass

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                message = json.loads(line)
            except ValueError:
                continue
            if "ended" in message:
                with self._changed:
                    self._ended[int(message["ended"])] = int(message["code"])
                    self._changed.notify_all()
            else:
                self._answers.put(message)
        with self._changed:
            self.gone = True
            self._changed.notify_all()
        self._answers.put({"error": "the warm process ended"})
        self.proc.wait()
