"""A kept job's rank after the notebook's cells (``%%ddp_train --keep``): it stays up, holding the script's
namespace (the model, the trainer, the data), and runs what the kernel sends until told to stop.

The channel is the kernel's Unix socket (``NBDDP_KEEP_SOCKET``, in a 0700 folder) through
``multiprocessing.connection``, whose handshake proves the per-job key (``NBDDP_KEEP_KEY``); the kernel also
checks this process' uid. A reader thread takes every message, so a stop request reaches a rank busy in a
cell: the Trainer then stops at the next step boundary, all ranks together (``StopAtStep``, one all-reduce per
step). The rank ends with its kernel: the socket closing (a restart, a killed kernel) ends it at once; so do
``%ddp_stop`` and the idle limit (``NBDDP_KEEP_IDLE``, seconds without a message). Messages are tuples:
``("run", path, first, last)`` runs lines first..last of a converted cell's script, ``("pull", name)``,
``("push", name, value)``, ``("status",)``, ``("stop",)``; each is answered ``("ok", value)`` or
``("error", message, traceback)``. Nothing here imports IPython, nbformat or libcst.
"""

from __future__ import annotations

import contextlib
import os
import queue
import sys
import threading
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
    idle_s = float(os.environ.get(IDLE_ENV) or 0) or None
    while True:
        try:
            message = inbox.get(timeout=idle_s)
        except queue.Empty:
            if info.is_main:
                print(f"nbddp: the kept job was idle for {idle_s / 60:g} min (--idle-limit): ending it", flush=True)
            return
        if message is None or message[0] == "stop":
            return
        _stop_requested.clear()
        reply = _handle(message, namespace, info)
        _flush()
        _send(conn, reply)


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


_callback_class = None


def _stop_callback():
    """The Trainer callback that stops training on every rank at the same step once any rank was asked:
    the flag is all-reduced (MAX) at each step's end, so no rank leaves a collective the others are in."""
    global _callback_class
    if _callback_class is None:
        import torch
        import torch.distributed as dist
        from transformers import TrainerCallback

        class StopAtStep(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                flag = torch.tensor([1.0 if _stop_requested.is_set() else 0.0], device=rank_info().device)
                if dist.is_available() and dist.is_initialized():
                    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
                if flag.item() > 0:
                    _stop_requested.set()
                    control.should_training_stop = True
                return control

        _callback_class = StopAtStep
    return _callback_class()
