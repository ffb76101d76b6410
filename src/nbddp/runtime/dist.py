"""Set a rank up and tear it down: device, process group, error reports.

Imported by the generated script in every rank; nothing here imports IPython, nbformat or libcst. Run
without torchrun (plain ``python script.py``) it behaves as a single process of rank 0.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from dataclasses import dataclass
from datetime import timedelta

#: Seconds a collective may wait before the process group gives up (``NBDDP_TIMEOUT``).
DEFAULT_TIMEOUT_S = 1800


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


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


def rank_info() -> RankInfo:
    """This process's rank, from torchrun's environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``)."""
    if _info is not None:
        return _info
    import torch

    local = _env_int("LOCAL_RANK", 0)
    cuda = torch.cuda.is_available()
    return RankInfo(
        rank=_env_int("RANK", 0),
        local_rank=local,
        world_size=_env_int("WORLD_SIZE", 1),
        backend="nccl" if cuda else "gloo",
        device=f"cuda:{local}" if cuda else "cpu",
    )


def setup() -> RankInfo:
    """Pick this rank's device, join the process group, and record uncaught errors for the launcher.

    Idempotent. The backend is nccl with GPUs and gloo without; ``NBDDP_TIMEOUT`` bounds collectives.
    Seeds every rank alike (``NBDDP_SEED``), prints the job's configuration once (rank 0), applies the shims.
    Also: weight files saved atomically (``saves``), stacks dumped when the rank is stopped, and
    ``NBDDP_RESUME=1`` resuming ``trainer.train()`` from the last checkpoint (``resume``).
    """
    global _info
    if _info is not None:
        return _info
    _record_uncaught_errors()
    _record_stacks_on_termination()
    from . import saves

    saves.install()  # before anything imports transformers or peft, which bind safetensors' save_file
    import torch
    import torch.distributed as dist

    info = rank_info()
    if info.device.startswith("cuda"):
        torch.cuda.set_device(info.local_rank)
    elif info.world_size > 1:
        # Without this, accelerate (and so the Trainer) sees no GPU, picks "not parallel", and every rank
        # trains alone on the whole dataset; with it, the Trainer runs DDP over gloo (MULTI_CPU).
        os.environ.setdefault("ACCELERATE_USE_CPU", "true")
    if info.world_size > 1 and not dist.is_initialized():
        timeout = timedelta(seconds=_env_int("NBDDP_TIMEOUT", DEFAULT_TIMEOUT_S))
        dist.init_process_group(backend=info.backend, timeout=timeout)
        _record_stacks_on_termination()  # again: joining an NCCL group replaces the SIGABRT handler
    _info = info
    from . import metrics, resume, rich, shims
    from .report import get_multi_gpu_config

    seed = seed_everything()
    metrics.attach()
    rich.install()
    resume.attach(log=lambda line: print0(line, flush=True))
    if info.is_main:
        print(get_multi_gpu_config(info, seed).summary(), flush=True)
    shims.apply_all(log=lambda line: print0(line, flush=True))
    from . import divergence, launchers, unused_params

    divergence.install()  # replicas that drift apart stop the job (NBDDP_ALLOW_DIVERGENCE=1: off)
    unused_params.install()  # DDP's "finished reduction" error names the parameters and the fix
    launchers.install()  # notebook_launcher(fn, args) runs fn(*args) in every rank
    return info


#: The seed every rank starts from unless ``NBDDP_SEED`` says otherwise.
DEFAULT_SEED = 0


def seed_everything(seed: int | str | None = None) -> int | None:
    """Seed Python's, NumPy's and torch's generators (every GPU's too) with the same value on every rank.

    ``seed`` defaults to ``NBDDP_SEED``, else ``DEFAULT_SEED``; "off" leaves them alone and returns None.
    A script that seeds itself later (``set_seed``, the Trainer's ``seed``) simply overrides this.
    """
    import random

    import torch

    value = str(os.environ.get("NBDDP_SEED", DEFAULT_SEED) if seed is None else seed).strip().lower()
    if value in ("off", "none", ""):
        return None
    try:
        number = int(value)
    except ValueError:
        raise ValueError(f"NBDDP_SEED must be a whole number or 'off', not {value!r}") from None
    random.seed(number)
    torch.manual_seed(number)
    with contextlib.suppress(ImportError):
        import numpy

        numpy.random.seed(number % 2**32)
    return number


def cleanup() -> None:
    """Wait for every rank, then leave the process group. Safe to call twice or without ``setup()``.

    The wait and the moment after it are what keep a finished rank from aborting at exit (``sync``).
    """
    import torch.distributed as dist

    from . import sync

    if dist.is_available() and dist.is_initialized():
        with contextlib.suppress(Exception):
            sync.wait_for_every_rank(rank_info().device)
        dist.destroy_process_group()
        sync.settle_workers()


def is_main_process() -> bool:
    """True on global rank 0 (and in a plain single process)."""
    return rank_info().rank == 0


def is_local_main_process() -> bool:
    """True on the first process of each machine."""
    return rank_info().local_rank == 0


@contextlib.contextmanager
def main_process_first(local: bool = True):
    """Let rank 0 (of the node, by default) run the block first, the others after it: for caches and downloads."""
    import torch.distributed as dist

    from .sync import wait_for_every_rank

    first = is_local_main_process() if local else is_main_process()
    grouped = dist.is_available() and dist.is_initialized()
    if grouped and not first:
        wait_for_every_rank(rank_info().device)
    try:
        yield
    finally:
        if grouped and first:
            wait_for_every_rank(rank_info().device)


def device_map() -> dict:
    """A ``from_pretrained`` device map putting the whole model on this rank's device."""
    info = rank_info()
    return {"": info.local_rank} if info.device.startswith("cuda") else {"": "cpu"}


def device():
    """This rank's ``torch.device``: ``cuda:<local rank>`` with GPUs, else the CPU (for ``"cuda:0"`` in a notebook)."""
    import torch

    return torch.device(rank_info().device)


def ddp(model):
    """Wrap a model placed on this rank's device in ``DistributedDataParallel`` (once; alone, it stays as it is).

    The wrapper passes attribute lookups it cannot answer on to the model, so the notebook's code keeps
    working after the wrap (``model.head.parameters()``, ``model.config``, its own methods).
    """
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel) or not (dist.is_available() and dist.is_initialized()):
        return model
    info = rank_info()
    ids = [info.local_rank] if info.device.startswith("cuda") else None
    return _notebook_ddp()(_without_inner_wrappers(model), device_ids=ids)


