"""Every activation checkpoint in a rank goes through one wrapper; and what a model will checkpoint, found out.

Gradient checkpointing reaches ``torch.utils.checkpoint.checkpoint`` from many places: transformers' layers
(enabled by ``gradient_checkpointing_enable``, the ``gradient_checkpointing`` / ``activation_checkpointing``
training argument, TRL's configs that turn it on by default, PEFT's ``prepare_model_for_kbit_training``),
and user code calling it directly. ``install()`` puts ``checkpoint`` below in its place — in
``torch.utils.checkpoint`` and in every loaded module that imported torch's function by name — so that:

- a call that does not say ``use_reentrant`` runs the non-reentrant variant (torch itself still defaults
  to the reentrant one, which DDP mishandles); a call that says ``use_reentrant=True`` keeps it, with
  gradients switched on for its inputs (without them the checkpointed parameters get no gradient at all);
- with checkpointing disabled (``install(disabled=True)``, the escape hatch) the function is called directly.

``facts(module)`` reads a model's effective checkpointing — which layers checkpoint and with which
variant — from the state those libraries leave on it, not from their versions.
"""

from __future__ import annotations

import functools
import inspect
import sys
from dataclasses import dataclass

_original = None  # torch's own checkpoint function, once installed
_own_kwargs: frozenset[str] = frozenset()  # keywords that belong to checkpoint, not to the checkpointed function
_disabled = False
_non_reentrant_default = False
#: Called (no arguments) before each checkpoint the caller asked to run reentrant, while gradients are on.
on_explicit_reentrant = None


@dataclass(frozen=True)
class CheckpointFacts:
    """What a module's forward will checkpoint: how many parts, and whether any runs reentrant."""

    layers: int = 0
    reentrant: bool = False
    source: str = ""  # whose checkpointing, in words: "transformers layers", "Unsloth"
    reason: str = ""  # why it is (non-)reentrant, in words

    @property
    def active(self) -> bool:
        return self.layers > 0


def install(*, non_reentrant_default: bool | None = None, disabled: bool | None = None) -> None:
    """Route every checkpoint through ``checkpoint`` (once) and set how it behaves."""
    global _original, _own_kwargs, _disabled, _non_reentrant_default
    import torch.utils.checkpoint as tuc

    if non_reentrant_default is not None:
        _non_reentrant_default = non_reentrant_default
    if disabled is not None:
        _disabled = disabled
    if _original is not None:
        return
    _original = tuc.checkpoint
    params = inspect.signature(_original).parameters.values()
    _own_kwargs = frozenset(p.name for p in params if p.kind is p.KEYWORD_ONLY) | {"preserve_rng_state"}
    _rebind(_original, checkpoint)


def uninstall() -> None:
    """Put torch's function back everywhere and reset the settings (for tests)."""
    global _original, _disabled, _non_reentrant_default, on_explicit_reentrant
    if _original is not None:
        _rebind(checkpoint, _original)
    _original, _disabled, _non_reentrant_default, on_explicit_reentrant = None, False, False, None


def _rebind(old, new) -> None:
    """Replace every module-level name bound to ``old`` (``from torch.utils.checkpoint import checkpoint``)."""
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict) or module is sys.modules[__name__]:
            continue
        for name, value in list(namespace.items()):
            if value is old:
                namespace[name] = new


def checkpoint(function, *args, use_reentrant: bool | None = None, **kwargs):
    """``torch.utils.checkpoint.checkpoint`` as nbddp runs it (see the module docstring)."""
    if _disabled:
        return function(*args, **{k: v for k, v in kwargs.items() if k not in _own_kwargs})
    if use_reentrant and on_explicit_reentrant is not None and _grad_enabled():
        on_explicit_reentrant()
    if use_reentrant is None:
        use_reentrant = not _non_reentrant_default
    if use_reentrant:
        args = _inputs_with_grad(args)
    return _original(function, *args, use_reentrant=use_reentrant, **kwargs)


def _grad_enabled() -> bool:
    import torch

    return torch.is_grad_enabled()


def _inputs_with_grad(args: tuple) -> tuple:
    """For reentrant checkpointing: when no input needs a gradient, let the floating-point ones need one.

    Reentrant checkpointing builds its graph from its inputs only; with a frozen base model (LoRA) the
    hidden states need no gradient, so the adapters inside would get none. Detached aliases are passed, so
    the caller's tensors are left as they were.
    """
    import torch

    if not torch.is_grad_enabled() or any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
        return args
    return tuple(
        a.detach().requires_grad_(True) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args
    )


def reentrancy(fn) -> tuple[bool, str]:
    """Whether a layer's checkpoint function runs reentrant, and why, as things are installed now.

    transformers stores ``functools.partial(checkpoint, **kwargs)`` on each layer (or a closure of its own
    that calls ``checkpoint``); an explicit ``use_reentrant`` decides, else the default of the function
    reached: torch's is reentrant, nbddp's is not. A function of another library (Unsloth's offloading
    checkpointer) is a custom autograd function that recomputes in its backward: reentrant, whatever it
    is told.
    """
    keywords: dict = {}
    while isinstance(fn, functools.partial):
        keywords = {**fn.keywords, **keywords}
        fn = fn.func
    torch_fn = _original or _torch_checkpoint()
    routed = fn is checkpoint or (fn is not torch_fn and getattr(fn, "__module__", "").startswith("transformers"))
    if not (routed or fn is torch_fn):
        return True, f"custom checkpoint function {getattr(fn, '__qualname__', fn)!r}"
    explicit = keywords.get("use_reentrant")
    if explicit is not None:
        return bool(explicit), f"use_reentrant={explicit}"
    if routed and _original is not None and _non_reentrant_default:
        return False, "use_reentrant not set; nbddp's default"
    return True, "use_reentrant not set; torch's default"


def _torch_checkpoint():
    import torch.utils.checkpoint as tuc

    return tuc.checkpoint


def facts(module) -> CheckpointFacts:
    """The checkpointing ``module``'s forward will do, read from the flags transformers-style layers carry.

    Unsloth's models checkpoint with its own reentrant function; when Unsloth is loaded, checkpointing
    counts as reentrant.
    """
    if _disabled:
        return CheckpointFacts()
    found = []
    for m in module.modules():
        if getattr(m, "gradient_checkpointing", False) is True:
            # old-style layers carry no function and call torch.utils.checkpoint.checkpoint themselves
            found.append(reentrancy(getattr(m, "_gradient_checkpointing_func", None) or _torch_checkpoint()))
    if not found:
        return CheckpointFacts()
    if "unsloth" in sys.modules:
        return CheckpointFacts(len(found), True, "Unsloth", "Unsloth's checkpointing is always reentrant")
    reentrant = any(r for r, _ in found)
    reasons = dict.fromkeys(why for r, why in found if r == reentrant)
    return CheckpointFacts(len(found), reentrant, "transformers layers", ", ".join(reasons))
