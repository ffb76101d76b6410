"""The kernel's end of a kept job's channel: bound to this machine and this user.

A Unix socket in a fresh 0700 folder (``tempfile.mkdtemp``), so no other local user can reach it; the
``multiprocessing.connection`` handshake proves the per-job key (32 random bytes, given to the ranks in their
environment, which only this user can read); and each connection's peer uid (``SO_PEERCRED``) must be ours.
Each rank connects once, when it has run the notebook's cells (``runtime/serve.py``), and says its rank.

Each connection is admitted in a thread of its own, its handshake and greeting bounded by ``HANDSHAKE_S``
(the socket's receive timeout): a connection that never answers cannot keep the ranks from joining. The folder
names its owner (``OWNER``: the kernel's pid and start time); a channel made later removes this user's folders
whose owner is gone (a kernel killed or restarted before it could remove its own).
"""

from __future__ import annotations

import os
import shutil
import socket
import struct
import tempfile
import threading
from multiprocessing.connection import Connection, Listener, answer_challenge, deliver_challenge
from pathlib import Path

import psutil

from ..runtime.kept_protocol import Ended, Hello
from ..runtime.serve import IDLE_ENV, KEY_ENV, SOCKET_ENV, STOP_FILE

#: Seconds a connection gets to prove the key and say its rank.
HANDSHAKE_S = 5.0
#: The file in a channel's folder naming the process that made it.
OWNER = "owner"
PREFIX = "nbddp-kept-"


class ChannelError(Exception):
    """A connection that is not one of this job's ranks."""


def peer_uid(conn: Connection) -> int:
    """The uid of the process at the other end of a Unix-socket connection (Linux's ``SO_PEERCRED``)."""
    sock = socket.socket(fileno=os.dup(conn.fileno()))
    try:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    finally:
        sock.close()
    return struct.unpack("3i", creds)[1]


def _receive_timeout(conn: Connection, seconds: float) -> None:
    """Every blocking read of ``conn`` fails after ``seconds`` (0: waits as long as it takes)."""
    sock = socket.socket(fileno=os.dup(conn.fileno()))
    try:
        whole = int(seconds)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO,
                        struct.pack("ll", whole, int((seconds - whole) * 1e6)))
    finally:
        sock.close()


def _me() -> str:
    """This process as the owner file names it: pid and start time (a pid alone is reused)."""
    return f"{os.getpid()} {psutil.Process().create_time()}"


def _owner_gone(folder: Path) -> bool:
    try:
        pid, started = (folder / OWNER).read_text().split()
        return psutil.Process(int(pid)).create_time() != float(started)
    except FileNotFoundError:  # made before folders named their owner, or being made this moment
        return _unheard(folder)
    except (OSError, ValueError):
        return False
    except psutil.Error:  # the process is gone
        return True


#: Seconds a folder without an owner file is given before nobody listening on its socket means it is stale.
OWNERLESS_AFTER_S = 60.0


def _unheard(folder: Path) -> bool:
    """A folder without an owner file, over a minute old, whose socket nobody listens on."""
    import time

    try:
        if time.time() - folder.stat().st_mtime < OWNERLESS_AFTER_S:
            return False
        with socket.socket(socket.AF_UNIX) as probe:
            probe.connect(str(folder / "channel.sock"))
        return False
    except (ConnectionRefusedError, FileNotFoundError):
        return True
    except OSError:
        return False


def remove_stale(parent: Path | None = None) -> list[Path]:
    """Remove this user's channel folders whose owning kernel is gone; the folders removed."""
    parent = Path(parent or tempfile.gettempdir())
    removed = []
    for folder in parent.glob(PREFIX + "*"):
        try:
            if folder.is_symlink() or not folder.is_dir() or folder.stat().st_uid != os.getuid():
                continue
        except OSError:
            continue
        if _owner_gone(folder):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


class Channel:
    """Listens for ``nproc`` ranks; ``ranks`` maps each rank to its ``Connection`` once it said hello."""

    def __init__(self, nproc: int, idle_limit_s: float | None, handshake_s: float = HANDSHAKE_S):
        self.nproc, self.idle_limit_s, self.handshake_s = nproc, idle_limit_s, handshake_s
        remove_stale()
        self.folder = Path(tempfile.mkdtemp(prefix=PREFIX))  # 0700
        (self.folder / OWNER).write_text(_me())
        self.address = str(self.folder / "channel.sock")
        self.key = os.urandom(32)
        self.listener = Listener(self.address, family="AF_UNIX")  # the key is proved per connection (_admit)
        os.chmod(self.address, 0o600)
        self._lock = threading.Lock()
        self.ranks: dict[int, Connection] = {}
        self.info: dict[int, tuple[int, str]] = {}  # rank → (pid, device)
        self.refused: list[str] = []
        self._closed = False
        threading.Thread(target=self._accept, daemon=True, name="nbddp-kept-accept").start()

    def env(self) -> dict[str, str]:
        """What the ranks need to reach this channel."""
        env = {SOCKET_ENV: self.address, KEY_ENV: self.key.hex()}
        if self.idle_limit_s:
            env[IDLE_ENV] = str(self.idle_limit_s)
        return env

    def ready(self) -> bool:
        """Every rank has connected: the notebook's cells ran through on all of them."""
        return len(self.ranks) == self.nproc

    def stop_at_step(self) -> None:
        """Ask the ranks still running the notebook's cells (the ``--keep`` cell) to stop their training at
        the next step they agree on (``serve.listen_for_stop``)."""
        (self.folder / STOP_FILE).touch()

    def _accept(self) -> None:
        while not self.ready() and not self._closed:
            try:
                conn = self.listener.accept()
            except Exception as exc:
                if self._closed:
                    return
                self.refused.append(str(exc))
                continue
            threading.Thread(target=self._admit, args=(conn,), daemon=True, name="nbddp-kept-admit").start()

    def _admit(self, conn: Connection) -> None:
        """One connection: ours (uid), the key proved, a rank's hello, all within ``handshake_s``."""
        try:
            if peer_uid(conn) != os.getuid():
                raise ChannelError("a process of another user connected")
            _receive_timeout(conn, self.handshake_s)
            deliver_challenge(conn, self.key)  # raises on a wrong key (AuthenticationError)
            answer_challenge(conn, self.key)
            hello = conn.recv()
            _receive_timeout(conn, 0)
            with self._lock:
                if not isinstance(hello, Hello) or hello.rank in self.ranks or self._closed:
                    raise ChannelError(f"unexpected greeting {hello!r}")
                self.info[hello.rank] = (hello.pid, hello.device)
                self.ranks[hello.rank] = conn
        except Exception as exc:
            why = "no handshake" if isinstance(exc, (BlockingIOError, TimeoutError)) else str(exc)
            self.refused.append(why if why else type(exc).__name__)
            conn.close()

    def last_words(self) -> str | None:
        """What a rank said as it ended itself (the idle limit), read from its connection; None if nothing."""
        for conn in list(self.ranks.values()):
            try:
                while conn.poll():
                    message = conn.recv()
                    if isinstance(message, Ended):
                        return message.why
            except (EOFError, OSError):
                continue
        return None

    def close(self) -> None:
        with self._lock:
            self._closed = True
        for conn in list(self.ranks.values()):
            conn.close()
        self.listener.close()
        shutil.rmtree(self.folder, ignore_errors=True)