def _without_inner_wrappers(model):
    """A model built on a wrapped one (``get_peft_model(ddp_model, …)``) holds the first wrapper inside: it
    gets the plain module back in its place, so the new wrapper alone syncs the gradients (the old one, no
    longer run forward, expects none)."""
    from torch.nn.parallel import DistributedDataParallel

    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, DistributedDataParallel):
                setattr(parent, name, child.module)
    return model


@functools.cache
def _notebook_ddp():
    from torch.nn.parallel import DistributedDataParallel

    class NotebookDDP(DistributedDataParallel):
        """``DistributedDataParallel`` that falls back to the wrapped model's attributes."""

        def __getattr__(self, name):
            try:
                return super().__getattr__(name)
            except AttributeError:
                inner = self.__dict__.get("_modules", {}).get("module")
                if inner is None or name == "module":
                    raise
                return getattr(inner, name)

        def __deepcopy__(self, memo):
            """``copy.deepcopy(model)`` in the notebook copies its model: the wrapper is nbddp's, and a copy
            of it would name every weight ``module.…`` (and hold a second reducer on the job's group)."""
            import copy

            return copy.deepcopy(self.module, memo)

    return NotebookDDP


def unwrap(model):
    """The module inside a ``DistributedDataParallel`` wrapper (``.module``), or the model itself."""
    from torch.nn.parallel import DistributedDataParallel

    return model.module if isinstance(model, DistributedDataParallel) else model


