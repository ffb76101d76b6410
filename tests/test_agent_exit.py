"""torchrun's agent (``nbddp.agent``) ends without tearing its interpreter down once every rank ended well (a
second or more of each job on the 2-core machine), and once it has stopped them (0.7 s of each stop). Its exit handlers still run; a rank runs its own, the agent's
never, whether it started fresh or was forked from the agent (``nbddp.forked_ranks``)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

import nbddp
from conftest import NEEDS_FORKED_RANKS

pytestmark = pytest.mark.e2e

SRC = Path(nbddp.__file__).resolve().parent.parent

#: In every Python process of the job: one line at its exit handlers, one when its modules are torn down.
MARKER = '''
import atexit, os, sys
_role = "agent" if any(a.startswith("--nproc_per_node") for a in sys.argv) else "rank"
_fd = os.open(os.environ["MARKS"], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
atexit.register(os.write, _fd, f"{_role} atexit\\n".encode())


class _TornDown:
    def __del__(self, write=os.write, fd=_fd, line=f"{_role} teardown\\n".encode()):
        write(fd, line)


_torn_down = _TornDown()
'''


@pytest.mark.parametrize("forked", [False, pytest.param(True, marks=NEEDS_FORKED_RANKS)], ids=["fresh rank", "forked rank"])
def test_the_agent_runs_its_exit_handlers_but_skips_the_teardown_and_the_rank_exits_as_python_does(tmp_path, forked):
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(MARKER)
    (tmp_path / "job.py").write_text("print('rank done', flush=True)\n")
    marks = tmp_path / "marks.txt"
    env = {**os.environ, "MARKS": str(marks), "NBDDP_FORK_RANKS": "1" if forked else "0",
           "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), str(SRC), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-m", "nbddp.agent", "--standalone", "--nproc_per_node=1", f"--log-dir={tmp_path / 'logs'}",
         "--redirects=3", str(tmp_path / "job.py")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    lines = marks.read_text().splitlines()
    # each process runs its own exit handlers once: a forked rank none of the agent's
    assert lines.count("rank atexit") == 1 and lines.count("agent atexit") == 1, lines
    assert "agent teardown" not in lines
    # a fresh rank tears its modules down, the marker sees it; a forked one ends as the agent does, having
    # released the script's own objects (tests/test_forked_ranks.py)
    assert ("rank teardown" in lines) is not forked
    assert "rank done" in next(tmp_path.glob("logs/*/attempt_0/0/stdout.log")).read_text()


def test_a_failing_rank_still_ends_the_agent_as_torchrun_does(tmp_path):
    (tmp_path / "job.py").write_text("raise SystemExit(3)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
           "NBDDP_FAILURES": str(tmp_path / "failures.json")}
    proc = subprocess.run(
        [sys.executable, "-m", "nbddp.agent", "--standalone", "--nproc_per_node=1", f"--log-dir={tmp_path / 'logs'}",
         "--redirects=3", str(tmp_path / "job.py")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 1 and "ChildFailedError" in proc.stderr
    assert '"exitcode": 3' in (tmp_path / "failures.json").read_text()


def test_a_stopped_agent_stops_its_rank_and_ends_without_teardown(tmp_path):
    """SIGTERM (the launcher's stop, an interrupt, a timeout): torchrun stops the rank and raises its
    ``SignalException``; the agent reports it as Python reports an uncaught error and exits 1, its exit
    handlers run, its modules not torn down (0.7 s of a stop on a quiet machine, within the launcher's
    5-second bound)."""
    import signal
    import time

    import psutil

    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(MARKER)
    (tmp_path / "job.py").write_text("import os, time\nopen('started', 'w').write(str(os.getpid()))\ntime.sleep(600)\n")
    marks = tmp_path / "marks.txt"
    env = {**os.environ, "MARKS": str(marks),
           "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), str(SRC), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "nbddp.agent", "--standalone", "--nproc_per_node=1", f"--log-dir={tmp_path / 'logs'}",
         "--redirects=3", str(tmp_path / "job.py")],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "started").is_file() or not (tmp_path / "started").read_text():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else "slow"
            time.sleep(0.1)
        rank = int((tmp_path / "started").read_text())
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 1 and "SignalException" in err, err[-2000:]
    assert not psutil.pid_exists(rank) or psutil.Process(rank).status() == psutil.STATUS_ZOMBIE
    lines = marks.read_text().splitlines()
    assert lines.count("agent atexit") == 1, lines
    assert "agent teardown" not in lines, lines
