import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from conftest import no_rank_processes
from nbddp.convert.script import SourceMap
from nbddp.launch import map_traceback, plan, terminate_tree
from nbddp.options import RunOptions


def test_traceback_frames_in_the_script_point_at_cells(tmp_path):
    script = tmp_path / "script.py"
    script.write_text("x\n" * 20)
    smap = SourceMap("nb.ipynb", {12: (4, 2), 13: (4, 3)})
    tb = textwrap.dedent(f'''\
        Traceback (most recent call last):
          File "{script}", line 12, in <module>
            f()
          File "/lib/other.py", line 5, in f
            g()
          File "{script}", line 13, in g
            raise ValueError("x")
        ValueError: x''')
    mapped, cell, line = map_traceback(tb, script, smap)
    assert (cell, line) == (4, 3)
    assert 'File "nb.ipynb", cell 4, line 2, in <module>' in mapped
    assert 'File "/lib/other.py", line 5, in f' in mapped


def test_plan_passes_arguments_as_argv_and_finds_its_runtime(tmp_path):
    p = plan(tmp_path / "s.py", tmp_path, RunOptions(torchrun_args=["--max-restarts=0", "a b;c"]), nproc=2)
    assert p.argv[:3] == (sys.executable, "-m", "nbddp.agent")  # torchrun's main plus a failure record
    assert "--standalone" in p.argv and "--nproc_per_node=2" in p.argv and "a b;c" in p.argv
    assert str(Path(__file__).resolve().parent.parent / "src") in p.env["PYTHONPATH"]
    multi = plan(tmp_path / "s.py", tmp_path, RunOptions(torchrun_args=["--nnodes=2", "--rdzv-endpoint=h:1"]), nproc=1)
    assert "--standalone" not in multi.argv


@pytest.mark.e2e
def test_terminate_tree_ends_grandchildren_in_their_own_sessions():
    child = textwrap.dedent('''
        import subprocess, sys, time
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
        time.sleep(600)
    ''')
    proc = subprocess.Popen([sys.executable, "-c", child], start_new_session=True)
    deadline = time.time() + 10
    while not psutil.Process(proc.pid).children() and time.time() < deadline:
        time.sleep(0.05)
    grandchild = psutil.Process(proc.pid).children()[0]
    started = time.monotonic()
    terminate_tree(proc)
    assert time.monotonic() - started < 5
    assert proc.poll() == -signal.SIGTERM  # as it ended, not the 0 Popen says of a child collected before it
    assert not grandchild.is_running() or grandchild.status() == psutil.STATUS_ZOMBIE


@pytest.mark.e2e
def test_terminate_tree_ends_the_processes_started_while_it_ends_them(tmp_path):
    """A torchrun stopped while starting its workers: a parent that goes on starting children in sessions of their
    own, SIGTERM or not. Each one is ended, however late it started (a worker started after the tree was listed
    was left running, orphaned, its parent killed)."""
    marker = str(tmp_path / "late-child")
    parent = textwrap.dedent(f'''
        import signal, subprocess, sys, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        while True:
            subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", {marker!r}],
                             start_new_session=True)
            time.sleep(0.1)
    ''')
    proc = subprocess.Popen([sys.executable, "-c", parent], start_new_session=True)
    deadline = time.time() + 10
    while not psutil.Process(proc.pid).children() and time.time() < deadline:
        time.sleep(0.05)
    terminate_tree(proc)
    assert proc.poll() is not None
    time.sleep(0.5)  # a process left running would still be there; one ended has been reaped by then
    assert no_rank_processes(marker)


@pytest.mark.e2e
def test_rank_0s_two_streams_reach_the_view_in_the_order_they_were_written(tmp_path):
    """An evaluation's bar on stderr, then the metrics printed on stdout 30 ms later (12 times), are shown bar first, even
    where one poll of the logs finds both (the launcher polled stdout first, so the metrics came before the bar)."""
    from nbddp.launch import launch

    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent('''
        import sys, time
        for k in range(12):
            sys.stderr.write(f"bar {k}\\n"); sys.stderr.flush()
            time.sleep(0.03)
            print(f"metrics {k}", flush=True)
            time.sleep(0.12)
    '''))
    seen: list[str] = []
    result = launch(plan(script, tmp_path / "run", RunOptions(), nproc=1), sink=lambda stream, text: seen.append(text))
    assert result.returncode == 0
    shown = "".join(seen)
    assert [line for line in shown.splitlines() if line.startswith(("bar", "metrics"))] == [
        f"{what} {k}" for k in range(12) for what in ("bar", "metrics")]


def test_a_kept_jobs_stop_follows_the_logs_and_the_metrics_until_the_ranks_are_kept(tmp_path):
    """A kept job's Stop (``_kept_after_stop``) polls rank 0's logs and the metrics as it waits: the metrics reader
    is no log file, and a record it finds reaches the view too."""
    from types import SimpleNamespace

    from nbddp.launch.supervise import Follower, MetricsReader, _kept_after_stop

    logs = tmp_path / "logs"
    seen, records = [], []
    followers = [Follower(logs, 0, stream, lambda stream, text: seen.append(text)) for stream in ("stdout", "stderr")]
    metrics_path = tmp_path / "metrics.jsonl"
    metrics_path.write_text('{"event": "step", "step": 3}\n')
    metrics = MetricsReader(metrics_path, records.append)
    running = SimpleNamespace(poll=lambda: None)  # torchrun, still up
    kept = _kept_after_stop(running, lambda: None, lambda: bool(records), followers, metrics, lambda *_: None)
    assert kept
    assert records == [{"event": "step", "step": 3}]
