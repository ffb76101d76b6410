"""A kept job seen from the kernel: its torchrun process, its channel, what ran in it, and the requests a
``%%ddp`` cell and ``%ddp_pull``/``%ddp_push``/``%ddp_status``/``%ddp_stop`` make.

Every request goes to every rank and waits for every answer (no fixed timeout: a cell runs as long as it
runs), while rank 0's output files are followed as a job's are. A rank that fails while another is still
running (waiting in a collective for it) cannot be brought back safely: the others get ``GRACE_S`` to
finish, then the job is ended and the failing rank named. An interrupt (the kernel's Stop, or ``--timeout``)
interrupts every rank where it is — a training stops together at the next Trainer step (``runtime/serve.py``)
— and the ranks are kept once every one came back to the prompt and they agree (``Agree``: one
all-reduce). A rank that does not come back within ``GRACE_S`` of another (stuck in a collective the others
left, or in native code), or at all within ``STOP_WAIT_S``, ends the job, said so.
"""

from __future__ import annotations

import atexit
import contextlib
import subprocess
import time
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from pathlib import Path

import psutil

from ..cells import Cell
from ..errors import NbddpError
from ..launch import terminate_tree
from ..launch.supervise import POLL_S, Follower, MetricsReader
from ..runtime import records
from ..runtime.kept_protocol import Agree, At, Ended, Failed, Interrupt, Interrupted, Ok, Reply, Stop, Where, send
from .channel import Channel

#: Seconds the other ranks get to answer once one rank's cell failed.
GRACE_S = 5.0
#: Seconds the ranks get to stop together after an interrupt before they are ended.
STOP_WAIT_S = 20.0
#: Seconds the ranks' check after a Stop may take, all told (each rank's all-reduce waits ``serve.AGREE_S``).
AGREE_WAIT_S = 8.0


class KeptJobGone(NbddpError):
    """The kept job ended (failed rank, stop, idle limit): a new ``%%ddp_train --keep`` starts another."""


@dataclass
class Answer:
    """Each rank's reply to one request; ``ended`` says the job was ended while waiting."""

    replies: dict[int, Reply] = field(default_factory=dict)
    where: dict[int, int] = field(default_factory=dict)  # rank → the script line it was at, when asked
    interrupted: bool = False
    timed_out: bool = False
    ended: bool = False


