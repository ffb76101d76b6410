"""A kept job's rank after the notebook's cells (``%%ddp_train --keep``): it stays up, holding the script's
namespace (the model, the trainer, the data), and runs what the kernel sends until told to stop.

The channel is the kernel's Unix socket (``NBDDP_KEEP_SOCKET``, in a 0700 folder) through
``multiprocessing.connection``, whose handshake proves the per-job key (``NBDDP_KEEP_KEY``); the kernel also
checks this process' uid. A reader thread takes every message, so a stop request reaches a rank busy in a
cell: the Trainer then stops at a step boundary, all ranks together (``StopAtStep``: one all-reduce about
every ``STOP_CHECK_S`` of training, at steps the ranks agree on). The rank ends with its kernel: the socket
closing (a restart, a killed kernel) ends it at once; so do
``%ddp_stop`` and the idle limit (``NBDDP_KEEP_IDLE``, seconds without a message). Messages are tuples:
``("run", path, first, last)`` runs lines first..last of a converted cell's script, ``("pull", name)``,
``("push", name, value)``, ``("status",)``, ``("stop",)``; each is answered ``("ok", value)`` or
``("error", message, traceback)``. Nothing here imports IPython, nbformat or libcst.
"""

from __future__ import annotations

import contextlib
import gc
import os
import queue
import sys
import threading
import time
import traceback

from .rank import rank_info

#: The environment a kept rank reads.
SOCKET_ENV, KEY_ENV, IDLE_ENV = "NBDDP_KEEP_SOCKET", "NBDDP_KEEP_KEY", "NBDDP_KEEP_IDLE"

_stop_requested = threading.Event()


def kept() -> bool:
    """Whether this rank was asked to stay up after the notebook's cells."""
    return bool(os.environ.get(SOCKET_ENV))


def serve(namespace: dict) -> None:
    """Connect to the kernel and run its requests in ``namespace`` until it says stop, goes, or stays idle."""
    from multiprocessing.connection import Client

    info = rank_info()
    address = os.environ.pop(SOCKET_ENV)  # served once: a second cleanup() call leaves the group
    conn = Client(address, family="AF_UNIX", authkey=bytes.fromhex(os.environ[KEY_ENV]))
    conn.send(("hello", info.rank, os.getpid(), _device_name(info.device)))
    inbox: queue.Queue = queue.Queue()
    threading.Thread(target=_read, args=(conn, inbox), daemon=True, name="nbddp-keep-reader").start()
    _install_stop_callback(namespace)
    settle = info.device == "cpu"  # see settle_heap: where memory is a GPU's, the library's collections stay whole
    if settle:
        settle_heap()  # the first request, if one came meanwhile, waits in the inbox
    idle_s = float(os.environ.get(IDLE_ENV) or 0) or None
    last, unsettled = time.monotonic(), False
    while True:
        left = None if idle_s is None else max(0.0, idle_s - (time.monotonic() - last))
        if unsettled:
            left = SETTLE_AFTER_S if left is None else min(left, SETTLE_AFTER_S)
        try:
            message = inbox.get(timeout=left)
        except queue.Empty:
            if unsettled:
                settle_heap()
                unsettled = False
                continue
            if info.is_main:
                print(f"nbddp: the kept job was idle for {idle_s / 60:g} min (--idle-limit): ending it", flush=True)
            return
        if message is None or message[0] == "stop":
            return
        _stop_requested.clear()
        reply = _handle(message, namespace, info)
        _flush()
        _send(conn, reply)
        last, unsettled = time.monotonic(), settle and message[0] in ("run", "push")


#: Seconds without a request after a cell before the rank settles its heap (``settle_heap``).
SETTLE_AFTER_S = 1.0


def settle_heap() -> None:
    """A full garbage collection, then every object left frozen out of later collections (``gc.freeze``).

    A kept rank holds half a million objects (torch, transformers, the model, the data), and every
    ``Trainer.train()`` begins with a full ``gc.collect()`` (accelerate's ``free_memory``) that walks them
    all: 0.3 s to 1 s of each 30-step cell on a small CPU machine. Frozen, they are not walked again; the
    collection then sees what the cells made since. Garbage among frozen objects (a model a cell replaced)
    is freed here, at the next quiet moment: the rank settles again after each cell that ran code, once no
    request came for ``SETTLE_AFTER_S``. CPU ranks only: on a GPU the collection at ``train()``'s start is
    what frees a replaced model's GPU memory before the new training allocates, so it must see everything.
    """
    gc.unfreeze()
    gc.collect()
    gc.freeze()


def _send(conn, reply: tuple) -> None:
    """The reply, or what kept it from being sent (a pulled value that does not pickle): the rank stays up."""
    try:
        conn.send(reply)
    except OSError:
        pass
    except Exception as exc:
        with contextlib.suppress(OSError):
            conn.send(("error", f"the value cannot be sent to the kernel: {type(exc).__name__}: {exc}", ""))


def _read(conn, inbox: queue.Queue) -> None:
    """Every message into ``inbox``; a stop request also raises the flag the Trainer checks; the kernel gone
    (EOF) ends the process at once, whatever the main thread is doing: a kept rank never outlives its kernel."""
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            _flush()
            os._exit(0)
        if message[0] == "interrupt":
            _stop_requested.set()
        else:
            inbox.put(message)


