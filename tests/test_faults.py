"""Faults on real runs (torchrun, gloo, CPU): each ends with a clear message naming the rank, no process left
behind, nothing half-written."""

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from conftest import DEFAULT_PORT_GROUP, ROOT, no_rank_processes
from nbddp.display.view import QuietView
from nbddp.job import run_job
from nbddp.options import RunOptions
from views import Said

pytestmark = pytest.mark.e2e

IMPORTS = "import os, signal, sys, time\nimport torch\nimport torch.distributed as dist"


def processes_with(marker: str) -> list[psutil.Process]:
    me = os.getpid()
    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if p.info["pid"] != me and marker in " ".join(p.info["cmdline"] or []):
                found.append(p)
        except psutil.NoSuchProcess:
            continue
    return found


@pytest.fixture
def reaper(tmp_path):
    """Whatever a test leaves running under its folder is killed afterwards (the test asserts there is none)."""
    yield
    for p in processes_with(str(tmp_path)):
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def nbddp_cli(*args, cwd, env=None, **kwargs):
    """``nbddp …`` as a child process, as a terminal starts it; argv items, no shell.

    Ctrl-C's SIGINT is at its default in the child, whatever this process has: an ignored signal is inherited
    through ``exec`` (tests started in the background, ``make test &``, have SIGINT ignored, and a library can
    ignore it below Python, where ``signal.getsignal`` does not see), and a Python started with SIGINT ignored
    keeps ignoring it, as a program should. Three clean-clone runs of four saw the launcher sleep on in its loop
    5 s after the interrupt; a handler of this process's own becomes the default in the child. SIGHUP likewise:
    a terminal's hang-up reaches a CLI at its default, but tests run under ``nohup`` inherit it ignored, and the
    launcher keeps an ignored SIGHUP ignored, as ``nohup`` asks (the SIGHUP case below failed so, every time).
    """
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    previous_hup = signal.signal(signal.SIGHUP, signal.SIG_DFL)
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "nbddp.cli", *map(str, args)], cwd=cwd, text=True,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": str(ROOT / "src"), **(env or {})}, **kwargs,
        )
    finally:
        signal.signal(signal.SIGINT, previous)
        signal.signal(signal.SIGHUP, previous_hup)


