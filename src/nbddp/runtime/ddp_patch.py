"""The one place where nbddp changes how ``DistributedDataParallel`` is built, inside every rank.

Whoever builds the DDP wrapper — the user's own loop, accelerate under the HF Trainer, TRL, Unsloth —
goes through ``torch.nn.parallel.DistributedDataParallel.__init__``. ``install()`` wraps that method once;
from then on every construction runs:

1. the registered **adjusters**, in registration order: ``adjuster(module, kwargs) -> kwargs``. ``kwargs``
   holds every constructor argument by name with its effective value (what the caller passed, positional
   or keyword, and torch's defaults for the rest), so an adjuster reads ``kwargs["find_unused_parameters"]``
   whether or not the caller spelled it out. It returns the arguments to use (changed or not).
2. torch's own ``__init__`` with the adjusted arguments (only those the caller passed or an adjuster
   changed are passed on, so torch's defaults stay torch's).
3. the registered **hooks**, in registration order: ``hook(ddp)``, on the finished instance (for things
   that need it built: communication hooks, logging).

Compatibility shims (gradient checkpointing) and performance defaults (communication hooks, bucket size,
``gradient_as_bucket_view``) plug in here with ``register_adjuster`` / ``register_hook``; registering a
name again replaces the earlier function, so shims applied twice do not stack.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

Adjuster = Callable[[Any, dict], dict]
Hook = Callable[[Any], None]

_adjusters: dict[str, Adjuster] = {}
_hooks: dict[str, Hook] = {}
#: The argument names the caller of the construction under way wrote out (see ``caller_passed``).
_given: frozenset[str] = frozenset()


def caller_passed(name: str) -> bool:
    """Inside an adjuster: whether whoever builds this wrapper passed ``name`` (a value to keep, not a default)."""
    return name in _given


def register_adjuster(name: str, fn: Adjuster) -> None:
    """Run ``fn(module, kwargs) -> kwargs`` before every DDP construction (replaces an earlier ``name``)."""
    install()
    _adjusters[name] = fn


def register_hook(name: str, fn: Hook) -> None:
    """Run ``fn(ddp)`` after every DDP construction (replaces an earlier ``name``)."""
    install()
    _hooks[name] = fn


def unregister(name: str) -> None:
    """Remove the adjuster and the hook registered under ``name``, if any."""
    _adjusters.pop(name, None)
    _hooks.pop(name, None)


def install() -> bool:
    """Wrap ``DistributedDataParallel.__init__`` once; False when it was already wrapped."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    original = DDP.__init__
    if getattr(original, "_nbddp_original", None) is not None:
        return False
    signature = inspect.signature(original)
    defaults = {k: p.default for k, p in signature.parameters.items() if p.default is not inspect.Parameter.empty}

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        global _given
        bound = signature.bind(self, *args, **kwargs)
        given = set(bound.arguments) - {"self"}
        bound.apply_defaults()
        effective = {k: v for k, v in bound.arguments.items() if k != "self"}
        module = effective.pop("module")
        _given = frozenset(given)
        try:
            for adjust in list(_adjusters.values()):
                effective = adjust(module, dict(effective))
        finally:
            _given = frozenset()
        passed = {k: v for k, v in effective.items() if k in given or k not in defaults or v is not defaults[k]}
        original(self, module, **passed)
        for hook in list(_hooks.values()):
            hook(self)

    __init__._nbddp_original = original
    DDP.__init__ = __init__
    return True


def uninstall() -> None:
    """Put torch's own ``__init__`` back and forget every adjuster and hook (for tests)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    original = getattr(DDP.__init__, "_nbddp_original", None)
    if original is not None:
        DDP.__init__ = original
    _adjusters.clear()
    _hooks.clear()
