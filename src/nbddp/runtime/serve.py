"""A kept job's rank after the notebook's cells (``%%ddp_train --keep``): it stays up, holding the script's
namespace (the model, the trainer, the data), and runs what the kernel sends until told to stop.

The channel is the kernel's Unix socket (``NBDDP_KEEP_SOCKET``, in a 0700 folder) through
``multiprocessing.connection``, whose handshake proves the per-job key (``NBDDP_KEEP_KEY``); the kernel also
checks this process' uid. A reader thread takes every message, so a stop request reaches a rank busy in a
cell: the Trainer then stops at a step boundary, all ranks together (``StopAtStep``: one all-reduce about
every ``STOP_CHECK_S`` of training, at steps the ranks agree on). The rank ends with its kernel: the socket
closing (a restart, a killed kernel) ends it at once; so do
``%ddp_stop`` and the idle limit (``NBDDP_KEEP_IDLE``, seconds without a message). The messages are the types
of ``kept_protocol``: ``Run`` lines of a converted cell's script, ``Pull``, ``Push``, ``Status``, ``Agree``,
``Stop``, and ``Where`` (answered at once by the reader thread: the running cell's line, ``At``); the others are
answered ``Ok``, ``Failed`` or, for a cell the kernel's Stop cut short, ``Interrupted``.

Stop (``Interrupt``, read by the reader thread): a training stops at the next agreed step (above); any other
code gets a ``KeyboardInterrupt`` where it is (SIGINT to the main thread, so a ``time.sleep`` or a blocking read
returns at once), and the rank answers and waits for the next request with its namespace intact. The kernel then
asks every rank to ``agree`` (one all-reduce with a timeout): a collective that one rank left mid-way shows there.
During the notebook's own cells (the ``--keep`` cell) the stop request is a file beside the socket
(``STOP_FILE``), since the rank connects only once those cells ran: ``listen_for_stop`` installs the same step
check then. Nothing here imports IPython, nbformat or libcst.
"""

from __future__ import annotations

import contextlib
import gc
import os
import queue
import signal
import sys
import threading
import time
import traceback

from .kept_protocol import (Agree, At, Ended, Failed, Hello, Interrupt, Interrupted, Ok, Pull, Push, Reply, Run,
                            Status, Stop, Where, send)
from .rank import rank_info

#: The environment a kept rank reads.
SOCKET_ENV, KEY_ENV, IDLE_ENV = "NBDDP_KEEP_SOCKET", "NBDDP_KEEP_KEY", "NBDDP_KEEP_IDLE"

_stop_requested = threading.Event()
#: Set while a ``run`` request's code runs: a kernel's Stop then interrupts it (``_interrupt_cell``).
_cell_running = threading.Event()
#: Set while a Trainer trains (``StopAtStep``): a Stop then waits for the agreed step instead.
_training = threading.Event()
#: The file whose presence asks the notebook's own training (the ``--keep`` cell) to stop at a step: beside
#: the socket, in the kernel's 0700 folder. None once the rank serves (Stop then comes on the channel).
STOP_FILE = "stop"
_stop_file: str | None = None
#: Seconds the ranks' agreement after a Stop may take (one all-reduce) before the kernel is told they disagree.
AGREE_S = 5.0


def kept() -> bool:
    """Whether this rank was asked to stay up after the notebook's cells."""
    return bool(os.environ.get(SOCKET_ENV))


def serve(namespace: dict) -> None:
    """Connect to the kernel and run its requests in ``namespace`` until it says stop, goes, or stays idle."""
    from multiprocessing.connection import Client

    global _stop_file
    info = rank_info()
    address = os.environ.pop(SOCKET_ENV)  # served once: a second cleanup() call leaves the group
    _stop_file = None  # from here a Stop comes on the channel
    signal.signal(signal.SIGINT, _interrupt_cell)
    conn = Client(address, family="AF_UNIX", authkey=bytes.fromhex(os.environ[KEY_ENV]))
    send(conn, Hello(info.rank, os.getpid(), _device_name(info.device)))
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
            _send(conn, Ended(f"the idle limit ended it: no request for {idle_s / 60:g} min (--idle-limit)"))
            return
        if message is None or isinstance(message, Stop):
            return
        _stop_requested.clear()
        reply = _handle(message, namespace, info)
        _flush()
        _send(conn, reply)
        last, unsettled = time.monotonic(), settle and isinstance(message, (Run, Push))


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