def wait_for(predicate, timeout: float, what: str, left=lambda: ""):
    """``predicate()`` once it is true; after ``timeout`` an error naming ``what`` and what ``left()`` says."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}{left()}")


def still_running(marker: str, launcher: int | None = None) -> str:
    """The processes whose command line holds ``marker``, and the launcher's: pid, state, where in the kernel
    it waits (``wchan``), parent, threads and what each one is."""
    lines = []
    found = processes_with(marker) + ([psutil.Process(launcher)] if launcher and psutil.pid_exists(launcher) else [])
    for p in found:
        with contextlib.suppress(psutil.Error, OSError):
            wchan = Path(f"/proc/{p.pid}/wchan").read_text() if Path(f"/proc/{p.pid}/wchan").exists() else "?"
            masks = [ln for ln in Path(f"/proc/{p.pid}/status").read_text().splitlines()
                     if ln.startswith(("SigBlk", "SigIgn"))]  # SIGINT is 0x2 in these masks
            lines.append(f"\n  {p.pid} {p.status()} in {wchan} (parent {p.ppid()}, {len(p.threads())} threads, "
                         f"{' '.join(masks)}): {' '.join(p.cmdline())[:160]}")
    return "; still running:" + "".join(lines) if lines else ""


def rank_log_says(runs: Path, rank: int, text: str) -> bool:
    return any(text in p.read_text(errors="replace") for p in runs.glob(f"*/logs/*/attempt_*/{rank}/stdout.log"))


def test_a_rank_killed_by_sigkill_is_named_with_its_signal(tmp_path, notebook, reaper):
    nb = notebook([
        IMPORTS,
        "t = torch.ones(1)\ndist.all_reduce(t)\nif dist.get_rank() == 1:\n    os.kill(os.getpid(), signal.SIGKILL)\n"
        "for _ in range(600):\n    dist.all_reduce(t)\n    time.sleep(0.1)",
    ])
    result = run_job(nb, RunOptions(every_rank=True, nproc=2, runs_dir=tmp_path / "runs"), QuietView()).run
    assert not result.ok
    f = result.failure
    assert str(f).startswith("rank 1 was killed (signal 9): SIGKILL")
    assert (f.rank, f.signal, f.exitcode) == (1, 9, -9)
    # torch elastic's own record of it, kept in the run directory
    record = json.loads((result.run_dir / "failures.json").read_text())
    assert any(r["rank"] == 1 and r["signal"] == "SIGKILL" and r["exitcode"] == -9 for r in record["failures"])
    assert result.duration_s < 120  # rank 0 was stopped, not left looping for a minute
    assert no_rank_processes(str(result.run_dir))


def test_a_rank_that_segfaults_is_named_with_its_signal_cell_and_line(tmp_path, notebook, reaper):
    nb = notebook([
        IMPORTS + "\nimport ctypes",
        "t = torch.ones(1)\ndist.all_reduce(t)\nif dist.get_rank() == 1:\n    ctypes.string_at(0)  # native crash\n"
        "time.sleep(600)",
    ])
    result = run_job(nb, RunOptions(every_rank=True, nproc=2, runs_dir=tmp_path / "runs"), QuietView()).run
    f = result.failure
    assert (f.rank, f.signal, f.cell, f.line) == (1, 11, 2, 4)
    assert str(f).startswith("rank 1 was killed (signal 11) in cell 2, line 4: SIGSEGV: crashed (segmentation fault)")
    assert 'File "nb.ipynb", cell 2, line 4 in <module>' in f.traceback  # the stack faulthandler dumped
    assert [str(st) for st in result.stacks] == ["rank 0 was at cell 2, line 5: time.sleep(600)"]
    assert no_rank_processes(str(result.run_dir))


def test_a_rank_stuck_in_a_collective_fails_after_the_collective_timeout(tmp_path, notebook, reaper):
    nb = notebook([
        IMPORTS,
        "t = torch.ones(1)\ndist.all_reduce(t)\nprint('synced', flush=True)",
        "if dist.get_rank() == 1:\n    time.sleep(600)\ndist.all_reduce(t)",
    ])
    result = run_job(nb, RunOptions(every_rank=True, nproc=2, runs_dir=tmp_path / "runs", collective_timeout_s=5),
                     QuietView()).run
    assert not result.ok
    f = result.failure
    # the rank that waited names the collective it waited in …
    assert (f.rank, f.cell, f.line) == (0, 3, 3)
    assert "dist.all_reduce(t)" in f.source
    # … and the stuck rank's stack, dumped when torchrun stopped it, says where it was
    (stuck,) = [st for st in result.stacks if st.rank == 1]
    assert (stuck.cell, stuck.line) == (3, 2)
    assert str(stuck) == "rank 1 was at cell 3, line 2: time.sleep(600)"
    assert result.duration_s < 300
    assert no_rank_processes(str(result.run_dir))


def test_the_job_timeout_stops_every_rank_and_says_where_each_was(tmp_path, notebook, reaper):
    # rank 0 waits in a collective and ignores SIGTERM, so only the stacks the launcher asks for before
    # stopping anything can say where it was (a rank that sees its peer stopped first leaves the collective)
    nb = notebook([
        IMPORTS,
        "t = torch.ones(1)\ndist.all_reduce(t)\nprint('synced', flush=True)\n"
        "if dist.get_rank() == 0:\n    signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "if dist.get_rank() == 1:\n    time.sleep(600)\ndist.all_reduce(t)",
    ])
    chunks = []
    started = time.monotonic()
    # the job's own timeout, under a collective timeout far longer; 45 s leaves a loaded machine's ranks time to
    # reach the sleep (they print "synced" within ~15 s), and the rest of the wait is idle
    result = run_job(nb, RunOptions(every_rank=True, nproc=2, runs_dir=tmp_path / "runs", timeout_s=45,
                                    collective_timeout_s=3600), Said(chunks)).run
    assert result.timed_out and not result.ok
    assert "synced" in "".join(chunks)  # both ranks were past the first all-reduce when the timeout came
    assert time.monotonic() - started < 45 + 30
    said = "".join(chunks)
    assert "timed out after 45 s; every rank has been stopped." in said
    assert "rank 0 was at cell 2, line 8: dist.all_reduce(t)" in said
    assert "rank 1 was at cell 2, line 7: time.sleep(600)" in said
    assert result.failure is None
    assert no_rank_processes(str(result.run_dir))


def test_interrupting_the_launcher_ends_every_rank_within_5_seconds(tmp_path, notebook, reaper):
    nb = notebook([IMPORTS, "t = torch.ones(1)\nfor i in range(100000):\n    dist.all_reduce(t)\n    print('step', i, flush=True)\n    time.sleep(0.05)"])
    runs = tmp_path / "runs"
    proc = nbddp_cli("run", "--every-rank", nb, "--nproc", "2", "--runs-dir", runs, cwd=tmp_path)
    try:
        wait_for(lambda: rank_log_says(runs, 1, "step 3"), 300, "both ranks stepping")
        (run_dir,) = runs.iterdir()
        assert len(processes_with(str(run_dir))) >= 3  # torchrun and two ranks
        proc.send_signal(signal.SIGINT)
        started = time.monotonic()
        wait_for(lambda: not processes_with(str(run_dir)), 5, "every rank to end",  # the bound the issue sets
                 lambda: still_running(str(run_dir), proc.pid))
        gone_after = time.monotonic() - started
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert gone_after <= 5
    assert proc.returncode == 130
    assert "interrupted; every rank has been stopped" in err
    assert "rank 1 was at cell 2, line " in err  # where each rank was, from the stacks dumped as they stopped


def _interrupted_right_after_the_job_is_looked_at(started: Path):
    """A profile hook that raises ``KeyboardInterrupt`` where a Ctrl-C reaching a busy launcher is handled: just
    after a C call returns, here the first that takes a lock or asks the kernel about a child (``Popen.poll``'s
    ``acquire``, a ``waitpid``) once the job wrote ``started``. A launcher preempted there on a loaded machine
    sees its SIGINT land at exactly this point (one clean-clone CI run in many)."""
    def hook(frame, event, arg):
        if (event == "c_return" and getattr(arg, "__name__", "") in ("acquire", "waitpid", "waitid")
                and started.exists()):
            sys.setprofile(None)
            raise KeyboardInterrupt
    return hook


def _in_thread(target, timeout: float):
    """``target()``'s value, run on a thread of its own; None when it has not returned within ``timeout``."""
    done = []
    thread = threading.Thread(target=lambda: done.append(target()), daemon=True)
    thread.start()
    thread.join(timeout)
    return done[0] if done else None


