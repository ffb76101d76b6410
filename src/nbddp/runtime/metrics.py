"""Rank 0's training progress as JSON lines, for the launcher's progress display and result.

``attach()`` adds ``MetricsCallback`` to every ``transformers`` Trainer made in this process (through the
Trainer's default callbacks) when the launcher set ``NBDDP_METRICS`` to a file path. One line per event:
``{"event": "begin"|"step"|"log"|"end", "step": …, "max_steps": …, "time": …, <the Trainer's logs>}``;
"begin" also says where the Trainer's ``output_dir`` is. "step" lines are written at most every
``STEP_INTERVAL_S``; the last completed step is also kept, at every step's end, in a small file beside them
(``last_step_path``), overwritten in place, so a job stopped between two "step" lines still says its step.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time

#: Least seconds between two "step" lines; "log", "begin" and "end" lines are always written.
STEP_INTERVAL_S = 0.25


def last_step_path(metrics_path: str | os.PathLike) -> str:
    """The file holding ``"<step> <max_steps>"`` of the last completed step, beside the metrics file."""
    return os.path.join(os.path.dirname(os.fspath(metrics_path)), "last_step")


def read_last_step(metrics_path: str | os.PathLike) -> tuple[int, int] | None:
    """``(step, max_steps)`` from ``last_step_path``, or None when there is none (no Trainer ran)."""
    try:
        with open(last_step_path(metrics_path), "rb") as fh:
            step, total = fh.read().split()[:2]
        return int(step), int(total)
    except (OSError, ValueError):
        return None


def attach() -> bool:
    """Register the callback with transformers' defaults; False when there is nothing to do.

    Registered once the notebook imports ``transformers.trainer``, not by importing it here: Unsloth must be
    imported before transformers, and a notebook that uses it does so after ``setup()``.
    """
    path = os.environ.get("NBDDP_METRICS")
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
            with open(path, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(record, default=float) + "\n")

        def on_train_begin(self, args, state, control, **kwargs):
            self._write(state, "begin", output_dir=os.path.abspath(args.output_dir or "."))

        def _note_step(self, state) -> None:
            """One ``pwrite`` per step, same width each time: the file always holds one whole record."""
            if not state.is_world_process_zero:
                return
            if self._last_step_fd is None:
                self._last_step_fd = os.open(last_step_path(path), os.O_WRONLY | os.O_CREAT, 0o600)
            os.pwrite(self._last_step_fd, b"%20d %20d\n" % (state.global_step, state.max_steps or 0), 0)

        def on_step_end(self, args, state, control, **kwargs):
            self._note_step(state)
            now = time.monotonic()
            if now - self._last_step_write >= STEP_INTERVAL_S or state.global_step == state.max_steps:
                self._last_step_write = now
                self._write(state, "step")

        def on_log(self, args, state, control, logs=None, **kwargs):
            self._write(state, "log", **{k: v for k, v in (logs or {}).items() if isinstance(v, (int, float, str))})

        def on_train_end(self, args, state, control, **kwargs):
            self._write(state, "end")

    return MetricsCallback