_send_lock = threading.Lock()  # the reader thread answers "where" while the main thread may answer a request
_cell_path: str | None = None  # the converted cell running now


def _send(conn, reply) -> None:
    """The reply, or what kept it from being sent (a pulled value that does not pickle): the rank stays up."""
    try:
        with _send_lock:
            send(conn, reply)
    except OSError:
        pass
    except Exception as exc:
        with contextlib.suppress(OSError), _send_lock:
            send(conn, Failed(f"the value cannot be sent to the kernel: {type(exc).__name__}: {exc}"))


def _read(conn, inbox: queue.Queue) -> None:
    """Every message into ``inbox``; a stop request raises the flag the Trainer checks, or interrupts the cell
    (``interrupt``); the kernel gone (EOF) ends the process at once, whatever the main thread is doing: a kept
    rank never outlives its kernel."""
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            _flush()
            os._exit(0)
        if isinstance(message, Interrupt):
            interrupt()
        elif isinstance(message, Where):
            _send(conn, At(where()))
        else:
            inbox.put(message)


def interrupt() -> None:
    """The kernel's Stop: a training stops at the next agreed step; other code of a cell gets a
    ``KeyboardInterrupt`` where it is. SIGINT goes to the main thread itself, so a system call it waits in
    (``time.sleep``, a socket read) returns at once instead of after it ends."""
    _stop_requested.set()
    if _interruptible():
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)


def where() -> int | None:
    """The line of the running cell's script the main thread is at (its innermost frame there), or None."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    path = _cell_path
    while frame is not None and path is not None:
        if frame.f_code.co_filename == path:
            return frame.f_lineno
        frame = frame.f_back
    return None


def _interrupt_cell(signum, frame) -> None:
    """The rank's SIGINT handler while it serves: a cell running outside a training is interrupted; between
    cells, or once training takes the Stop at its step, the signal is let go."""
    if _interruptible():
        raise KeyboardInterrupt


def _interruptible() -> bool:
    """Whether a Stop interrupts where the main thread is: a cell runs, and no training takes it at a step."""
    return _cell_running.is_set() and not _training.is_set()


def _handle(message, namespace: dict, info) -> Reply:
    """A request of the main thread's inbox, answered (``Stop``, ``Interrupt`` and ``Where`` never come here)."""
    try:
        match message:
            case Run(path, first, last):
                _run(path, first, last, namespace)
                return Ok(_stop_requested.is_set())
            case Pull(name):
                return Ok(namespace[name])
            case Push(name, value):
                namespace[name] = value
                return Ok()
            case Status():
                return Ok(_status(info))
            case Agree():
                return Ok(agree())
        return Failed(f"unknown request {message!r}")
    except KeyboardInterrupt:  # the kernel's Stop, where the cell was: not a failure
        return Interrupted(traceback.format_exc())
    except BaseException as exc:  # the cell's own failure, sent back whole; the rank stays up
        return Failed(f"{type(exc).__name__}: {exc}", traceback.format_exc())


def _run(path: str, first: int, last: int, namespace: dict) -> None:
    """Lines first..last of the converted script at ``path``, compiled at their own line numbers, so the
    kernel maps a traceback with the script's source map as it maps a job's."""
    with open(path, encoding="utf-8") as fh:
        lines = fh.read().splitlines()
    code = "\n" * (first - 1) + "\n".join(lines[first - 1:last]) + "\n"
    compiled = compile(code, path, "exec")
    global _cell_path
    _cell_path = path
    _cell_running.set()
    try:
        exec(compiled, namespace)
    finally:
        _cell_running.clear()
        _training.clear()
        _cell_path = None