def test_an_interrupt_landing_as_the_launcher_looks_at_the_job_still_ends_it_and_returns(tmp_path, reaper):
    from nbddp.launch import LaunchPlan, launch

    started = tmp_path / "started"
    job = f"import pathlib, time; pathlib.Path({str(started)!r}).touch(); time.sleep(120)  # {tmp_path}"
    plan = LaunchPlan(argv=(sys.executable, "-c", job), env=dict(os.environ), cwd=tmp_path, run_dir=tmp_path / "run",
                      script=tmp_path / "script.py", nproc=1)

    def interrupted_launch():
        sys.setprofile(_interrupted_right_after_the_job_is_looked_at(started))
        try:
            return launch(plan, sink=lambda stream, text: None)
        finally:
            sys.setprofile(None)

    result = _in_thread(interrupted_launch, 30)  # it waited on Popen's lock, left taken by the interrupted poll()
    assert result is not None, f"launch did not return 30 s after the interrupt{still_running(str(tmp_path))}"
    assert result.interrupted
    assert not processes_with(str(tmp_path))


def test_ending_a_job_whose_poll_was_interrupted_is_bounded(tmp_path, reaper):
    from nbddp.launch import terminate_tree

    started = tmp_path / "started"
    proc = subprocess.Popen([sys.executable, "-c", f"import pathlib, time; pathlib.Path({str(started)!r}).touch(); "
                             f"time.sleep(120)  # {tmp_path}"], start_new_session=True)
    wait_for(started.exists, 60, "the job to start")

    def interrupted_poll():
        sys.setprofile(_interrupted_right_after_the_job_is_looked_at(started))
        try:
            proc.poll()
        except KeyboardInterrupt:
            return True
        finally:
            sys.setprofile(None)

    assert _in_thread(interrupted_poll, 10)
    began = time.monotonic()
    assert _in_thread(lambda: terminate_tree(proc, grace_s=0.5) or True, 30), "terminate_tree blocked"
    assert time.monotonic() - began < 10
    assert not processes_with(str(tmp_path))


