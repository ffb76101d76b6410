"""The one process a job's ranks are forked from: forked from torchrun's process before torchrun starts a thread.

A process with threads may fork only a child that calls nothing but async-signal-safe functions until it execs
(POSIX): a lock another thread held at the instant of the fork stays held in the child for ever. Forked straight
from torchrun's process (its store, its rendezvous keep-alive and its log tailers run in threads), a rank once hung
so at its start: 1 launch in about 100 of 8 ranks on 2 busy CPUs, and once in about 10 clean test runs. A thread of
torchrun's held glibc's resolver lock at the fork, and the rank's first ``getaddrinfo`` (its connection to the
store) waited on it until the job's timeout (``benchmarks/results/test_lanes.md``, sixth stop). So the agent forks
this process once, right after its preload and before torchrun runs (its only other thread then is OpenBLAS's
idle pool, whose ``pthread_atfork`` handlers carry it across a fork; none of it is copied); this process never
starts a thread, and forks each rank on the agent's request.

Python's ``multiprocessing`` forkserver is this idea, but does not fit: its server is a fresh interpreter (it would
import torch again, which forking the ranks saves), and its children run a function inside multiprocessing's
bootstrap (its own ``__main__``, stdin closed, its own exit), not a script as ``python -u`` runs it.

The agent and this process talk over a ``SOCK_SEQPACKET`` socket pair (one message a datagram; file descriptors
passed with ``SCM_RIGHTS``), pickled tuples both ways:

- agent → forker: ``("fork", request, has_stdout, has_stderr)`` with the child's stdout and stderr files, those
  torchrun opened (the child calls ``child(*request, stdout_fd, stderr_fd)`` and never returns), and ``("reap",
  pid)`` once the agent has read that child's end;
- forker → agent: ``("forked", pid)`` or ``("failed", why)`` for each fork, in order, and ``("ended", pid, code)``
  when a child has exited (``code`` as ``Popen.returncode`` has it: negative for a signal).

A child that has exited stays a zombie until the agent has read its end and asks for it to be reaped, as it
stayed when torchrun's process reaped its own ranks: torchrun asks a rank's ``poll`` before it signals its
process group (``os.killpg``, which raises for a group that is gone), and a rank reaped before the agent heard
of it would be such a group. A rank's parent is this process, not torchrun's; torchrun reads its ranks only
through ``ReportedChild`` and stops them by process group, so nothing of torchrun's sees a difference. This
process ignores the signals that stop a job (torchrun stops the ranks, then ends, and so does this process), and
ends when the agent's end of the socket closes, with any child still running (one torchrun never heard of:
``_end``): the agent waits for that at its exit (``Forker.close``), so no process of the job outlives it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import pickle
import select
import signal
import socket
import subprocess
import time

from .ending import flush_standard_streams

#: Seconds between two looks for children that ended, while no request comes.
REAP_S = 0.05
#: The largest message: a rank's environment, pickled, is a few kB.
MAX_MESSAGE = 1 << 20
#: What stops a job: torchrun stops the ranks itself; this process ends after torchrun's.
_IGNORED = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")
#: Seconds the agent waits at its exit for this process to see the socket close and end.
CLOSE_S = 5.0
#: The exit code of a child the forker can no longer say (the forker died before it): the child is gone.
LOST = 1


def start(child) -> Forker:
    """Fork the forker now (while this process has no thread of its own running); its handle.
    ``child(*request, stdout_fd, stderr_fd)`` is what each forked child runs; it must not return."""
    agent_end, forker_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    flush_standard_streams()
    pid = os.fork()
    if pid == 0:
        try:
            agent_end.close()
            serve(forker_end, child)
        finally:
            os._exit(1)
    forker_end.close()
    return Forker(agent_end, pid)


class Forker:
    """The agent's end: asks for children and learns how they ended."""

    def __init__(self, sock: socket.socket, pid: int):
        self._sock = sock
        self.pid = pid
        self._ended: dict[int, int] = {}
        self._gone = False

    def fork(self, request: tuple, stdout, stderr) -> int | None:
        """A child's pid; None where the forker could not fork it (the caller starts it otherwise)."""
        fds = [f.fileno() for f in (stdout, stderr) if f is not None]
        message = pickle.dumps(("fork", request, stdout is not None, stderr is not None))
        try:
            socket.send_fds(self._sock, [message], fds)
        except OSError as exc:  # too large a message leaves the forker as it was; anything else, it is gone
            self._gone = self._gone or exc.errno != errno.EMSGSIZE
            return None
        while (reply := self._receive(None)) is not None:
            if reply[0] in ("forked", "failed"):
                return reply[1] if reply[0] == "forked" else None
        return None

    def returncode(self, pid: int, timeout: float = 0.0) -> int | None:
        """How child ``pid`` ended; None while it runs after waiting up to ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while pid not in self._ended and not self._gone:
            if self._receive(max(0.0, deadline - time.monotonic())) is None and not self._gone:
                return None
        if pid in self._ended:
            return self._ended[pid]
        return _lost(pid)

    def close(self) -> None:
        """Close the agent's end and wait for the forker to end (killed after ``CLOSE_S``)."""
        self._sock.close()
        deadline = time.monotonic() + CLOSE_S
        while time.monotonic() < deadline:
            try:
                if os.waitpid(self.pid, os.WNOHANG)[0] == self.pid:
                    return
            except ChildProcessError:
                return
            time.sleep(0.01)
        os.kill(self.pid, signal.SIGKILL)
        os.waitpid(self.pid, 0)

    def _receive(self, timeout: float | None) -> tuple | None:
        """The next message (an ended child noted); None when none came within ``timeout`` or the forker is
        gone."""
        if self._gone:
            return None
        ready, _, _ = select.select([self._sock], [], [], timeout)
        if not ready:
            return None
        try:
            data = self._sock.recv(MAX_MESSAGE)
        except OSError:
            data = b""
        if not data:
            self._gone = True
            return None
        message = pickle.loads(data)
        if message[0] == "ended":
            self._ended[message[1]] = message[2]
            self._tell(("reap", message[1]))
        return message

    def _tell(self, message: tuple) -> None:
        try:
            self._sock.send(pickle.dumps(message))
        except OSError:
            self._gone = True


