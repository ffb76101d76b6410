"""Agents forked from a warm process of the launcher's (``launch/warm_start.py``).

What the ranks of such an agent see is ``tests/test_forked_ranks.py``'s (the same report as from a fresh agent,
two jobs from one warm process). Here: which jobs a warm process may serve, and that it leaves no process behind
when its launcher ends, whether the launcher exits or is killed while a job runs.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from conftest import NEEDS_FORKED_RANKS
from nbddp.agent import preload
from nbddp.launch import LaunchPlan, warm_start

ROOT = Path(__file__).resolve().parent.parent


def plan_for(tmp_path: Path, code: str = "print('hello')\n", **env) -> LaunchPlan:
    script = tmp_path / "script.py"
    script.write_text(code)
    argv = (sys.executable, "-m", "nbddp.agent", "--standalone", "--nproc_per_node=2", f"--log-dir={tmp_path / 'logs'}",
            "--redirects=3", str(script))
    return LaunchPlan(argv=argv, env={**os.environ, **env}, cwd=tmp_path, run_dir=tmp_path, script=script, nproc=2)


@NEEDS_FORKED_RANKS
def test_a_warm_process_serves_the_jobs_whose_agent_would_import_the_same(tmp_path, monkeypatch):
    monkeypatch.setattr(warm_start, "_wanted", True)
    plain = warm_start.usable_for(plan_for(tmp_path))
    assert plain == (*preload.PRELOAD, "torch._dynamo")
    # a script that sets a TORCH* variable: its agent preloads less, so another warm process serves it
    assert warm_start.usable_for(plan_for(tmp_path, "import os\nos.environ['TORCH_LOGS'] = '+dynamo'\n")) == \
        preload.PRELOAD
    # switched off, or ranks that start fresh: a fresh agent
    for switch in ("NBDDP_WARM_START", "NBDDP_FORK_RANKS"):
        assert warm_start.usable_for(plan_for(tmp_path, **{switch: "0"})) is None
    # a launch from another thread: the warm process would die with that thread
    answers = []
    thread = threading.Thread(target=lambda: answers.append(warm_start.usable_for(plan_for(tmp_path))))
    thread.start()
    thread.join()
    assert answers == [None]
    # a launcher that launches once
    with warm_start.not_for_one_launch():
        assert warm_start.usable_for(plan_for(tmp_path)) is None


@NEEDS_FORKED_RANKS
def test_nbddp_run_goes_without_and_leaves_the_process_as_it_was(tmp_path, monkeypatch):
    """``nbddp run`` launches once; called in a process that launches on (a test, a program), it does not leave
    that process without its warm start."""
    from nbddp import cli, job
    from nbddp.errors import NbddpError

    seen = []

    def run_job(*args, **kwargs):
        seen.append(warm_start.usable_for(plan_for(tmp_path)))
        raise NbddpError("stopped here")

    monkeypatch.setattr(job, "run_job", run_job)
    nb = tmp_path / "nb.ipynb"
    nb.write_text('{"cells": [], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}')
    assert cli.main(["run", str(nb), "--nproc", "2"]) == 2
    assert seen == [None]
    assert warm_start.usable_for(plan_for(tmp_path)) == (*preload.PRELOAD, "torch._dynamo")


def test_only_what_an_interpreters_start_reads_tells_warm_processes_apart():
    base = {"PATH": "/bin", "HOME": "/root", "PYTHONPATH": "/src", "OMP_NUM_THREADS": "1"}
    key = warm_start.startup_environment(base)
    for name in ("NBDDP_RUN_DIR", "PYTEST_CURRENT_TEST", "WANDB_MODE", "PATH"):  # read later, or by no import
        assert warm_start.startup_environment({**base, name: "x"}) == key
    for name in ("PYTHONHASHSEED", "PYTHONPATH", "TORCH_LOGS", "PYTORCH_CUDA_ALLOC_CONF", "OMP_NUM_THREADS",
                 "MKL_NUM_THREADS", "LD_PRELOAD", "CUDA_VISIBLE_DEVICES", "HOME"):
        assert warm_start.startup_environment({**base, name: "other"}) != key


#: A launcher that starts one job from a warm process, says the pids, then exits or waits to be killed.
LAUNCHER = r'''
import sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from test_warm_start import plan_for
from nbddp.launch import warm_start
plan = plan_for(Path(sys.argv[2]), "import time\nprint('up', flush=True)\ntime.sleep(%s)\n" % sys.argv[3])
agent = warm_start.start_agent(plan, plan.run_dir / "torchrun.log")
(warm,) = warm_start._warm.values()
print(warm.proc.pid, agent.pid, flush=True)
if sys.argv[3] == "0":
    print("exit status", agent.wait(120), flush=True)
else:
    time.sleep(120)
'''


def _launcher(tmp_path: Path, sleep_s: int) -> tuple[subprocess.Popen, psutil.Process, psutil.Process]:
    proc = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(ROOT / "tests"), str(tmp_path), str(sleep_s)],
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    warm, agent = map(int, proc.stdout.readline().split())
    return proc, psutil.Process(warm), psutil.Process(agent)


def _gone(procs: list[psutil.Process], within_s: float) -> list[psutil.Process]:
    deadline = time.monotonic() + within_s
    alive = procs
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    return alive


@pytest.mark.e2e
@NEEDS_FORKED_RANKS
def test_the_warm_process_ends_when_its_launcher_exits(tmp_path):
    proc, warm, agent = _launcher(tmp_path, 0)
    assert agent.ppid() == warm.pid and warm.ppid() == proc.pid
    out, _ = proc.communicate(timeout=120)
    assert out.strip() == "exit status 0"  # the agent's own, from the warm process that reaped it
    assert not _gone([warm], within_s=5)
    logs = sorted((tmp_path / "logs").glob("*/attempt_0/*/stdout.log"))
    assert [p.read_text() for p in logs] == ["up\n", "up\n"]


@pytest.mark.e2e
@NEEDS_FORKED_RANKS
def test_a_launcher_killed_mid_job_leaves_no_warm_process_agent_or_rank(tmp_path):
    proc, warm, agent = _launcher(tmp_path, 120)
    deadline = time.monotonic() + 60
    while len(sorted((tmp_path / "logs").glob("*/attempt_0/*/stdout.log"))) < 2 or \
            any(p.read_text() != "up\n" for p in (tmp_path / "logs").glob("*/attempt_0/*/stdout.log")):
        assert time.monotonic() < deadline, "the ranks never started"
        time.sleep(0.1)
    family = agent.children(recursive=True)  # the forker (agent/forker.py) and the ranks it forked
    forkers = agent.children()
    assert len(forkers) == 1 and len([p for p in family if p not in forkers]) == 2
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    alive = _gone([warm, agent, *family], within_s=15)
    assert not alive, [(p.pid, " ".join(p.cmdline())) for p in alive]


@pytest.mark.e2e
@NEEDS_FORKED_RANKS
def test_a_warm_process_whose_imports_initialized_cuda_forks_no_agent_and_is_not_started_again(tmp_path, monkeypatch):
    """An agent forked from a process whose CUDA driver is initialized could not use CUDA (torchrun's agent does,
    where there are GPUs): such a warm process refuses, the job gets a fresh agent, and so do later jobs, without
    a warm process started again for each. The driver is said initialized here by a site customization (this
    machine has none to initialize)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "from nbddp.agent import forked_ranks\nforked_ranks.cuda_driver_initialized = lambda: True\n")
    started = []

    def counted(env, names):
        started.append(names)
        return real(env, names)

    real = warm_start._WarmProcess
    monkeypatch.setattr(warm_start, "_WarmProcess", counted)
    monkeypatch.setattr(warm_start, "_wanted", True)
    monkeypatch.setattr(warm_start, "_warm", {})
    monkeypatch.setattr(warm_start, "_refused", set())
    plan = plan_for(tmp_path, PYTHONPATH=os.pathsep.join([str(site), str(ROOT / "src")]))
    assert warm_start.start_agent(plan, tmp_path / "torchrun.log") is None
    assert warm_start.start_agent(plan, tmp_path / "torchrun.log") is None
    assert len(started) == 1 and warm_start._warm == {}
    other = plan_for(tmp_path, PYTHONPATH=str(ROOT / "src"))  # another start-up environment: its own warm process
    agent = warm_start.start_agent(other, tmp_path / "torchrun.log")
    assert agent is not None and agent.wait(120) == 0
    for warm in warm_start._warm.values():
        warm.close()