@dataclass
class KeptJob:
    process: subprocess.Popen
    channel: Channel
    run_dir: Path
    cells: list[Cell]  # the job's cells, then every %%ddp cell that ran through
    cwd: Path
    setup: tuple[str, ...] | None = None  # the %%ddp_setup cells' code the ranks ran, when the job used them
    ran_here: tuple = ()  # the job's cells taken as the kernel ran them (``changed.RanCell``), for re-runs
    started_at: int = 0  # the kernel's In [N] that started the job: runs after it came later
    started: float = field(default_factory=time.monotonic)
    last_used: float = field(default_factory=time.monotonic)
    ended_because: str | None = None

    def __post_init__(self):
        atexit.register(self.stop)  # the kernel's own exit; a killed kernel closes the socket instead

    def up_s(self) -> float:
        """Seconds since the job started (torchrun's process began), not since its training ended."""
        try:
            return max(0.0, time.time() - psutil.Process(self.process.pid).create_time())
        except (psutil.Error, AttributeError):
            return time.monotonic() - self.started

    @property
    def nproc(self) -> int:
        return self.channel.nproc

    @property
    def alive(self) -> bool:
        return self.ended_because is None and self.process.poll() is None

    def check_alive(self) -> None:
        said = self.channel.last_words() if self.ended_because is None else None
        if said:  # the ranks ended themselves, and said why (the idle limit)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=GRACE_S)
            self.end(said)
        if self.process.poll() is not None and self.ended_because is None:
            self.ended_because = (f"its ranks exited (torchrun's code {self.process.returncode}) without a word; "
                                  "the ranks' logs are in " + str(self.run_dir / "logs"))
        if self.ended_because:
            raise KeptJobGone(f"the kept job has ended: {self.ended_because}. "
                              "Run %%ddp_train --keep again to start another")

    def request(self, message, *, ranks=None, follow=None, timeout_s: float | None = None,
                waiting=None) -> Answer:
        """Send ``message`` to ``ranks`` (all by default) and wait for each answer; ``follow`` is polled
        meanwhile (rank 0's output). Ctrl-C, or ``timeout_s`` passing, interrupts the ranks where they are (a
        training at its next step); those that do not come back are ended. ``waiting(rank, seconds, answer)``
        is called while some ranks have answered and ``rank`` has not, ``seconds`` after the first answer."""
        self.check_alive()
        ranks = sorted(self.channel.ranks) if ranks is None else list(ranks)
        for r in ranks:
            try:
                send(self.channel.ranks[r], message)
            except OSError:  # the rank ended between the look above and this send (its idle limit, say)
                self._gone_meanwhile(r)
        answer, asked_stop, failed_at, back_at, first_at, before = Answer(), None, None, None, None, 0
        started = time.monotonic()
        while len(answer.replies) < len(ranks):
            try:  # a Ctrl-C anywhere in the wait, not only while collecting, is the Stop (never a traceback)
                self._collect(answer, ranks, follow)
                if timeout_s is not None and asked_stop is None and time.monotonic() - started > timeout_s:
                    answer.timed_out = True
                    raise KeyboardInterrupt
                now = time.monotonic()
                if failed_at is None and any(isinstance(rep, Failed) for rep in answer.replies.values()):
                    failed_at = now
                if asked_stop and back_at is None and len(answer.replies) > before:
                    back_at = now
                if first_at is None and answer.replies:
                    first_at = now
                if waiting and first_at is not None and len(answer.replies) < len(ranks):
                    for r in ranks:
                        if r not in answer.replies:
                            waiting(r, now - first_at, answer)
                why = self._late(answer, ranks, now, failed_at, asked_stop, back_at)
            except KeyboardInterrupt:
                answer.interrupted = True
                if asked_stop is None:
                    asked_stop, before = time.monotonic(), len(answer.replies)
                    for r in ranks:
                        if r not in answer.replies:
                            with contextlib.suppress(OSError):
                                send(self.channel.ranks[r], Interrupt())
                continue
            if why:
                if asked_stop:
                    self._where_missing(answer, ranks, follow)
                self.end(why)
                answer.ended = True
                break
        if answer.interrupted and not answer.ended and len(ranks) == self.nproc:
            self._agree(answer)
        self.last_used = time.monotonic()
        return answer

    def _late(self, answer: Answer, ranks, now: float, failed_at, asked_stop, back_at) -> str | None:
        """Why the job must be ended now, if it must: a rank that does not answer while another failed or came
        back from the Stop, or none back from it within ``STOP_WAIT_S``; or torchrun gone."""
        missing = ", ".join(str(r) for r in ranks if r not in answer.replies)
        if failed_at and now - failed_at > GRACE_S:
            return f"rank(s) {missing} did not answer"
        if (back_at and now - back_at > GRACE_S) or (asked_stop and now - asked_stop > STOP_WAIT_S):
            return (f"rank(s) {missing} did not come back from the Stop: stuck inside a collective the other ranks "
                    "had left, or in native code that does not return to Python")
        if self.process.poll() is not None:
            return f"rank(s) {missing} did not answer (torchrun exited)"
        return None

    def _where_missing(self, answer: Answer, ranks, follow, within_s: float = 1.0) -> None:
        """Before a rank stuck after a Stop is ended: where it is (its reader thread answers while the main
        thread waits in a collective), into ``Answer.where``."""
        missing = [r for r in ranks if r not in answer.replies]
        for r in missing:
            self.ask_where(r)
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline and any(r not in answer.where for r in missing):
            self._collect(answer, ranks, follow)

    def _agree(self, answer: Answer) -> None:
        """After a Stop every rank is back at the prompt: they must also agree in the process group (one
        all-reduce, ``serve.agree``) before the next cell's collectives, else the job is ended."""
        replies: dict[int, Reply] = {}
        try:
            for conn in self.channel.ranks.values():
                send(conn, Agree())
            deadline = time.monotonic() + AGREE_WAIT_S
            while len(replies) < self.nproc and time.monotonic() < deadline:
                conns = {c: r for r, c in self.channel.ranks.items() if r not in replies}
                for conn in wait(list(conns), timeout=POLL_S):
                    replies[conns[conn]] = conn.recv()
        except (EOFError, OSError):
            pass
        bad = [_complaint(rep) for rep in replies.values() if _complaint(rep) is not None]
        if len(replies) < self.nproc or bad:
            self.end(bad[0] if bad else "the ranks did not all answer the check after the Stop")
            answer.ended = True

    def ask_where(self, rank: int) -> None:
        """Ask a rank still running a cell where it is; its answer lands in ``Answer.where``."""
        with contextlib.suppress(OSError):
            send(self.channel.ranks[rank], Where())

    def _gone_meanwhile(self, rank: int) -> None:
        """A rank's connection closed under a request: the job has ended, or is ended now; said as ``check_alive``
        says it."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=GRACE_S)
        if self.process.poll() is None:
            self.end(f"rank {rank} closed its connection")
        self.check_alive()

    def _collect(self, answer: Answer, ranks, follow) -> None:
        conns = {self.channel.ranks[r]: r for r in ranks if r not in answer.replies}
        for conn in wait(list(conns), timeout=POLL_S):
            try:
                reply = conn.recv()
            except (EOFError, OSError):
                reply = Failed(f"rank {conns[conn]} exited")
            if isinstance(reply, At):  # where a rank still running is (``ask_where``), not its answer
                if reply.line is not None:
                    answer.where[conns[conn]] = reply.line
                continue
            if isinstance(reply, Ended):  # the rank ended itself as the request came (the idle limit)
                self.ended_because = self.ended_because or reply.why
                reply = Failed(reply.why)
            answer.replies[conns[conn]] = reply
        if follow:
            follow()

    def end(self, why: str) -> None:
        """End every process the job started (torchrun's tree), never anything by name."""
        if self.ended_because is None:
            self.ended_because = why
        terminate_tree(self.process)
        self.channel.close()

    def stop(self) -> None:
        """``%ddp_stop``: the ranks leave the process group and exit; whatever is left is ended."""
        if self.ended_because is not None:
            return
        for conn in self.channel.ranks.values():
            with contextlib.suppress(OSError):
                send(conn, Stop())
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=10)
        self.end("stopped (%ddp_stop)")

    def followers(self, sink, on_metrics) -> tuple[list[Follower], MetricsReader]:
        """Rank 0's output and metrics from where they are now, for one cell."""
        logs = self.run_dir / "logs"
        followers = [Follower(logs, 0, stream, lambda *_: None) for stream in ("stdout", "stderr")]
        for f in followers:
            f.poll()  # what was written before this cell: skipped
        metrics = MetricsReader(self.run_dir / records.METRICS_FILE, None)
        metrics.poll()
        metrics.records.clear()
        for f in followers:
            f.sink = sink
        metrics.callback = on_metrics
        return followers, metrics


def _complaint(reply: Reply) -> str | None:
    """What a rank's answer to ``Agree`` says is wrong, or None when the rank agrees."""
    match reply:
        case Ok(value):
            return value or None
        case Failed(message):
            return message
        case Interrupted(traceback):
            return traceback
    return ""
