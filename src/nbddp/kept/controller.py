"""A kept job seen from the kernel: its torchrun process, its channel, what ran in it, and the requests a
``%%ddp`` cell and ``%ddp_pull``/``%ddp_push``/``%ddp_status``/``%ddp_stop`` make.

Every request goes to every rank and waits for every answer (no fixed timeout: a cell runs as long as it
runs), while rank 0's output files are followed as a job's are. A rank that fails while another is still
running (waiting in a collective for it) cannot be brought back safely: the others get ``GRACE_S`` to
finish, then the job is ended and the failing rank named. An interrupt asks the ranks to stop together at
the next Trainer step (``runtime/serve.py``); ranks that do not answer within ``STOP_WAIT_S`` are ended.
"""

from __future__ import annotations

import atexit
import contextlib
import subprocess
import time
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from pathlib import Path

from ..cells import Cell
from ..errors import NbddpError
from ..launch import terminate_tree
from ..launch.supervise import POLL_S, Follower, MetricsReader
from ..runtime import records
from .channel import Channel

#: Seconds the other ranks get to answer once one rank's cell failed.
GRACE_S = 5.0
#: Seconds the ranks get to stop together after an interrupt before they are ended.
STOP_WAIT_S = 20.0


class KeptJobGone(NbddpError):
    """The kept job ended (failed rank, stop, idle limit): a new ``%%ddp_train --keep`` starts another."""


@dataclass
class Answer:
    """Each rank's reply to one request; ``ended`` says the job was ended while waiting."""

    replies: dict[int, tuple] = field(default_factory=dict)
    interrupted: bool = False
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

    @property
    def nproc(self) -> int:
        return self.channel.nproc

    @property
    def alive(self) -> bool:
        return self.ended_because is None and self.process.poll() is None

    def check_alive(self) -> None:
        if self.process.poll() is not None and self.ended_because is None:
            self.ended_because = (f"its ranks exited (torchrun's code {self.process.returncode}): the idle limit, "
                                  "or a rank ended itself; the ranks' logs are in " + str(self.run_dir / "logs"))
        if self.ended_because:
            raise KeptJobGone(f"the kept job has ended: {self.ended_because}. "
                              "Run %%ddp_train --keep again to start another")

    def request(self, message: tuple, *, ranks=None, follow=None) -> Answer:
        """Send ``message`` to ``ranks`` (all by default) and wait for each answer; ``follow`` is polled
        meanwhile (rank 0's output). Ctrl-C asks the ranks to stop at the next step, then ends them if they do not."""
        self.check_alive()
        ranks = sorted(self.channel.ranks) if ranks is None else list(ranks)
        for r in ranks:
            try:
                self.channel.ranks[r].send(message)
            except OSError:  # the rank ended between the look above and this send (its idle limit, say)
                self._gone_meanwhile(r)
        answer, asked_stop, failed_at = Answer(), None, None
        while len(answer.replies) < len(ranks):
            try:
                self._collect(answer, ranks, follow)
            except KeyboardInterrupt:
                answer.interrupted = True
                if asked_stop is None:
                    asked_stop = time.monotonic()
                    for r in ranks:
                        with contextlib.suppress(OSError):
                            self.channel.ranks[r].send(("interrupt",))
                    continue
            if failed_at is None and any(rep[0] == "error" for rep in answer.replies.values()):
                failed_at = time.monotonic()
            late = (failed_at and time.monotonic() - failed_at > GRACE_S) or (
                asked_stop and time.monotonic() - asked_stop > STOP_WAIT_S)
            if late or self.process.poll() is not None:
                missing = [r for r in ranks if r not in answer.replies]
                self.end(f"rank(s) {', '.join(map(str, missing))} did not answer")
                answer.ended = True
                break
        self.last_used = time.monotonic()
        return answer

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
                answer.replies[conns[conn]] = conn.recv()
            except (EOFError, OSError):
                answer.replies[conns[conn]] = ("error", f"rank {conns[conn]} exited", "")
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
                conn.send(("stop",))
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=10)
        self.end("stopped (%ddp_stop)")

    def followers(self, sink, on_metrics):
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
