"""Rank 0's training progress as JSON lines, for the launcher's progress display and result.

``attach()`` adds ``MetricsCallback`` to every ``transformers`` Trainer made in this process (through the
Trainer's default callbacks) when the launcher set ``NBDDP_METRICS`` to a file path. One line per event:
``{"event": "begin"|"step"|"log"|"end", "step": …, "max_steps": …, "time": …, <the Trainer's logs>}``;
"begin" also says where the Trainer's ``output_dir`` is. "step" lines are written at most every
``STEP_INTERVAL_S``; the last completed step is also kept, at every step's end, in a small file beside them
(``last_step_path``), overwritten in place, so a job stopped between two "step" lines still says its step.
A line or step the disk refuses (full) is dropped with one warning (``records.append_line``): these records are
a help to the job, never what ends its training.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time

from . import settings
from .records import Event, append_line, dropped_write, last_step_path, write_last_step

#: Least seconds between two "step" lines; "log", "begin" and "end" lines are always written.
STEP_INTERVAL_S = 0.25


def attach() -> bool:
    """Register the callback with transformers' defaults; False when there is nothing to do.

    Registered once the notebook imports ``transformers.trainer``, not by importing it here: Unsloth must be
    imported before transformers, and a notebook that uses it does so after ``setup()``.
    """
    path = settings.current().metrics  # NBDDP_METRICS
    if not path or importlib.util.find_spec("transformers") is None:
        return False
    from .patching import when_imported

    when_imported("transformers.trainer", lambda hf_trainer: _register(hf_trainer, path))
    return True


def _register(hf_trainer, path: str) -> None:
    if not any(getattr(cb, "_nbddp", False) for cb in hf_trainer.DEFAULT_CALLBACKS):
        hf_trainer.DEFAULT_CALLBACKS.append(make_callback(path))


def make_callback(path: str):
    from transformers import TrainerCallback

    class MetricsCallback(TrainerCallback):
        """Append rank 0's training events to a JSON-lines file."""

        _nbddp = True

        def __init__(self):
            self._last_step_write = 0.0
            self._last_step_fd: int | None = None

        def _write(self, state, event: str, **extra) -> None:
            if not state.is_world_process_zero:
                return
            record = {"event": event, "step": state.global_step, "max_steps": state.max_steps,
                      "epoch": state.epoch, "time": time.time(), **extra}
            append_line(path, json.dumps(record, default=float))  # a full disk drops it: the training goes on

        def on_train_begin(self, args, state, control, **kwargs):
            self._write(state, Event.BEGIN, output_dir=os.path.abspath(args.output_dir or "."))

        def _note_step(self, state) -> None:
            """One write per step, in place (``records.write_last_step``)."""
            if not state.is_world_process_zero:
                return
            try:
                if self._last_step_fd is None:
                    self._last_step_fd = os.open(last_step_path(path), os.O_WRONLY | os.O_CREAT, 0o600)
                write_last_step(self._last_step_fd, state.global_step, state.max_steps)
            except OSError as exc:  # a full disk, a deleted run directory: the step is not kept, the training goes on
                dropped_write(last_step_path(path), exc)

        def on_step_end(self, args, state, control, **kwargs):
            self._note_step(state)
            now = time.monotonic()
            if now - self._last_step_write >= STEP_INTERVAL_S or state.global_step == state.max_steps:
                self._last_step_write = now
                self._write(state, Event.STEP)

        def on_log(self, args, state, control, logs=None, **kwargs):
            self._write(state, Event.LOG, **{k: v for k, v in (logs or {}).items() if isinstance(v, (int, float, str))})

        def on_train_end(self, args, state, control, **kwargs):
            self._write(state, Event.END)

    return MetricsCallback
