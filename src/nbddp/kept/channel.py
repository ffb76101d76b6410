"""The kernel's end of a kept job's channel: bound to this machine and this user.

A Unix socket in a fresh 0700 folder (``tempfile.mkdtemp``), so no other local user can reach it; the
``multiprocessing.connection`` handshake proves the per-job key (32 random bytes, given to the ranks in their
environment, which only this user can read); and each connection's peer uid (``SO_PEERCRED``) must be ours.
Each rank connects once, when it has run the notebook's cells (``runtime/serve.py``), and says its rank.
"""

from __future__ import annotations

import os
import shutil
import socket
import struct
import tempfile
import threading
from multiprocessing.connection import Connection, Listener
from pathlib import Path

from ..runtime.serve import IDLE_ENV, KEY_ENV, SOCKET_ENV


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


class Channel:
    """Listens for ``nproc`` ranks; ``ranks`` maps each rank to its ``Connection`` once it said hello."""

    def __init__(self, nproc: int, idle_limit_s: float | None):
        self.nproc, self.idle_limit_s = nproc, idle_limit_s
        self.folder = Path(tempfile.mkdtemp(prefix="nbddp-kept-"))  # 0700
        self.address = str(self.folder / "channel.sock")
        self.key = os.urandom(32)
        self.listener = Listener(self.address, family="AF_UNIX", authkey=self.key)
        os.chmod(self.address, 0o600)
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

    def _accept(self) -> None:
        while len(self.ranks) < self.nproc and not self._closed:
            try:
                conn = self.listener.accept()  # raises on a wrong key (AuthenticationError)
            except Exception as exc:
                if self._closed:
                    return
                self.refused.append(str(exc))
                continue
            try:
                if peer_uid(conn) != os.getuid():
                    raise ChannelError("a process of another user connected")
                kind, rank, pid, device = conn.recv()
                if kind != "hello" or rank in self.ranks:
                    raise ChannelError(f"unexpected greeting {kind!r} from rank {rank}")
            except Exception as exc:
                self.refused.append(str(exc))
                conn.close()
                continue
            self.info[rank] = (pid, device)
            self.ranks[rank] = conn

    def close(self) -> None:
        self._closed = True
        for conn in self.ranks.values():
            conn.close()
        self.listener.close()
        shutil.rmtree(self.folder, ignore_errors=True)
