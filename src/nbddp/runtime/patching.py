"""Small helpers for the shims that patch a library: replace a function once, when its module is imported."""

from __future__ import annotations

import inspect
from typing import Callable

import wrapt


def when_imported(module: str, fn: Callable) -> None:
    """Call ``fn(module)`` once ``module`` is imported — at once when it already is (``wrapt`` post-import hooks).

    A library patched this way is never imported by nbddp itself: one the script never uses costs nothing.
    """
    wrapt.register_post_import_hook(fn, module)


def replace(owner, name: str, make: Callable[[Callable], Callable]) -> None:
    """Replace the function ``owner.name`` with ``make(function)``, once; static and class methods stay so.

    Patching twice (a shim applied again) is a no-op: the replacement carries ``_nbddp = True``.
    """
    attr = inspect.getattr_static(owner, name, None)
    kind = type(attr) if isinstance(attr, (staticmethod, classmethod)) else None
    original = attr.__func__ if kind else attr
    if original is None or getattr(original, "_nbddp", False):
        return
    replacement = make(original)
    if replacement is original:
        return
    replacement._nbddp = True
    setattr(owner, name, kind(replacement) if kind else replacement)
