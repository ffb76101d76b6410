"""A warm start for the agent: one process that imported what the agent preloads, forking an agent per job.

``python -m nbddp.agent.warm NAME…`` imports the modules named (``preload.PRELOAD`` and the part of
``preload.LATER`` the jobs it serves need: the launcher keeps one warm process per set, ``launch/warm_start.py``),
then waits on its stdin for jobs, one JSON line each: torchrun's arguments, the environment, the working folder
and the log file. For each it forks, and the child becomes what ``python -m nbddp.agent ARGS`` started there
would be (``become_agent``): a session of its own, stdin ``/dev/null``, stdout and stderr the log file, the job's
environment, ``sys.argv`` and ``sys.path[0]`` as ``-m`` sets them, default signal handlers, ``sitecustomize`` run
again with the job's environment; then ``nbddp.agent``'s own ``__main__`` runs, which ends the process itself. The
imports the fresh agent would make are there already, with the exit handlers they registered (``preload.load``
answers for them, so the ranks keep those, as from a fresh agent). On stdout it answers each job with the agent's
pid, and says the exit status of each agent it reaps.

One difference from a fresh agent is left: the exit handlers the warm process's own start registered (its ``.pth``
files', its ``sitecustomize``'s, with the environment of the job that started it) are the agent's too, beside
those its ``sitecustomize`` registers again; a customization that registers one unconditionally runs it twice in
the agent. (The ranks keep only the preloaded modules' handlers, as from a fresh agent.)

It lives as long as its launcher: it ends when its stdin closes (the launcher exited) or when the launcher dies
(``PR_SET_PDEATHSIG``, as the agent does); its agents die with it in turn, and torchrun stops their ranks.

Runs neither torchrun nor any code of a notebook; imports neither IPython, nbformat nor libcst.
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys

#: Seconds between two looks for agents that ended, while no job comes.
REAP_S = 0.05


def serve(names: list[str]) -> None:
    """Import ``names``, then fork an agent for each job read from stdin until it closes."""
    from . import die_with_parent, exit_without_teardown, preload

    signal.signal(signal.SIGTERM, lambda signum, frame: exit_without_teardown(0))  # its launcher died: as at EOF
    die_with_parent(int(os.environ.get("NBDDP_LAUNCHER_PID", "0") or 0))
    if sys.path and sys.path[0] == os.getcwd():  # ``-m`` put the folder it started in first: not the jobs' own
        sys.path.pop(0)
    preload.load(names)
    _import_title_setter()
    refusal = _why_not_fork()
    pending, agents = b"", set()
    while True:
        readable, _, _ = select.select([0], [], [], REAP_S)
        _reap(agents)
        if not readable:
            continue
        chunk = os.read(0, 1 << 16)
        if not chunk:  # the launcher is gone: its agents get SIGTERM as this process ends
            exit_without_teardown(0)
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            _answer({"error": refusal, "refused": True} if refusal else _start(json.loads(line), agents))


def _why_not_fork() -> str | None:
    """Why this process may not fork agents: CUDA's driver initialized by its imports (a site customization,
    say), so that an agent forked from it could not use CUDA (torchrun's agent does, on a machine with GPUs)."""
    from .forked_ranks import cuda_driver_initialized

    return "CUDA's driver was initialized in the warm process" if cuda_driver_initialized() else None


def _start(job: dict, agents: set[int]) -> dict:
    from .ending import flush_standard_streams

    flush_standard_streams()
    try:
        pid = os.fork()
    except OSError as exc:
        return {"error": f"fork failed: {exc}"}
    if pid == 0:  # the agent: never back into this loop
        try:
            become_agent(job)
        finally:
            os._exit(1)
    agents.add(pid)
    return {"pid": pid}


def become_agent(job: dict) -> None:
    """In the forked child: start the job's agent as ``python -m nbddp.agent ARGS`` would start it there."""
    import runpy

    from .forked_ranks import as_a_fresh_interpreter

    os.setsid()
    os.chdir(job["cwd"])
    null = os.open(os.devnull, os.O_RDONLY)
    log = os.open(job["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    for fd, target in ((0, null), (1, log), (2, log)):
        os.dup2(target, fd)
    os.close(null)
    os.close(log)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 - the process's own stdin, as at a fresh start
    main = os.path.join(os.path.dirname(os.path.abspath(__file__)), "__main__.py")
    _title([sys.executable, "-m", "nbddp.agent", *job["argv"]])  # first: it takes the room the environment had
    sys.path.insert(0, "")  # the place ``-m`` gives the working folder, which ``serve`` took out
    as_a_fresh_interpreter([main, *job["argv"]], job["env"], os.getcwd())
    runpy.run_module("nbddp.agent", run_name="__main__", alter_sys=True)  # ends the process itself


def _import_title_setter() -> None:
    try:
        import setproctitle  # noqa: F401 - once here, not in every agent
    except ImportError:
        pass


def _title(argv: list[str]) -> None:
    """The command line ``ps`` and ``/proc`` show for this process: the fresh agent's, not the warm process's (whose
    forked ranks show it too)."""
    try:
        from setproctitle import setproctitle
    except ImportError:  # not Linux, or not installed: the warm process's command line stays
        return
    setproctitle(" ".join(argv))


def _reap(agents: set[int]) -> None:
    while agents:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            agents.clear()
            return
        if pid == 0:
            return
        agents.discard(pid)
        _answer({"ended": pid, "code": os.waitstatus_to_exitcode(status)})


def _answer(message: dict) -> None:
    os.write(1, (json.dumps(message) + "\n").encode())


if __name__ == "__main__":
    serve(sys.argv[1:])
