"""Set a rank up and tear it down: device, process group, seeds, shims, and the records a failure leaves.

The generated script calls ``setup()`` first and ``cleanup()`` last; what it calls in between lives in
``dist`` and the other helper modules. Imported in every rank; nothing here imports IPython, nbformat or
libcst. Run without torchrun (plain ``python script.py``) it sets up a single process of rank 0.
"""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass
from datetime import timedelta

from . import records, settings
from .dist import seed_everything
from .rank import RankInfo, env_int, rank_info, remember, remembered, say

#: Seconds a collective may wait before the process group gives up (``NBDDP_TIMEOUT``).
DEFAULT_TIMEOUT_S = 1800


def setup() -> RankInfo:
    """Pick this rank's device, join the process group, and record uncaught errors for the launcher.

    Idempotent. The backend is nccl with GPUs and gloo without; ``NBDDP_TIMEOUT`` bounds collectives.
    Seeds every rank alike (``NBDDP_SEED``), prints the job's configuration once (rank 0), applies the shims.
    Also: weight files saved atomically (``saves``), stacks dumped when the rank is stopped, and
    ``NBDDP_RESUME=1`` resuming ``trainer.train()`` from the last checkpoint (``resume``).
    """
    if remembered() is not None:
        return remembered()
    rank_settings = settings.load()  # every NBDDP_* setting, read once for the life of the rank
    _record_uncaught_errors()
    _record_stacks_on_termination()
    _install("before torch")
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
        seconds = rank_settings.timeout  # NBDDP_TIMEOUT
        timeout = timedelta(seconds=DEFAULT_TIMEOUT_S if seconds is None else seconds)
        dist.init_process_group(backend=info.backend, timeout=timeout)
        _record_stacks_on_termination()  # again: joining an NCCL group replaces the SIGABRT handler
    if rank_settings.launched_nproc and info.world_size == 1:
        _leave_the_agent_store()
    remember(info)
    seed = seed_everything()
    _install("after the group")
    if info.is_main:
        from .report import get_multi_gpu_config

        print(get_multi_gpu_config(info, seed).summary(), flush=True)
    _install("after the summary")
    return info


def _leave_the_agent_store() -> None:
    """Launched mode: the notebook's one process runs as its kernel would. torchelastic tells its ranks to
    use the agent's store (``TORCHELASTIC_USE_AGENT_STORE``), so that every rank of an env:// rendezvous is a
    client of it; a process group the notebook makes itself (forked children meeting on a port of their own,
    as a course's practice notebook does before its ``!torchrun`` cells) would then wait for a store nobody
    serves. This one-process job has no group of its own to join, so the variable goes."""
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)


@dataclass(frozen=True)
class Install:
    """One thing ``setup()`` installs in a rank: its module, the function called, when, and its one switch."""

    module: str  # under nbddp.runtime
    call: str  # the function setup() calls (given ``log=say`` where it takes one)
    phase: str  # "before torch", "after the group" (seeded, rank remembered) or "after the summary"
    switch: str  # the one NBDDP_* name that turns it off (or on); the module reads it
    why: str


