"""The escape hatch: ``NBDDP_DISABLE_CHECKPOINTING=1`` (``nbddp run --no-checkpointing``) turns every
gradient checkpointing path into a plain call.

For when checkpointing itself is the problem (a library's checkpointing that DDP cannot be made to accept,
a recompute that is not deterministic) and the memory is there. Each path is closed where it starts, so
the libraries' own state says "off" and their DDP choices follow:

- ``torch.utils.checkpoint.checkpoint`` (direct calls, and every layer that checkpoints through it) calls
  the function directly (``runtime.checkpointing``);
- transformers' ``activation_checkpointing_enable`` / ``gradient_checkpointing_enable`` do nothing, which
  also covers PEFT's ``prepare_model_for_kbit_training`` and Unsloth's loaders that call them;
- ``TrainingArguments`` (and TRL's configs, which default it on) come out with ``gradient_checkpointing``
  and ``activation_checkpointing`` False;
- PEFT's ``prepare_model_for_kbit_training`` and Unsloth's ``get_peft_model`` / ``from_pretrained`` get
  ``use_gradient_checkpointing=False``.

Libraries are patched when they are imported (``wrapt`` post-import hooks), so the order of the user's
imports does not matter and libraries never imported are never touched.
"""

from __future__ import annotations

import functools
import inspect

from .. import checkpointing
from ..patching import when_imported, wrap

NAME = "no_checkpointing"

MESSAGE = (
    "Gradient checkpointing disabled (NBDDP_DISABLE_CHECKPOINTING=1): every checkpointed block runs as a "
    "plain call. Faster, but all activations stay in memory — lower the batch size or the sequence length "
    "if a GPU runs out of memory."
)


def detect() -> bool:
    """Never needed by itself: only its switch turns it on (``NBDDP_SHIM_NO_CHECKPOINTING=1``, or the older
    ``NBDDP_DISABLE_CHECKPOINTING=1`` that ``--no-checkpointing`` sets, an alias in ``shims.ALIASES``)."""
    return False


def apply() -> str:
    checkpointing.install(disabled=True)
    for module, patch in _PATCHES:
        when_imported(module, patch)
    return MESSAGE


def _no_op_enable(original):
    @functools.wraps(original)
    def enable(self, *args, **kwargs):
        return None

    return enable


def _patch_transformers_models(module) -> None:
    for name in ("activation_checkpointing_enable", "gradient_checkpointing_enable"):
        wrap(module.PreTrainedModel, name, _no_op_enable)


def _patch_training_args(module) -> None:
    def make(original):
        @functools.wraps(original)
        def __post_init__(self, *args, **kwargs):
            original(self, *args, **kwargs)
            for field in ("activation_checkpointing", "gradient_checkpointing"):
                if hasattr(self, field):
                    setattr(self, field, False)

        return __post_init__

    wrap(module.TrainingArguments, "__post_init__", make)


def _without_checkpointing(original):
    """``original`` called with ``use_gradient_checkpointing=False``, however the caller passed it."""
    signature = inspect.signature(original)
    if "use_gradient_checkpointing" not in signature.parameters:
        return original

    @functools.wraps(original)
    def call(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.arguments["use_gradient_checkpointing"] = False
        return original(*bound.args, **bound.kwargs)

    return call


def _patch_peft(module) -> None:
    # the function is re-exported: patch each name it is reachable by
    for owner in (module, getattr(module, "utils", None), getattr(getattr(module, "utils", None), "other", None)):
        if owner is not None:
            wrap(owner, "prepare_model_for_kbit_training", _without_checkpointing)


def _patch_unsloth(module) -> None:
    for cls_name in ("FastLanguageModel", "FastModel", "FastVisionModel"):
        cls = getattr(module, cls_name, None)
        for name in ("get_peft_model", "from_pretrained"):
            if cls is not None and hasattr(cls, name):
                wrap(cls, name, _without_checkpointing)


_PATCHES = (
    ("transformers.modeling_utils", _patch_transformers_models),
    ("transformers.training_args", _patch_training_args),
    ("peft", _patch_peft),
    ("unsloth", _patch_unsloth),
)