def test_a_launcher_killed_outright_takes_its_ranks_with_it(tmp_path, notebook, reaper):
    nb = notebook([IMPORTS, "t = torch.ones(1)\nfor i in range(100000):\n    dist.all_reduce(t)\n    print('step', i, flush=True)\n    time.sleep(0.05)"])
    runs = tmp_path / "runs"
    proc = nbddp_cli("run", "--every-rank", nb, "--nproc", "2", "--runs-dir", runs, cwd=tmp_path)
    try:
        wait_for(lambda: rank_log_says(runs, 1, "step 3"), 300, "both ranks stepping")
        (run_dir,) = runs.iterdir()
        proc.kill()  # SIGKILL: no chance to clean up; torchrun gets SIGTERM from the kernel instead
        proc.wait(timeout=30)
        wait_for(lambda: not processes_with(str(run_dir)), 60, "torchrun and every rank to end")
    finally:
        proc.kill()


def _hold_port(port: int):
    """Listen on ``port`` if nothing does yet; either way, the port is busy while the socket lives."""
    sock = socket.socket()
    try:
        sock.bind(("", port))
        sock.listen()
    except OSError:
        pass  # something else holds it already
    return sock


@pytest.mark.xdist_group(DEFAULT_PORT_GROUP)
def test_two_jobs_at_once_with_the_default_port_taken(tmp_path, notebook, reaper):
    nb = notebook([IMPORTS, "t = torch.ones(1)\ndist.all_reduce(t)\nprint('port', os.environ['MASTER_PORT'], 'sum', int(t.item()), flush=True)"])
    runs = tmp_path / "runs"
    held = _hold_port(29500)
    results, outputs = [None, None], [[], []]

    def job(k):
        results[k] = run_job(nb, RunOptions(every_rank=True, nproc=2, runs_dir=runs), Said(outputs[k])).run

    try:
        threads = [threading.Thread(target=job, args=(k,)) for k in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=500)
    finally:
        held.close()
    assert all(r is not None and r.ok for r in results), [r and r.failure for r in results]
    assert results[0].run_dir != results[1].run_dir
    ports = []
    for chunks in outputs:
        said = "".join(chunks)
        assert "sum 2" in said  # both ranks of each job took part
        ports.append(int(said.split("port ")[1].split()[0]))
    assert ports[0] != ports[1] and 29500 not in ports
    for r in results:
        assert oct(r.run_dir.stat().st_mode & 0o777) == oct(0o700)  # private to the user
        assert no_rank_processes(str(r.run_dir))


def test_a_weights_file_being_saved_when_a_rank_dies_is_never_truncated(tmp_path, notebook, reaper):
    out = tmp_path / "out"
    nb = notebook([
        IMPORTS,
        "weights = {'w': torch.arange(4_000_000, dtype=torch.float32)}\ndist.barrier()",
        f"if dist.get_rank() == 1:\n    time.sleep(3)\n    os.kill(os.getpid(), signal.SIGKILL)\n"
        f"else:\n    os.makedirs({str(out)!r}, exist_ok=True)\n    for i in range(100000):\n"
        f"        torch.save(weights, {str(out / 'weights.pt')!r})\n"
        f"        print('saved', i, flush=True)",
    ])
    result = run_job(nb, RunOptions(every_rank=True, nproc=2, runs_dir=tmp_path / "runs"), QuietView()).run
    assert result.failure and result.failure.rank == 1 and result.failure.signal == 9
    assert rank_log_says(tmp_path / "runs", 0, "saved 1")  # rank 0 was saving over and over when stopped
    import torch

    loaded = torch.load(out / "weights.pt")  # complete: the last save that finished
    assert torch.equal(loaded["w"], torch.arange(4_000_000, dtype=torch.float32))
    assert no_rank_processes(str(result.run_dir))


def test_arguments_with_shell_metacharacters_stay_arguments(tmp_path, notebook, reaper):
    odd = tmp_path / "a b;touch PWNED;$(touch PWNED2)`touch PWNED3`"
    odd.mkdir()
    nb = notebook(["import os\nprint('hello from', os.environ['RANK'], flush=True)"], name="nb;touch PWNED4 &.ipynb")
    nb = nb.rename(odd / nb.name)
    proc = nbddp_cli("run", "--every-rank", nb, "--nproc", "2", "--runs-dir", odd / "runs|touch PWNED5", cwd=odd)
    out, err = proc.communicate(timeout=400)
    assert proc.returncode == 0, err[-3000:]
    assert "hello from 0" in out
    assert not list(tmp_path.rglob("PWNED*"))
    assert not list(Path.cwd().glob("PWNED*")) and not list(odd.parent.parent.glob("PWNED*"))
    assert no_rank_processes(str(odd))