def test_an_agent_seen_gone_is_never_said_to_be_running():
    """A kept job asks ``poll()`` after its ranks ended themselves (the idle limit): an agent that has exited, not
    yet reaped and reported by its warm process, is waited for as ``Popen.poll`` would reap it, not said to run."""
    warm = object.__new__(warm_start._WarmProcess)
    warm.gone, warm._ended, warm._changed = False, {}, threading.Condition()

    def report_later():
        time.sleep(0.3)
        with warm._changed:
            warm._ended[pid] = 0
            warm._changed.notify_all()

    pid = os.getpid() + 10_000_000  # no such process (above the kernel's pid limit)
    threading.Thread(target=report_later).start()
    agent = warm_start.ReportedChild(pid, ("agent",), warm)
    assert agent.poll() == 0


@NEEDS_FORKED_RANKS
def test_a_forked_launcher_starts_its_own_warm_process(tmp_path, monkeypatch):
    """A launcher forked from one that kept a warm process (``multiprocessing`` with fork) inherits the entry but
    not its reader: it starts a warm process of its own rather than write to the parent's."""
    started = []

    class Warm:
        gone = False

        def __init__(self, env, names):
            self.owner = os.getpid()
            started.append(self)

        def fork_agent(self, plan, log):
            return "agent"

    monkeypatch.setattr(warm_start, "_wanted", True)
    plan = plan_for(tmp_path)
    key = (warm_start.usable_for(plan), warm_start.startup_environment(plan.env))
    inherited = Warm(None, None)
    inherited.owner = os.getppid()
    monkeypatch.setattr(warm_start, "_warm", {key: inherited})
    monkeypatch.setattr(warm_start, "_WarmProcess", Warm)
    assert warm_start.start_agent(plan, tmp_path / "torchrun.log") == "agent"
    assert len(started) == 2 and warm_start._warm[key] is started[1]