def _lost(pid: int) -> int | None:
    """A child the forker can no longer speak of (it died first): None while it runs, else ended (``LOST``)."""
    return None if running(pid) else LOST


def running(pid: int) -> bool:
    """The process is there and not a zombie (one that has exited but not been reaped)."""
    import psutil  # only here: a forker that died first, or a warm process's agent (``launch/warm_start``)

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class ReportedChild:
    """What a parent reads of a ``Popen`` (``pid``, ``poll``, ``wait``, ``returncode``, signals) for a process
    whose end another process reports: ``ends.returncode(pid, timeout)`` says it, None while it runs. The
    forker's ranks in torchrun's process; the warm process's agents in the launcher (``launch/warm_start``)."""

    def __init__(self, pid: int, args: tuple, ends):
        self.pid = pid
        self.args = args
        self.returncode: int | None = None
        self._ends = ends

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._ends.returncode(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = REAP_S if deadline is None else deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.returncode = self._ends.returncode(self.pid, min(left, REAP_S))
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class _AgentGone(Exception):
    """The agent's end of the socket is closed."""


def serve(sock: socket.socket, child) -> None:
    """The forker's loop: fork a child for each request, say each child's end, until the agent's end closes."""
    for name in _IGNORED:
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_IGN)
    children: set[int] = set()  # forked, running as last seen
    try:
        while True:
            ready, _, _ = select.select([sock], [], [], REAP_S)
            _say_ended(sock, children)
            if not ready:
                continue
            try:
                data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 2)
            except OSError:
                data, fds = b"", []
            if not data:
                raise _AgentGone
            message = pickle.loads(data)
            if message[0] == "reap":
                _reap(message[1])
            else:
                _send(sock, _fork_child(sock, message[1:], fds, child, children))
    except _AgentGone:  # the agent has ended: so does this process
        _end(children)


def _fork_child(sock: socket.socket, message: tuple, fds: list[int], child, children: set[int]) -> tuple:
    request, has_stdout, has_stderr = message
    received = iter(fds)
    stdout = next(received) if has_stdout else None
    stderr = next(received) if has_stderr else None
    flush_standard_streams()
    try:
        pid = os.fork()
    except OSError as exc:
        pid, failure = None, ("failed", f"fork failed: {exc}")
    if pid == 0:  # the child: never back into this loop
        try:
            sock.close()
            child(*request, stdout, stderr)
        finally:
            os._exit(1)
    for fd in fds:
        os.close(fd)
    if pid is None:
        return failure
    children.add(pid)
    return ("forked", pid)


def _say_ended(sock: socket.socket, children: set[int]) -> None:
    """Tell the agent of each child that has exited, leaving it a zombie (``WNOWAIT``) until the agent asks."""
    for pid in list(children):
        try:
            ended = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:  # not a child of this process any more: its end is not known
            children.discard(pid)
            _send(sock, ("ended", pid, LOST))
            continue
        if ended is None:
            continue
        children.discard(pid)
        code = ended.si_status if ended.si_code == os.CLD_EXITED else -ended.si_status
        _send(sock, ("ended", pid, code))


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass


def _send(sock: socket.socket, message: tuple) -> None:
    try:
        sock.send(pickle.dumps(message))
    except OSError as exc:
        raise _AgentGone from exc


def _end(children: set[int]) -> None:
    """End this process once the agent has, and every child still running with it (by its process group, a
    rank's own): torchrun stopped every rank it knew of before its process ended, so a child still running is
    one it never heard of. The agent ended while this process was stopped with its request to fork unread (a
    launcher ending a job that had just begun), and this process forked the rank after the agent was gone: the
    rank ran on, nobody's, until its own end."""
    for pid in children:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):  # not yet in a group of its own
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    os._exit(0)
