"""torchrun itself, plus a structured record of how each failed rank ended, and an end tied to the launcher's.

The launcher starts ``python -m nbddp.agent <torchrun arguments>`` in place of ``python -m
torch.distributed.run``: this module calls torchrun's own ``main`` (rendezvous, restarts, error files and
all) and adds two things torchrun leaves out:

- **A failure record.** When torch elastic gives up it raises ``ChildFailedError``, whose ``ProcessFailure``
  entries say which global rank failed, its exit code (negative: the signal that killed it), pid and error
  file. torchrun only prints them as text; a rank killed by a signal (SIGKILL from the out-of-memory
  killer, a segfault) writes no ``error.json``, so this record is the one structured trace of it. It is
  written atomically as JSON to ``$NBDDP_FAILURES``, then the error goes on exactly as torchrun raises it.
- **Death with the launcher.** torchrun runs in a session of its own, so a launcher killed outright
  (``kill -9``, a notebook kernel that dies) could leave it and the ranks running. On Linux the agent asks
  the kernel for SIGTERM when its parent dies (``PR_SET_PDEATHSIG``); torchrun's handler then stops every
  rank as it does on Ctrl-C.

A launcher that lives on after a job (a kernel) forks this process from a warm one that imported torch already
(``agent/warm.py``, ``launch/warm_start.py``) instead of starting it afresh; it runs the same from here on.

Each rank is forked from this process once it has imported torch (``forked_ranks``), not started as a
fresh interpreter that imports torch again.

Once torchrun's ``main`` has returned (every rank ended well) or raised (a rank failed, the job was stopped:
torchrun has ended every rank by then), the agent ends without tearing down its interpreter
(``exit_without_teardown``, from ``__main__``): freeing torch's modules one by one took 0.4–0.5 s of CPU, more
than a second of wall time on the 2-core machine, after the job's work was done
(``benchmarks/results/job_overhead.md``), and 0.7 s of every stop. An error is said first as Python says an
uncaught one, with its exit status 1. The exit handlers still run and the output is flushed; no code of the
notebook runs in this process.

Runs in torchrun's process, not in the ranks: imports neither IPython, nbformat nor libcst.
"""

from __future__ import annotations

import json
import os
import signal
import sys

from .ending import flush_standard_streams

#: Linux ``prctl`` option: the signal this process gets when its parent dies.
_PR_SET_PDEATHSIG = 1


def die_with_parent(launcher_pid: int | None) -> bool:
    """Get SIGTERM when the process that started us dies; True where the OS supports it (Linux).

    ``launcher_pid`` closes the gap before ``prctl`` takes effect: if that process is already gone, the
    SIGTERM is sent now.
    """
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if launcher_pid:
        try:
            os.kill(launcher_pid, 0)
        except ProcessLookupError:  # the launcher died before prctl took effect
            os.kill(os.getpid(), signal.SIGTERM)
        except PermissionError:
            pass
    return True


def failure_record(error) -> dict:
    """``ChildFailedError`` as plain data (``records.failures_record``): every failed rank and the one torch
    elastic calls the root cause."""
    from ..runtime import records

    root, _ = error.get_first_failure()
    exits = (
        records.RankExit(
            rank=int(rank),
            local_rank=int(f.local_rank),
            pid=int(f.pid),
            exitcode=int(f.exitcode),
            signal=f.signal_name() if f.exitcode < 0 else None,
            error_file=f.error_file if os.path.isfile(f.error_file) else None,
            timestamp=int(f.timestamp),
        )
        for rank, f in sorted(error.failures.items())
    )
    return records.failures_record(root, exits)


def exit_without_teardown(code: int = 0) -> None:
    """End this process as Python's own exit would, less the teardown of its modules: other threads joined,
    exit handlers run (logging's flush among them), stdout and stderr flushed, then ``os._exit``."""
    import atexit
    import threading

    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    flush_standard_streams()
    os._exit(code)


def main(argv: list[str] | None = None) -> None:
    die_with_parent(int(os.environ.get("NBDDP_LAUNCHER_PID", "0") or 0))
    from . import forked_ranks

    forked_ranks.install()  # first: it imports torch, and notes what that import leaves for a rank
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    from . import loopback

    argv = loopback.install(sys.argv[1:] if argv is None else argv)  # a single-machine job: 127.0.0.1 only
    try:
        torchrun_main(argv)
    except ChildFailedError as exc:
        path = os.environ.get("NBDDP_FAILURES")
        if path:
            from ..runtime.io import atomic_write_text

            try:
                atomic_write_text(path, json.dumps(failure_record(exc), indent=1))
            except OSError:
                pass  # the record is a help, torchrun's own report below still stands
        if os.environ.get("NBDDP_LAUNCHED_INNER"):
            exit_without_teardown(1)  # a notebook's launched command: nbddp.launched says the failed rank
        raise
