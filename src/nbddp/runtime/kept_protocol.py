"""The messages of a kept job's channel between the kernel (``kept/``) and its ranks (``runtime/serve.py``),
defined once: each side builds and reads these, by field name, never a tuple by position.

They travel pickled through ``multiprocessing.connection`` (whose handshake proved the job's key), so both
ends import this module under the same name, and both send with ``send``: plain pickle, not the connection's
own ``send``, whose pickler carries torch's reductions for multiprocessing once torch is imported (a tensor
goes as a handle to shared memory, which the other process, not its child, cannot open: a pulled or pushed
tensor hung the cell). Frozen: a message is what was sent, not changed on the way.

Kernel → rank (``REQUESTS``): ``Run`` lines of a converted cell's script, ``Pull``/``Push`` a name, ``Status``,
``Agree`` (after a Stop), ``Stop`` (leave), and two read by the rank's reader thread while a cell runs:
``Interrupt`` (the kernel's Stop) and ``Where`` (answered at once with ``At``).
Rank → kernel (``REPLIES``): ``Hello`` once on connecting; for each request ``Ok``, ``Failed`` or, for a cell the
kernel's Stop cut short, ``Interrupted``; ``At`` for ``Where``; ``Ended`` when the rank ends itself (idle limit).
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any


def send(conn, message) -> None:
    """``message`` over a ``multiprocessing.connection.Connection``, pickled plainly (its tensors' bytes with it);
    the other end's ``recv`` reads it as any message."""
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


@dataclass(frozen=True)
class Run:
    """Run lines ``first``..``last`` of the converted script at ``path``."""

    path: str
    first: int
    last: int


@dataclass(frozen=True)
class Pull:
    name: str


@dataclass(frozen=True)
class Push:
    name: str
    value: Any


@dataclass(frozen=True)
class Status:
    pass


@dataclass(frozen=True)
class Agree:
    """After a Stop: one all-reduce every rank must enter (``serve.agree``)."""


@dataclass(frozen=True)
class Stop:
    """``%ddp_stop``: leave the process group and exit."""


@dataclass(frozen=True)
class Interrupt:
    """The kernel's Stop: a training stops at the next agreed step, other code gets a ``KeyboardInterrupt``."""


@dataclass(frozen=True)
class Where:
    """Which line of the running cell's script the rank is at (answered by ``At``)."""


@dataclass(frozen=True)
class Hello:
    """A rank's greeting once its notebook cells ran: who it is."""

    rank: int
    pid: int
    device: str


@dataclass(frozen=True)
class Ok:
    """A request done; ``value`` is what it gives (a pulled value, a status, whether a training stopped at a
    step for ``Run``, the agreement's complaint or None for ``Agree``)."""

    value: Any = None


@dataclass(frozen=True)
class Failed:
    """The request failed on this rank: the error as one line, and its traceback (may be empty)."""

    message: str
    traceback: str = ""


@dataclass(frozen=True)
class Interrupted:
    """A cell the kernel's Stop cut short, with where (its traceback)."""

    traceback: str


@dataclass(frozen=True)
class At:
    """The answer to ``Where``: the script line, or None outside the cell's own lines."""

    line: int | None


@dataclass(frozen=True)
class Ended:
    """The rank ended itself, and why (the idle limit)."""

    why: str


REQUESTS = (Run, Pull, Push, Status, Agree, Stop, Interrupt, Where)
REPLIES = (Hello, Ok, Failed, Interrupted, At, Ended)
#: What a request is answered with (``Where`` is answered by ``At``; ``Stop`` and ``Interrupt`` by nothing of
#: their own: the rank exits, or the running request's answer comes back).
Reply = Ok | Failed | Interrupted
