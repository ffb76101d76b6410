"""Rank 0's training progress as JSON lines, for the launcher's progress display and result.

``attach()`` adds ``MetricsCallback`` to every ``transformers`` Trainer made in this process (through the
Trainer's default callbacks) when the launcher set ``NBDDP_METRICS`` to a file path. One line per event:
``{"event": "begin"|"step"|"log"|"end", "step": …, "max_steps": …, "time": …, <the Trainer's logs>}``;
"begin" also says where the Trainer's ``output_dir`` is.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time

#: Least seconds between two "step" lines; "log", "begin" and "end" lines are always written.
STEP_INTERVAL_S = 0.25


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

        def _write(self, state, event: str, **extra) -> None:
            if not state.is_world_process_zero:
                return
            record = {"event": event, "step": state.global_step, "max_steps": state.max_steps,
                      "epoch": state.epoch, "time": time.time(), **extra}
            with open(path, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(record, default=float) + "\n")

        def on_train_begin(self, args, state, control, **kwargs):
            self._write(state, "begin", output_dir=os.path.abspath(args.output_dir or "."))

        def on_step_end(self, args, state, control, **kwargs):
            now = time.monotonic()
            if now - self._last_step_write >= STEP_INTERVAL_S or state.global_step == state.max_steps:
                self._last_step_write = now
                self._write(state, "step")

        def on_log(self, args, state, control, logs=None, **kwargs):
            self._write(state, "log", **{k: v for k, v in (logs or {}).items() if isinstance(v, (int, float, str))})

        def on_train_end(self, args, state, control, **kwargs):
            self._write(state, "end")

    return MetricsCallback
