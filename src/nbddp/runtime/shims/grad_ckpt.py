"""DDP × gradient checkpointing: build every DDP wrapper so checkpointed training does not fail.

What breaks (all reproduced on two gloo ranks by ``tests/test_grad_ckpt.py``):

- **Reentrant checkpointing with ``find_unused_parameters=True``** — the HF Trainer picks that for every
  model that is not a ``PreTrainedModel``, so for every ``PeftModel``: the checkpointed parameters are
  marked unused after the forward and ready again when the backward recomputes them: "Expected to mark a
  variable ready only once … has been marked as ready twice". torch still defaults to reentrant when
  ``use_reentrant`` is not given (PEFT's ``prepare_model_for_kbit_training`` does not give it), and
  Unsloth's own checkpointing is always reentrant.
- **``static_graph=True`` while the parameters used change between steps**: "Your training graph has
  changed in this iteration …". ``static_graph`` is the usual recipe for checkpointing under DDP.
- **``static_graph=True`` with gradient accumulation** (``no_sync`` steps): "expect_autograd_hooks_
  INTERNAL ASSERT FAILED" in torch's reducer.

What it does: checkpoints that do not say ``use_reentrant`` run non-reentrant (``runtime.checkpointing``),
which DDP supports with any settings. At each DDP construction (``runtime.ddp_patch``) the wrapped model's
effective checkpointing is read, and ``decide`` settles the arguments: reentrant checkpointing gets
``find_unused_parameters=False`` and input gradients; a requested ``static_graph`` is dropped with gradient
accumulation, and with non-reentrant checkpointing (which does not need it). ``NBDDP_DDP_STATIC_GRAPH=
auto|0|1`` overrides the latter.
"""

from __future__ import annotations

import functools
import sys
import weakref
from dataclasses import dataclass

from .. import settings
from .. import checkpointing, ddp_patch
from . import say
from ..checkpointing import CheckpointFacts
from ..patching import when_imported, wrap

NAME = "grad_ckpt"


@dataclass(frozen=True)
class DDPSettings:
    """What ``decide`` settles for one DDP construction, with the lines to tell the user."""

    find_unused_parameters: bool
    static_graph: bool
    input_grads: bool
    messages: tuple[str, ...] = ()


def detect() -> bool:
    """Always: any script may checkpoint and build a DDP wrapper; the check itself happens at construction."""
    return True


def apply() -> str | None:
    checkpointing.install(non_reentrant_default=True)
    checkpointing.on_explicit_reentrant = _warn_if_ddp_finds_unused
    ddp_patch.register_adjuster(NAME, adjust)
    ddp_patch.register_hook(NAME, _built.add)
    when_imported("transformers.trainer", _track_trainers)
    return None  # the message comes when a DDP wrapper is built around a checkpointed model


def static_graph_mode() -> str:
    """``NBDDP_DDP_STATIC_GRAPH``: "auto" (default), "0" or "1"."""
    value = settings.current().ddp_static_graph  # NBDDP_DDP_STATIC_GRAPH
    return {"1": "1", "true": "1", "on": "1", "0": "0", "false": "0", "off": "0"}.get(value, "auto")


#: The arguments of the HF Trainers whose ``train()`` is running (it builds the DDP wrapper inside).
_training: list = []


def _track_trainers(module) -> None:
    def make(train):
        @functools.wraps(train)
        def tracked(self, *args, **kwargs):
            _training.append(self.args)
            try:
                return train(self, *args, **kwargs)
            finally:
                _training.pop()

        return tracked

    wrap(module.Trainer, "train", make)


def gradient_accumulation() -> int | None:
    """Micro-steps per optimizer step where it is known, else None (a hand-written loop).

    The HF Trainer accumulates itself (accelerate is told 1): its ``gradient_accumulation_steps`` counts.
    Otherwise accelerate's ``GradientState``, once an ``Accelerator`` set it up.
    """
    if _training:
        return int(_training[-1].gradient_accumulation_steps)
    state = sys.modules.get("accelerate.state")
    if state is None or not state.GradientState._shared_state:
        return None
    return int(state.GradientState().num_steps)


