"""The process the ranks are forked from (``agent/forker.py``): one thread, its children's ends said as ``Popen``
says them, and gone when the agent is.

Each case runs in a fresh interpreter (the test's own process has pytest's threads): it starts a forker, asks it
for children that end in known ways and prints what the handles said, as JSON.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(not sys.platform.startswith("linux"), reason="forks on Linux")]

ROOT = Path(__file__).resolve().parent.parent

AGENT = r'''
import json, os, signal, subprocess, sys, time
from nbddp.agent import forker

def child(code, wait_s, stdout, stderr):
    os.setsid()  # a group of its own, as a rank has
    os.dup2(stdout, 1)
    os.write(1, f"child {os.getpid()} of {os.getppid()}\n".encode())
    time.sleep(wait_s)
    if code < 0:
        os.kill(os.getpid(), -code)
    os._exit(code)

the_forker = forker.start(child)
threading_now = len(os.listdir(f"/proc/{the_forker.pid}/task"))
out = open(sys.argv[1], "w")
def rank(code, wait_s=0.0):
    return forker.ReportedChild(the_forker.fork((code, wait_s), out, None), ("child",), the_forker)
report = {"forker": the_forker.pid, "forker_threads": threading_now}
quick = rank(0)
time.sleep(0.5)  # it has exited, and the forker has said so; the agent has not read it yet
try:
    os.killpg(quick.pid, 0)  # as torchrun signals a rank whose poll() said it runs: its group is still there
    report["group_until_read"] = True
except ProcessLookupError:
    report["group_until_read"] = False
report["quick"] = quick.poll()
time.sleep(0.5)  # read now: the forker reaps it
report["group_after_read"] = os.path.exists(f"/proc/{quick.pid}")
ends = [rank(0), rank(3), rank(-signal.SIGKILL)]
report["codes"] = [r.wait(timeout=30) for r in ends]
slow = rank(0, 60)
try:
    slow.wait(timeout=0.3)
    report["timed_out"] = False
except subprocess.TimeoutExpired:
    report["timed_out"] = True
report["running"] = slow.poll()
slow.kill()
report["killed"] = slow.wait(timeout=30)
report["too_large"] = the_forker.fork(("x" * (1 << 21), 0.0), out, None)  # past the socket's limit
report["after_too_large"] = rank(5).wait(timeout=30)  # the forker goes on
if sys.argv[2] == "forker dies":
    orphan = rank(0, 60)
    os.kill(the_forker.pid, signal.SIGKILL)
    time.sleep(0.3)
    report["orphan_running"] = orphan.poll()
    report["new_rank"] = the_forker.fork((0, 0.0), out, None)
    os.kill(orphan.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while orphan.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    report["orphan_code"] = orphan.poll()
unheard = rank(0, 60)  # forked, its end not yet read: one torchrun would not have stopped
report["unheard"] = unheard.pid
while unheard.pid and f"child {unheard.pid} " not in open(sys.argv[1]).read():  # running, past its setsid
    time.sleep(0.01)
the_forker.close()
report["forker_gone"] = not os.path.exists(f"/proc/{the_forker.pid}")
print(json.dumps(report))
'''


def child_running(pid: int) -> bool:
    """Running, not a zombie: an orphan ended is reaped by whoever adopted it, in its own time."""
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def run_agent(tmp_path: Path, case: str) -> tuple[dict, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    out = tmp_path / "children.txt"
    done = subprocess.run([sys.executable, "-c", AGENT, str(out), case], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout), out.read_text()


def test_children_end_as_popen_says_and_the_forker_ends_with_the_agent(tmp_path):
    report, written = run_agent(tmp_path, "as usual")
    assert report["forker_threads"] == 1  # forked from the agent's one running thread
    assert report["codes"] == [0, 3, -signal.SIGKILL]
    # an exited child stays a zombie until the agent has read its end (torchrun's killpg after a poll() that said
    # running would raise for a group already reaped), and no longer
    assert report["group_until_read"] and report["quick"] == 0 and not report["group_after_read"]
    assert report["timed_out"] and report["running"] is None and report["killed"] == -signal.SIGKILL
    assert report["too_large"] is None and report["after_too_large"] == 5  # started otherwise; the forker goes on
    parents = {line.split(" of ")[1] for line in written.splitlines()}
    assert parents == {str(report["forker"])}  # the children are the forker's, their output in the agent's file
    assert len(written.splitlines()) == 7
    assert report["forker_gone"]  # close() waited for it: nothing of the job outlives the agent
    assert not child_running(report["unheard"])  # nor a child still running as the agent ended: ended with it


def test_a_dead_forker_leaves_its_running_child_running_and_forks_no_more(tmp_path):
    report, _ = run_agent(tmp_path, "forker dies")
    assert report["orphan_running"] is None  # still running: torchrun stops it by its process group
    assert report["new_rank"] is None  # the agent starts it otherwise (torchrun's own Popen)
    assert report["orphan_code"] == 1  # ended, its status unknown to the agent: a failure, never a success
