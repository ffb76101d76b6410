"""The Trainer's token averaging across ranks, undone for a model that ignores ``num_items_in_batch``.

With ``average_tokens_across_devices=True`` (the default) and a model whose ``forward`` takes ``**kwargs``,
the Trainer counts the labels of the whole step on every rank, passes that count to the model as
``num_items_in_batch`` and multiplies the loss the model returns by the process count: a model that divides
its summed loss by that global count then gives, after DDP averages the gradients, the mean over all
tokens. A model that takes ``**kwargs`` but computes its own mean (``BertForSequenceClassification`` and
every ``*ForSequenceClassification`` that calls ``CrossEntropyLoss()``, a notebook's own module with
``**kwargs``) is multiplied all the same: on two ranks its logged training loss and ``eval_loss`` are
twice the kernel's and its gradients twice as large (with SGD, a doubled learning rate; with clipping, a
different clip).

What it does: ``Trainer.compute_loss`` divides that factor back out when the model ignores the count.
A model "uses" the count when the ``forward`` of it or of one of its submodules names
``num_items_in_batch`` or calls transformers' ``self.loss_function`` (the causal and masked LM heads do);
a ``compute_loss_func`` or a label smoother receives the count itself and is left alone. One process
multiplies by 1: nothing changes there, so the ranks give the kernel's numbers.
"""

from __future__ import annotations

import functools
import inspect

from ..patching import installed, when_imported, wrap
from . import say

NAME = "token_average"

#: What a ``forward`` that divides by the Trainer's count names in its source.
USES_COUNT = ("num_items_in_batch", "self.loss_function(")


def detect() -> bool:
    return installed("transformers")


def apply() -> str | None:
    when_imported("transformers.trainer", _patch)
    return None  # the message comes at the first loss it corrects


def _patch(module) -> None:
    wrap(module.Trainer, "compute_loss", _make_compute_loss)


@functools.lru_cache(maxsize=None)
def _forward_uses_count(module_class: type) -> bool:
    try:
        source = inspect.getsource(module_class.forward)
    except (OSError, TypeError, AttributeError):
        return True  # unreadable: keep the Trainer's own behaviour
    return any(name in source for name in USES_COUNT)


def uses_count(model) -> bool:
    """Whether ``model`` (or a submodule) divides its loss by the ``num_items_in_batch`` it is given."""
    modules = model.modules() if hasattr(model, "modules") else [model]
    return any(_forward_uses_count(type(m)) for m in modules)


def multiplied(trainer, num_items_in_batch) -> int:
    """The factor the Trainer's ``compute_loss`` multiplied the loss by for a model ignoring the count (1: none)."""
    args = trainer.args
    if not (getattr(args, "average_tokens_across_devices", False) and getattr(trainer, "model_accepts_loss_kwargs", False)):
        return 1
    if num_items_in_batch is None or trainer.compute_loss_func is not None or trainer.label_smoother is not None:
        return 1
    scale = trainer.accelerator.num_processes // trainer.get_tp_size() if args.n_gpu <= 1 else args.n_gpu
    if scale <= 1 or _model_uses_count(trainer):
        return 1
    return scale


def _model_uses_count(trainer) -> bool:
    """``uses_count`` of the trainer's model, read once per model (not every step: a large model has thousands
    of modules)."""
    cached = getattr(trainer, "_nbddp_uses_count", None)
    if cached is None or cached[0] is not trainer.model:  # unwrapped only when the trainer's model is new
        cached = (trainer.model, uses_count(trainer.accelerator.unwrap_model(trainer.model)))
        trainer._nbddp_uses_count = cached
    return cached[1]


def _make_compute_loss(compute_loss):
    def compute_loss_as_in_one_process(self, model, inputs, return_outputs=False, num_items_in_batch=None, **kw):
        result = compute_loss(self, model, inputs, return_outputs=return_outputs,
                              num_items_in_batch=num_items_in_batch, **kw)
        scale = multiplied(self, num_items_in_batch)
        if scale == 1:
            return result
        say(f"the model takes **kwargs but computes its own mean loss: the Trainer's multiplication by the "
            f"{scale} processes (meant for a loss divided by the whole step's token count) is undone, so the "
            f"loss and the gradients are the kernel's")
        if return_outputs:
            loss, outputs = result
            return loss / scale, outputs
        return result / scale

    return compute_loss_as_in_one_process