def _handle(message: tuple, namespace: dict, info) -> tuple:
    kind = message[0]
    try:
        if kind == "run":
            _, path, first, last = message
            _run(path, first, last, namespace)
            return ("ok", _stop_requested.is_set())
        if kind == "pull":
            return ("ok", namespace[message[1]])
        if kind == "push":
            namespace[message[1]] = message[2]
            return ("ok", None)
        if kind == "status":
            return ("ok", _status(info))
        return ("error", f"unknown request {kind!r}", "")
    except BaseException as exc:  # the cell's own failure, sent back whole; the rank stays up
        return ("error", f"{type(exc).__name__}: {exc}", traceback.format_exc())


def _run(path: str, first: int, last: int, namespace: dict) -> None:
    """Lines first..last of the converted script at ``path``, compiled at their own line numbers, so the
    kernel maps a traceback with the script's source map as it maps a job's."""
    with open(path, encoding="utf-8") as fh:
        lines = fh.read().splitlines()
    code = "\n" * (first - 1) + "\n".join(lines[first - 1:last]) + "\n"
    exec(compile(code, path, "exec"), namespace)


def _status(info) -> dict:
    import psutil

    status = {"rank": info.rank, "pid": os.getpid(), "device": info.device,
              "rss": psutil.Process().memory_info().rss, "gpu_memory": None}
    with contextlib.suppress(Exception):
        import torch

        if info.device.startswith("cuda"):
            status["gpu_memory"] = torch.cuda.memory_allocated(torch.device(info.device))
    return status


def _device_name(device: str) -> str:
    with contextlib.suppress(Exception):
        if device.startswith("cuda"):
            import torch

            return torch.cuda.get_device_name(torch.device(device))
    return device


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


def _install_stop_callback(namespace: dict) -> None:
    """``StopAtStep`` on every Trainer the namespace holds and on every Trainer made from now on."""
    try:
        import transformers.trainer as hf_trainer
        from transformers import Trainer
    except Exception:
        return
    callback = _stop_callback()
    if not any(isinstance(cb, type(callback)) for cb in hf_trainer.DEFAULT_CALLBACKS):
        hf_trainer.DEFAULT_CALLBACKS.append(type(callback))
    for value in list(namespace.values()):
        if isinstance(value, Trainer) and not any(isinstance(cb, type(callback)) for cb in value.callback_handler.callbacks):
            value.add_callback(type(callback))


#: Seconds of training between two looks at the stop flag: each look is one all-reduce that every rank must
#: enter at the same step, so the steps between looks are agreed in that all-reduce (``StopSchedule``).
STOP_CHECK_S = 0.25
#: At most this many steps between two looks, however short a step.
MAX_STOP_INTERVAL = 1000


class StopSchedule:
    """Which Trainer steps look at the stop flag: the first step of every ``train()``, then steps about
    ``STOP_CHECK_S`` of training apart. Each look's all-reduce carries every rank's proposed interval (from
    the time its steps took) and the largest is taken, so all ranks look again at the same step. A stop
    request is seen within ``STOP_CHECK_S`` and a step; the all-reduce no longer waits on every step, which on
    a small model's ~0.05 s steps cost more than the step's own communication."""

    def __init__(self, clock=time.perf_counter):
        self.clock = clock
        self.begin(0)

    def begin(self, step: int) -> None:
        self.next, self.since, self.since_step = step + 1, self.clock(), step

    def due(self, step: int) -> bool:
        return step >= self.next

    def proposal(self, step: int) -> int:
        """This rank's interval until the next look, from the mean time of the steps since the last one."""
        per_step = (self.clock() - self.since) / max(1, step - self.since_step)
        if per_step <= 0:
            return MAX_STOP_INTERVAL
        return int(max(1, min(MAX_STOP_INTERVAL, STOP_CHECK_S / per_step)))

    def agreed(self, step: int, interval: int) -> None:
        self.next, self.since, self.since_step = step + max(1, interval), self.clock(), step


_callback_class = None


def _stop_callback():
    """The Trainer callback that stops training on every rank at the same step once any rank was asked:
    the flag is all-reduced (MAX) at the steps ``StopSchedule`` agrees on, so no rank leaves a collective
    the others are in."""
    global _callback_class
    if _callback_class is None:
        import torch
        import torch.distributed as dist
        from transformers import TrainerCallback

        class StopAtStep(TrainerCallback):
            def __init__(self):
                self.schedule = StopSchedule()

            def on_train_begin(self, args, state, control, **kwargs):
                self.schedule.begin(state.global_step)

            def on_step_end(self, args, state, control, **kwargs):
                if not self.schedule.due(state.global_step):
                    return control
                values = torch.tensor([1.0 if _stop_requested.is_set() else 0.0,
                                       float(self.schedule.proposal(state.global_step))], device=rank_info().device)
                if dist.is_available() and dist.is_initialized():
                    dist.all_reduce(values, op=dist.ReduceOp.MAX)
                flag, interval = values.tolist()
                self.schedule.agreed(state.global_step, int(interval))
                if flag > 0:
                    _stop_requested.set()
                    control.should_training_stop = True
                return control

        _callback_class = StopAtStep
    return _callback_class()