#: Everything ``setup()`` installs in a rank, in order. The shims (``shims.SHIMS``, applied by
#: ``shims.apply_all`` in their own order) each answer to ``NBDDP_SHIM_<NAME>``; the features that had no switch
#: (``saves``, ``notices``, ``unused_params``, ``launchers``) answer to the same family, on unless it says 0.
INSTALLS: tuple[Install, ...] = (
    Install("streams", "install", "before torch", "NBDDP_SHIM_STREAMS",
            "printed output the disk refuses (full) is dropped, never raised in the training"),
    Install("rundir", "protect", "before torch", "NBDDP_RUN_DIR",
            "the notebook's code may not delete the run directory it runs in (unset: nothing protected)"),
    Install("notices", "quiet", "before torch", "NBDDP_SHIM_NOTICES",
            "library log lines nobody can act on, quieted before the notebook imports the library"),
    Install("saves", "install", "before torch", "NBDDP_SHIM_SAVES",
            "weight files saved atomically; before anything imports transformers or peft, which bind save_file"),
    Install("metrics", "attach", "after the group", "NBDDP_METRICS", "rank 0's Trainer logs streamed (unset: off)"),
    Install("balance", "attach", "after the group", "NBDDP_BALANCE", "the Trainer's sampler token-balanced (0: off)"),
    Install("rich", "install", "after the group", "NBDDP_RICH_DISPLAY", "display() sent to the kernel (1: on)"),
    Install("resume", "attach", "after the group", "NBDDP_RESUME", "trainer.train() resumes (1: on)"),
    Install("shims", "apply_all", "after the summary", "NBDDP_SHIM_<NAME>", "each shim of shims.SHIMS, in order"),
    Install("apply_strategy", "install", "after the summary", "NBDDP_STRATEGY", "fsdp, split, deepspeed (ddp: nothing)"),
    Install("divergence", "install", "after the summary", "NBDDP_ALLOW_DIVERGENCE",
            "replicas that drift apart stop the job (1: off)"),
    Install("unused_params", "install", "after the summary", "NBDDP_SHIM_UNUSED_PARAMS",
            "DDP's 'finished reduction' error names the parameters and the fix"),
    Install("launchers", "install", "after the summary", "NBDDP_SHIM_LAUNCHERS",
            "notebook_launcher(fn, args) runs fn(*args) in every rank"),
)

#: Calls that take the rank-0 printer.
_TAKES_LOG = {("resume", "attach"), ("shims", "apply_all"), ("apply_strategy", "install")}


def _install(phase: str) -> None:
    """Call, in order, what ``INSTALLS`` lists for ``phase``; those of the ``NBDDP_SHIM_`` family are skipped
    when their switch says 0 (the others read their own setting inside)."""
    import importlib

    for item in INSTALLS:
        if item.phase != phase:
            continue
        if item.switch.startswith("NBDDP_SHIM_") and "<" not in item.switch and \
                settings.current().switch(item.switch.removeprefix("NBDDP_SHIM_")) is False:
            continue
        call = getattr(importlib.import_module(f"{__package__}.{item.module}"), item.call)
        call(log=say) if (item.module, item.call) in _TAKES_LOG else call()


def cleanup() -> None:
    """Wait for every rank, then leave the process group. Safe to call twice or without ``setup()``.

    The wait and the moment after it are what keep a finished rank from aborting at exit (``sync``). In a
    kept job (``%%ddp_train --keep``) the rank first serves the kernel with the script's namespace (the
    caller's globals) until it is stopped (``serve``).
    """
    import torch.distributed as dist

    from . import serve, sync

    if serve.kept():
        serve.serve(sys._getframe(1).f_globals)

    if dist.is_available() and dist.is_initialized():
        with contextlib.suppress(Exception):
            sync.wait_for_every_rank(rank_info().device)
        dist.destroy_process_group()
        sync.settle_workers()


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
    """torch elastic's error record (``records.error_record``) of this rank, written atomically: the agent
    may read it while this rank dies."""
    import json

    from .io import atomic_write_text

    atomic_write_text(path, json.dumps(records.error_record(exc_type, exc, tb, rank=env_int("RANK", 0))))


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
            path = os.path.join(os.path.dirname(error_file), records.STACKS_FILE)
            _stacks_file = open(path, "w", encoding="utf-8")
            _stacks_file.write(records.stacks_header(env_int("RANK", 0), os.getpid()))
            _stacks_file.flush()
            faulthandler.register(signal.SIGTERM, file=_stacks_file, all_threads=True, chain=True)
            if hasattr(signal, "SIGUSR1"):  # the launcher's "say where you are" (``launch.ask_for_stacks``)
                faulthandler.register(signal.SIGUSR1, file=_stacks_file, all_threads=True, chain=False)
        faulthandler.enable(file=_stacks_file, all_threads=True)
    except (OSError, ValueError, AttributeError):  # no such folder; not the main thread; no SIGTERM here
        pass
