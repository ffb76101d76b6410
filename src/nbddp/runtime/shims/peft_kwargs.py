"""PEFT keyword drift: a config keyword the installed PEFT release does not know is dropped, not fatal.

Notebooks are written against one PEFT release and run against another: ``LoraConfig(...,
ensure_weight_tying=True)`` (new in PEFT 0.18) raises ``TypeError: __init__() got an unexpected keyword
argument`` on an older PEFT, as ``merge_weights=`` (PEFT 0.2) does on a newer one. Every PEFT config class's
``__init__`` is wrapped to drop the keywords its signature lacks, with one warning naming them. PEFT does the
same itself when *loading* a saved config (``PeftConfig.from_peft_type``); this extends it to the configs a
notebook writes.
"""

from __future__ import annotations

import inspect
import warnings

from ..patching import installed, wrap, when_imported

NAME = "peft_kwargs"


def detect() -> bool:
    return installed("peft")


def apply() -> str:
    when_imported("peft", patch)
    return f"PEFT {_version()}: config keywords this release does not know are dropped with a warning"


def patch(peft) -> int:
    """Wrap ``__init__`` of every PEFT config class ``peft`` exports; returns how many were wrapped now."""
    configs = [
        obj for obj in vars(peft).values()
        if isinstance(obj, type) and issubclass(obj, peft.PeftConfig) and "__init__" in vars(obj)
    ]
    return sum(wrap(cls, "__init__", _dropping_unknown_keywords) for cls in configs)


def _dropping_unknown_keywords(init):
    signature = inspect.signature(init)
    takes_any = any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values())
    known = set(signature.parameters)

    def __init__(self, *args, **kwargs):
        unknown = [] if takes_any else sorted(set(kwargs) - known)
        if unknown:
            warnings.warn(
                f"{type(self).__name__}: PEFT {_version()} has no keyword {', '.join(unknown)}; "
                "dropped (nbddp shim peft_kwargs)",
                UserWarning,
                stacklevel=2,
            )
            kwargs = {k: v for k, v in kwargs.items() if k in known}
        init(self, *args, **kwargs)

    return __init__


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("peft")
    except PackageNotFoundError:
        return "(unknown version)"
