"""A kept job's ``%%ddp`` cell runs on every rank, except the statements that write files or push, which run on
rank 0 once. Such a statement may bind names (``commit = model.push_to_hub(…)``, ``with open(…) as fh:``), and a
later cell may use them on every rank; so the block it sits in is wrapped::

    with _nbddp.from_rank0(globals(), "commit"):
        if _nbddp.on_rank0():
            commit = model.push_to_hub(…)

and as the block ends rank 0 sends what it bound to every other rank (through the process group's store), or
the error it raised: every rank then fails at that line alike, so the kept job survives a failed push. A Stop
interrupts every rank, rank 0 in its block and the others waiting for it, so no rank sends anything then. A
value goes through ``torch.save``/``torch.load`` (tensors land on the receiving rank's own device); one that
cannot be sent (an open file) is a stand-in on the other ranks that says so when anything uses it.

A job's script wraps a download before training assigned to names (``path = wget.download(url)``) the same way:
rank 0 fetches the file once, and the other ranks wait for it and get the path.
"""

from __future__ import annotations

import io
import pickle
import sys
import time

#: What a name was on rank 0 once its block ended: its value's bytes, the reason it cannot be sent, or unbound.
VALUE, NOT_SENT, UNBOUND = "value", "not sent", "unbound"


class Rank0Failed(RuntimeError):
    """Raised on every other rank where rank 0's block raised: the cell fails at the same line everywhere."""


class RankZeroOnly:
    """On a rank other than 0, a name whose value rank 0 could not send: any use says why, instead of running
    on with a value rank 0 does not hold."""

    def __init__(self, name: str, why: str):
        object.__setattr__(self, "_nbddp_why", f"{name} exists on rank 0 only: {why}; use it in the cell that makes it")

    def _refuse(self, *args, **kwargs):
        raise NameError(object.__getattribute__(self, "_nbddp_why"))

    __getattr__ = __setattr__ = __call__ = __iter__ = __len__ = __bool__ = __getitem__ = _refuse
    __int__ = __float__ = __index__ = __str__ = __format__ = _refuse

    def __repr__(self) -> str:
        return f"<{object.__getattribute__(self, '_nbddp_why')}>"


def pack(namespace: dict, names: tuple[str, ...]) -> dict[str, tuple[str, object]]:
    """Rank 0's side: each name's value as bytes, or why it cannot be sent, or that it is unbound."""
    import torch

    packed: dict[str, tuple[str, object]] = {}
    for name in names:
        if name not in namespace:
            packed[name] = (UNBOUND, None)
            continue
        buffer = io.BytesIO()
        try:
            torch.save(namespace[name], buffer)
        except Exception as exc:  # an open file, a lambda, a lock: nothing the other ranks can be given
            packed[name] = (NOT_SENT, f"its value ({type(namespace[name]).__name__}) cannot be sent to the other "
                                      f"ranks ({type(exc).__name__}: {exc})")
        else:
            packed[name] = (VALUE, buffer.getvalue())
    return packed


def unpack(packed: dict[str, tuple[str, object]], namespace: dict, device) -> None:
    """Another rank's side: bind each name as rank 0 has it (tensors on this rank's ``device``)."""
    import torch

    for name, (kind, value) in packed.items():
        if kind == VALUE:
            namespace[name] = torch.load(io.BytesIO(value), map_location=device, weights_only=False)
        elif kind == NOT_SENT:
            namespace[name] = RankZeroOnly(name, value)
        else:
            namespace.pop(name, None)


#: How often a rank waiting for rank 0's block looks for its answer, at most (seconds).
_POLL_MAX_S = 0.05


class from_rank0:  # noqa: N801 - used as a statement in the converted cell, read as words there
    """The context of a kept cell's rank-0 block: as it ends, rank 0's names (or its error) reach every rank.

    Through the process group's key-value store, not a collective: the other ranks wait in Python (a short
    sleep between looks), so a Stop interrupts them where they wait, as it interrupts rank 0 in its block;
    an interrupted rank sends and takes nothing. The last rank to read removes the answer from the store."""

    def __init__(self, namespace: dict, *names: str, unwrapped: tuple[str, ...] = ()):
        self.namespace, self.names, self.unwrapped = namespace, names, unwrapped
        self.wrappers: dict[str, tuple[object, object]] = {}

    def __enter__(self) -> from_rank0:
        self.key = _key(sys._getframe(1))  # at the with line, on every rank alike
        self._unwrap()
        return self

    def _unwrap(self) -> None:
        """A plain loop's DDP models (``unwrapped``) as the notebook had them inside the block, as the script's
        rank-0 code has them after training: rank 0 alone cannot run a DDP forward, and a state dict saved has
        the model's own keys. Each is its wrapper again as the block ends, so a later training syncs."""
        from .dist import unwrap

        for name in self.unwrapped:
            wrapper = self.namespace.get(name)
            inner = unwrap(wrapper)
            if inner is not wrapper:
                self.wrappers[name] = (wrapper, inner)
                self.namespace[name] = inner

    def _rewrap(self) -> None:
        for name, (wrapper, inner) in self.wrappers.items():
            if self.namespace.get(name) is inner:  # not rebound in the block (a rebound name is sent instead)
                self.namespace[name] = wrapper

    def __exit__(self, kind, error, tb) -> bool:
        import torch.distributed as dist

        from .rank import rank_info

        self._rewrap()
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return False
        key = self.key
        if isinstance(error, KeyboardInterrupt):
            return False  # a Stop interrupts every rank where it is (``serve``): rank 0 here, the others below
        store, info = _store(), rank_info()
        if info.rank == 0:
            failed = None if error is None else f"{kind.__name__}: {error}"
            answer = ("error", failed) if failed else ("ok", pack(self.namespace, self.names))
            store.set(key, pickle.dumps(answer))
            return False
        if error is not None:  # this rank failed as well, in the block rank 0 alone runs (it should not)
            return False
        outcome, body = pickle.loads(_take(store, key, dist.get_world_size() - 1))
        if outcome == "error":
            raise Rank0Failed(f"rank 0 failed here, in code it runs alone: {body}")
        unpack(body, self.namespace, info.device)
        return False


def _key(frame) -> str:
    """The block's key, where it runs: each ``%%ddp`` cell is a script file of its own (``ddp-cell-N.py``) and the
    block a top-level statement of it, run once, so the key is the same on every rank and never reused. (A count
    of blocks would part ways after a cell that failed on one rank before its block and ran through on another.)"""
    return f"nbddp/from_rank0/{frame.f_code.co_filename}:{frame.f_lineno}"


def _store():
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


def _take(store, key: str, readers: int) -> bytes:
    """Rank 0's answer under ``key`` once it is there; the last of ``readers`` removes it."""
    pause = 0.001
    while not store.check([key]):
        time.sleep(pause)  # where a Stop's KeyboardInterrupt lands
        pause = min(pause * 2, _POLL_MAX_S)
    answer = store.get(key)
    if store.add(f"{key}/read", 1) == readers:
        store.delete_key(key)
        store.delete_key(f"{key}/read")
    return answer
