"""Where this process sits in the job, and the lines nbddp says from rank 0.

``lifecycle.setup()`` records the rank here once it has joined the process group; before that (or without
torchrun, plain ``python script.py``) the rank is read from torchrun's environment, a single process being
rank 0. ``say`` is how every runtime module prints its own lines: on rank 0, flushed, and, given a key, once
per process. Imports no other nbddp module, so any runtime module can say something (``dist`` imports
``balance``, which says what it balances). Nothing here imports IPython, nbformat or libcst.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class RankInfo:
    """Where this process sits in the job."""

    rank: int
    local_rank: int
    world_size: int
    backend: str
    device: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


_info: RankInfo | None = None


def remember(info: RankInfo) -> None:
    """Keep this rank's place once ``setup()`` has picked its device and joined the group."""
    global _info
    _info = info


def remembered() -> RankInfo | None:
    """This rank's place as ``setup()`` kept it; None before ``setup()``."""
    return _info


def env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


def rank_info() -> RankInfo:
    """This process's rank, from torchrun's environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``)."""
    if _info is not None:
        return _info
    import torch

    local = env_int("LOCAL_RANK", 0)
    cuda = torch.cuda.is_available()
    return RankInfo(
        rank=env_int("RANK", 0),
        local_rank=local,
        world_size=env_int("WORLD_SIZE", 1),
        backend="nccl" if cuda else "gloo",
        device=f"cuda:{local}" if cuda else "cpu",
    )


def is_main_process() -> bool:
    """True on global rank 0 (and in a plain single process)."""
    return rank_info().rank == 0


def is_local_main_process() -> bool:
    """True on the first process of each machine."""
    return rank_info().local_rank == 0


#: The keys ``say`` has said in this process.
_said: set[str] = set()


def say(line: str, once: str | None = None) -> None:
    """Print one of nbddp's lines on rank 0 and flush it, so it reaches the launcher as it happens.

    With ``once``, only the first time this process says that key: a line saying the same thing each time
    its code runs (a shim's repair, a sampler chosen per epoch) keys on what it says, not on its figures.
    """
    if once is not None:
        if once in _said:
            return
        _said.add(once)
    if is_main_process():
        print(line, flush=True)