def test_secrets_in_the_environment_reach_the_ranks_but_no_file(tmp_path, notebook, reaper):
    secret = "hf_FAKEtok3n_" + "x" * 20
    nb = notebook(["import os\ntoken = os.environ['HF_TOKEN']\nprint('token length', len(token), flush=True)\n"
                   "print('resume', os.environ.get('NBDDP_RESUME'), 'timeout', os.environ.get('NBDDP_TIMEOUT'), flush=True)\n"
                   # both ranks have said it before either fails (a failure first has torchrun stop the other)
                   "import torch.distributed as dist\ndist.barrier()\n"
                   "raise RuntimeError('fail on purpose, so error files are written')"])
    runs = tmp_path / "runs"
    proc = nbddp_cli("run", "--every-rank", nb, "--nproc", "2", "--runs-dir", runs, "--resume", "--collective-timeout", "77",
                     cwd=tmp_path, env={"HF_TOKEN": secret})
    out, err = proc.communicate(timeout=400)
    assert proc.returncode == 1
    assert f"token length {len(secret)}" in out  # the ranks got it
    assert "resume 1 timeout 77" in out  # and the options, through the environment too
    assert secret not in out and secret not in err
    files = [p for p in runs.rglob("*") if p.is_file()]
    assert any(p.name == "error.json" for p in files) and any(p.name == "torchrun.log" for p in files)
    for p in files:
        assert secret not in p.read_text(errors="replace"), p


def test_two_nodes_on_loopback_train_together(tmp_path, notebook, reaper):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    nb = notebook([IMPORTS, "t = torch.tensor([float(dist.get_rank() + 1)])\ndist.all_reduce(t)\n"
                   "print('world', dist.get_world_size(), 'rank', dist.get_rank(), 'sum', int(t.item()), flush=True)"])
    nodes = [
        nbddp_cli("run", "--every-rank", nb, "--nproc", "1", "--nnodes", "2", "--node-rank", str(k),
                  "--rdzv-endpoint", f"127.0.0.1:{port}", "--runs-dir", tmp_path / f"node{k}", cwd=tmp_path)
        for k in (0, 1)
    ]
    outs = [n.communicate(timeout=500) for n in nodes]
    for n, (out, err) in zip(nodes, outs):
        assert n.returncode == 0, err[-3000:]
    said = outs[0][0] + outs[1][0]
    # each node streams its own first process; together they are ranks 0 and 1 of one world of 2 …
    assert "world 2 rank 0 sum 3" in said and "world 2 rank 1 sum 3" in said  # … and both contributed
    for k in (0, 1):
        assert no_rank_processes(str(tmp_path / f"node{k}"))


def listening_addresses(pid: int) -> list[str]:
    """``ip:port`` of every TCP socket listening in ``pid`` and its descendants (the launcher, torchrun's agent,
    the ranks)."""
    family = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    found = []
    for p in family:
        with contextlib.suppress(psutil.NoSuchProcess):
            found += [f"{c.laddr.ip}:{c.laddr.port}" for c in p.net_connections(kind="tcp")
                      if c.status == psutil.CONN_LISTEN]
    return found


def test_a_single_machine_job_listens_on_loopback_only(tmp_path, notebook, reaper):
    """The rendezvous store, the ranks' shared store and gloo's sockets: none on a wildcard address, where
    anyone who reaches the machine could connect (torch's TCPStore listens on every interface by itself)."""
    import ipaddress

    nb = notebook([IMPORTS, "t = torch.ones(1)\ndist.all_reduce(t)\n"  # every socket of the job is open by now
                   f"open(os.path.join({str(tmp_path)!r}, f'joined{{dist.get_rank()}}'), 'w').close()\n"
                   f"while not os.path.exists(os.path.join({str(tmp_path)!r}, 'go')):\n    time.sleep(0.05)"])
    proc = nbddp_cli("run", "--every-rank", nb, "--nproc", "2", "--runs-dir", tmp_path / "runs", cwd=tmp_path)
    try:
        wait_for(lambda: all((tmp_path / f"joined{r}").exists() for r in (0, 1)) or proc.poll() is not None,
                 120, "both ranks to join", lambda: still_running(str(tmp_path), proc.pid))
        listening = listening_addresses(proc.pid)
    finally:
        (tmp_path / "go").touch()
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    assert len(listening) >= 4, listening  # the two stores of torchrun's agent and each rank's gloo socket
    wide = [a for a in listening if not ipaddress.ip_address(a.rsplit(":", 1)[0]).is_loopback]
    assert wide == [], f"listening beyond this machine: {wide} (all: {listening})"
