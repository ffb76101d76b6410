"""torchrun's agent (``nbddp.agent``) ends without tearing its interpreter down once every rank ended well: a
second or more of each job on the 2-core machine. Its exit handlers still run; a rank's exit is untouched."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

import nbddp

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


def test_the_agent_runs_its_exit_handlers_but_skips_the_teardown_and_the_rank_exits_as_python_does(tmp_path):
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(MARKER)
    (tmp_path / "job.py").write_text("print('rank done', flush=True)\n")
    marks = tmp_path / "marks.txt"
    env = {**os.environ, "MARKS": str(marks),
           "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), str(SRC), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-m", "nbddp.agent", "--standalone", "--nproc_per_node=1", f"--log-dir={tmp_path / 'logs'}",
         "--redirects=3", str(tmp_path / "job.py")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    lines = marks.read_text().splitlines()
    assert "rank atexit" in lines and "rank teardown" in lines  # the marker sees a teardown where there is one
    assert "agent atexit" in lines and "agent teardown" not in lines
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
