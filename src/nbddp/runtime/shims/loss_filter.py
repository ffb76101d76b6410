"""The HF Trainer's NaN/Inf loss filter, computed on the device instead of waiting for the GPU every step.

With ``logging_nan_inf_filter=True`` (the default) the Trainer checks each step's loss with
``torch.isnan(loss) or torch.isinf(loss)``: the Python ``or`` turns a GPU tensor into a ``bool``, so the CPU
waits for the whole step (forward, backward and, under DDP, the gradient all-reduce) to finish before it
may queue anything more. The GPU then idles while the CPU steps the optimizer, loads the next batch and
starts the next forward. Under DDP every rank idles for its own length of time and the next all-reduce
waits for the slowest, so the stall costs more on several GPUs than on one.

What it does: while ``Trainer.train`` runs, each step's loss goes through the same filter on the device —
``torch.where(torch.isfinite(loss), loss, running / (1 + steps since the last log))``, the value the
Trainer itself adds for a NaN or Inf loss — and the Trainer's own check is off for that call only (the
user's ``args`` get their value back afterwards). The logged losses are the same numbers; the filter only
ever touched logging, never the gradients. It applies only when the installed Trainer's filter is the one
reproduced here (its running loss in ``self._tr_loss``); other versions keep their own check. A user who
set ``logging_nan_inf_filter=False`` is left alone.

Per-step synchronisations elsewhere remain: fp16's gradient scaler reads its overflow flag every step, and
TRL's ``SFTTrainer`` computes token accuracy and entropy with ``.item()`` in every ``compute_loss``.
"""

from __future__ import annotations

import functools
import inspect

from ..patching import installed, when_imported, wrap
from . import say

NAME = "loss_filter"

#: The Trainer's own NaN/Inf replacement, as its source writes it; the shim computes exactly this.
TRAINER_FILTER = "self._tr_loss += self._tr_loss / (1 + self.state.global_step - self._globalstep_last_logged)"


def detect() -> bool:
    return installed("transformers")


def apply() -> str | None:
    when_imported("transformers.trainer", _patch)
    return None  # the message comes at the first train() it changes


def reproduces(trainer_class) -> bool:
    """Whether ``trainer_class``'s training loop filters the loss the way ``filtered_loss`` does."""
    for name in ("_run_epoch", "_inner_training_loop"):
        method = getattr(trainer_class, name, None)
        try:
            if method is not None and TRAINER_FILTER in inspect.getsource(method):
                return True
        except (OSError, TypeError):
            continue
    return False


def filtered_loss(trainer, loss):
    """The loss the Trainer adds to its running total, computed without leaving the device."""
    import torch

    running = trainer._tr_loss
    replacement = running / (1 + trainer.state.global_step - trainer._globalstep_last_logged)
    return torch.where(torch.isfinite(loss), loss, replacement)  # promotes as the Trainer's += does


def _patch(module) -> None:
    if reproduces(module.Trainer):
        wrap(module.Trainer, "train", _make_train)


def _make_train(train):
    def train_filtering_on_device(self, *args, **kwargs):
        if not getattr(self.args, "logging_nan_inf_filter", False) or "training_step" in vars(self):
            return train(self, *args, **kwargs)
        step = self.training_step

        @functools.wraps(step)
        def training_step(*a, **kw):
            loss = step(*a, **kw)
            running = getattr(self, "_tr_loss", None)
            if hasattr(loss, "device") and getattr(running, "device", None) == loss.device:
                return filtered_loss(self, loss)
            return loss  # the Trainer refuses a loss on another device itself

        say("Trainer's NaN/Inf loss filter runs on the device, so the CPU no longer waits for every step to "
            "finish (logged losses unchanged)")
        self.training_step = training_step
        self.args.logging_nan_inf_filter = False
        try:
            return train(self, *args, **kwargs)
        finally:
            self.args.logging_nan_inf_filter = True
            del self.training_step

    return train_filtering_on_device