def distributed_sampler(dataset, shuffle: bool = False):
    """A ``DistributedSampler`` giving this rank its own share of ``dataset`` (all of it in a single process)."""
    from torch.utils.data import DistributedSampler

    info = rank_info()
    return DistributedSampler(dataset, num_replicas=info.world_size, rank=info.rank, shuffle=bool(shuffle))


def set_epoch(loader, epoch: int) -> None:
    """Reshuffle a loader's ``DistributedSampler`` for this epoch; a no-op for any other loader."""
    sampler = getattr(loader, "sampler", None)
    if hasattr(sampler, "set_epoch"):
        sampler.set_epoch(epoch)


def print0(*args, **kwargs) -> None:
    """``print`` on rank 0 only."""
    if is_main_process():
        print(*args, **kwargs)


def _record_uncaught_errors() -> None:
    """Write uncaught exceptions to torchrun's per-rank error file, in torch elastic's ``error.json`` format.

    ``@record`` does this for a function; a notebook's code runs at module level, so an excepthook does it
    here, with the traceback of the exception itself.
    """
    if not os.environ.get("TORCHELASTIC_ERROR_FILE") or getattr(sys.excepthook, "_nbddp", False):
        return
    previous = sys.excepthook

    def hook(exc_type, exc, tb):
        with contextlib.suppress(Exception):
            write_error_file(os.environ["TORCHELASTIC_ERROR_FILE"], exc_type, exc, tb)
        previous(exc_type, exc, tb)

    hook._nbddp = True
    sys.excepthook = hook


def write_error_file(path: str, exc_type, exc, tb) -> None:
    """torch elastic's error record, written atomically: the agent may read it while this rank dies.

    Beyond torch's fields, ``extraInfo`` carries the global ``rank`` (the file's folder only names the local
    rank) and ``time`` in fractions of a second, which orders failures that fall within one second.
    """
    import json
    import time
    import traceback

    from .io import atomic_write_text

    now = time.time()
    data = {
        "message": {
            "message": f"{exc_type.__name__}: {exc}",
            "extraInfo": {
                "py_callstack": "".join(traceback.format_exception(exc_type, exc, tb)),
                "timestamp": str(int(now)),
                "time": now,
                "rank": _env_int("RANK", 0),
            },
        }
    }
    atomic_write_text(path, json.dumps(data))


#: Where ``faulthandler`` writes this rank's stacks; kept open for the life of the process.
_stacks_file = None


def _record_stacks_on_termination() -> None:
    """Dump every thread's Python stack to ``stacks.txt`` beside the rank's error file when the launcher asks
    before stopping the job (SIGUSR1), when the rank is stopped (SIGTERM, sent by torchrun or the launcher)
    or when it crashes (segfault, abort).

    A rank stuck in a collective or killed on a timeout raises nothing, so this is the only record of what
    it was doing; ``faulthandler`` writes it from the signal handler even while the rank waits inside C
    code, then lets SIGTERM end the process as before. The launcher maps the frames to cells.

    Called again after the process group is joined: NCCL installs its own SIGABRT handler there, and its
    watchdog ends a rank whose collective timed out with an abort, whose stack is the one that matters.
    """
    global _stacks_file
    import faulthandler
    import signal

    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not error_file:
        return
    try:
        if _stacks_file is None:
            _stacks_file = open(os.path.join(os.path.dirname(error_file), "stacks.txt"), "w", encoding="utf-8")
            _stacks_file.write(f"nbddp: stacks of rank {_env_int('RANK', 0)} (pid {os.getpid()})\n")
            _stacks_file.flush()
            faulthandler.register(signal.SIGTERM, file=_stacks_file, all_threads=True, chain=True)
            if hasattr(signal, "SIGUSR1"):  # the launcher's "say where you are" (``launch.ask_for_stacks``)
                faulthandler.register(signal.SIGUSR1, file=_stacks_file, all_threads=True, chain=False)
        faulthandler.enable(file=_stacks_file, all_threads=True)
    except (OSError, ValueError, AttributeError):  # no such folder; not the main thread; no SIGTERM here
        pass