def agree(timeout_s: float = AGREE_S) -> str | None:
    """After a Stop: one all-reduce every rank must enter, within ``timeout_s``. None when the ranks agree; else
    why not (a rank that left a collective mid-way pairs this one with it, or never meets it)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    import torch
    from datetime import timedelta

    ones = torch.ones(1, device=rank_info().device)
    try:
        dist.all_reduce(ones, async_op=True).wait(timeout=timedelta(seconds=timeout_s))
    except Exception as exc:
        return f"the ranks' check after the Stop failed ({type(exc).__name__})"
    if int(ones.item()) != dist.get_world_size():
        return "the ranks' check after the Stop met a collective one rank had left mid-way"
    return None


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


def listen_for_stop() -> None:
    """A kept job's rank, before the notebook's cells run: every Trainer they make stops at a step boundary,
    all ranks together, once the kernel's Stop wrote ``STOP_FILE`` beside the socket (the ``--keep`` cell)."""
    global _stop_file
    if not kept():
        return
    _stop_file = os.path.join(os.path.dirname(os.environ[SOCKET_ENV]), STOP_FILE)
    from .patching import when_imported
    from .trainer_rows import guard

    # first: the blocks' wrapper of the evaluation loop goes inside the Stop's, whose looks then span a block's
    # missed steps too (trainer_rows._take_the_missed_looks)
    guard()
    when_imported("transformers.trainer", lambda module: _install_stop_callback({}))


def _asked_to_stop() -> bool:
    return _stop_requested.is_set() or (_stop_file is not None and os.path.exists(_stop_file))


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
    from .patching import wrap

    wrap(Trainer, "evaluation_loop", _evaluation_takes_the_stop)
    for value in list(namespace.values()):
        if isinstance(value, Trainer) and not any(isinstance(cb, type(callback)) for cb in value.callback_handler.callbacks):
            value.add_callback(type(callback))


#: Set while a Trainer evaluates outside a training: its Stop comes at an agreed prediction step (``StopAtStep``).
_evaluating = threading.Event()


def _evaluation_takes_the_stop(original):
    """``Trainer.evaluation_loop`` (``evaluate``, ``predict``) outside a training: a Stop is taken at a prediction
    step all ranks agree on, where each raises ``KeyboardInterrupt`` together, not by a signal that could leave one
    rank inside a gather the others never enter. Inside ``train()`` the training's own stop stands."""
    def evaluation_loop(self, *args, **kwargs):
        if _training.is_set() or not _cell_running.is_set():  # in a training, or in the notebook's own cells
            return original(self, *args, **kwargs)
        for cb in self.callback_handler.callbacks:
            if hasattr(cb, "begin_evaluation"):
                cb.begin_evaluation()
        _training.set()
        _evaluating.set()
        try:
            return original(self, *args, **kwargs)
        finally:
            _evaluating.clear()
            _training.clear()

    return evaluation_loop


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
                self.evaluation, self.predicted = StopSchedule(), 0

            def begin_evaluation(self):
                self.predicted = 0
                self.evaluation.begin(0)

            def on_prediction_step(self, args, state, control, **kwargs):
                if not _evaluating.is_set():
                    return control
                self._step(self.predicted + 1)
                return control

            def finish_evaluation(self, steps: int) -> None:
                """The looks of steps up to ``steps`` that this rank's loop did not reach (a block of fewer
                batches than another rank's: ``trainer_rows``), taken as its loop would have taken them."""
                while _evaluating.is_set() and self.predicted < steps:
                    self._step(self.predicted + 1)

            def _step(self, step: int) -> None:
                self.predicted = step
                if self.evaluation.due(step) and self._agreed_stop(self.evaluation, step):
                    raise KeyboardInterrupt  # on every rank at this step: none is left inside a gather

            @staticmethod
            def _agreed_stop(schedule, step) -> bool:
                """The stop flag and the next look, agreed by every rank in one all-reduce (MAX)."""
                values = torch.tensor([1.0 if _asked_to_stop() else 0.0, float(schedule.proposal(step))],
                                      device=rank_info().device)
                if dist.is_available() and dist.is_initialized():
                    dist.all_reduce(values, op=dist.ReduceOp.MAX)
                flag, interval = values.tolist()
                schedule.agreed(step, int(interval))
                return flag > 0

            def on_train_begin(self, args, state, control, **kwargs):
                self.schedule.begin(state.global_step)
                _training.set()

            def on_train_end(self, args, state, control, **kwargs):
                _training.clear()

            def on_step_end(self, args, state, control, **kwargs):
                if not self.schedule.due(state.global_step):
                    return control
                if self._agreed_stop(self.schedule, state.global_step):
                    _stop_requested.set()
                    control.should_training_stop = True
                return control

        _callback_class = StopAtStep
    return _callback_class()