def decide(
    facts: CheckpointFacts,
    find_unused_parameters: bool,
    static_graph: bool,
    accumulation: int | None,
    mode: str = "auto",
) -> DDPSettings:
    """The DDP arguments that make ``facts``' checkpointing safe, from those the script asked for.

    ``accumulation`` None means unknown (a hand-written loop): then only what is known is acted on.
    """
    messages = []
    input_grads = facts.reentrant
    if facts.active:
        variant = "reentrant" if facts.reentrant else "non-reentrant"
        head = f"Gradient checkpointing detected on {facts.layers} modules ({facts.source}), {variant} ({facts.reason})"
        if facts.reentrant and find_unused_parameters:
            find_unused_parameters = False
            messages.append(
                f"{head} — DDP find_unused_parameters=False, since reentrant checkpointing marks parameters "
                "ready twice with it; input gradients enabled."
            )
        elif facts.reentrant:
            messages.append(f"{head} — input gradients enabled; DDP keeps find_unused_parameters=False.")
        else:
            messages.append(f"{head} — DDP supports it as configured.")
    keep = "NBDDP_DDP_STATIC_GRAPH=1 keeps it"
    if mode == "1" and not static_graph:
        static_graph = True
        messages.append("DDP static_graph=True (NBDDP_DDP_STATIC_GRAPH=1).")
    elif mode == "0" and static_graph:
        static_graph = False
        messages.append("DDP static_graph=False (NBDDP_DDP_STATIC_GRAPH=0).")
    elif mode == "auto" and static_graph and accumulation is not None and accumulation > 1:
        static_graph = False
        messages.append(
            f"DDP static_graph turned off: gradient accumulation is {accumulation} steps, and a static graph "
            f"with accumulation trips an internal assert in torch's reducer ({keep})."
        )
    elif mode == "auto" and static_graph and facts.active and not facts.reentrant:
        static_graph = False
        messages.append(
            "DDP static_graph turned off: non-reentrant checkpointing does not need it, and it fails as soon "
            f"as the parameters used change between steps ({keep})."
        )
    return DDPSettings(find_unused_parameters, static_graph, input_grads, tuple(messages))


def adjust(module, kwargs: dict) -> dict:
    """The ``runtime.ddp_patch`` adjuster: read the module's checkpointing, apply ``decide``, tell rank 0."""
    settings = decide(
        checkpointing.facts(module),
        bool(kwargs.get("find_unused_parameters")),
        bool(kwargs.get("static_graph")),
        gradient_accumulation(),
        static_graph_mode(),
    )
    if settings.input_grads:
        _enable_input_grads(module)
    for line in settings.messages:
        say(line)
    kwargs["find_unused_parameters"] = settings.find_unused_parameters
    kwargs["static_graph"] = settings.static_graph
    return kwargs


#: The DDP wrappers built in this process, for the check below.
_built: weakref.WeakSet = weakref.WeakSet()


def _warn_if_ddp_finds_unused() -> None:
    """A reentrant checkpoint the script calls itself cannot be seen when DDP is built; say so when it runs
    under a wrapper that looks for unused parameters, before DDP fails with a message naming neither."""
    if any(d.find_unused_parameters and not d.static_graph for d in list(_built)):
        say(
            "torch.utils.checkpoint(..., use_reentrant=True) runs inside a DDP model built with "
            "find_unused_parameters=True: its backward will fail with 'marked as ready twice'. Leave out "
            "use_reentrant=True (nbddp then runs the non-reentrant variant) or set find_unused_parameters=False."
        )


def _enable_input_grads(module) -> None:
    """Let the input embeddings' output need a gradient (transformers' own switch), once per model."""
    enable = getattr(module, "enable_input_require_grads", None)
    if enable is not None and not getattr(module, "_require_grads_hooks", None):
        enable()
