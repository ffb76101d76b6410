"""What every patch of a library shares: is it installed, patch it when it is imported, wrap an attribute once.

Shims act on libraries the notebook imports after ``setup()``. Importing them at setup would cost time for
libraries a notebook may never use and would break import order for Unsloth (it must be imported before
transformers, TRL and PEFT), so patches run through wrapt's post-import hooks: at once when the module is
already imported, else right after the notebook's own import of it.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
from typing import Callable

#: Attribute on every wrapper nbddp installs: the names of the patches applied in it and beneath it, so
#: applying a patch twice wraps nothing twice while different patches of one function each apply once.
MARK = "_nbddp_patched"


def installed(name: str) -> bool:
    """Whether a top-level module can be imported, without importing it."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def when_imported(name: str, patch: Callable) -> None:
    """Call ``patch(module)`` once module ``name`` is imported: now if it already is, else after its import."""
    import wrapt

    wrapt.register_post_import_hook(patch, name)


def patch_name(make_wrapper: Callable) -> str:
    """What identifies a patch: its maker's module and qualified name (the same on every call of a shim)."""
    return f"{getattr(make_wrapper, '__module__', '')}.{getattr(make_wrapper, '__qualname__', repr(make_wrapper))}"


def is_patched(func, make_wrapper: Callable | None = None) -> bool:
    """Whether nbddp wrapped ``func`` at all, or (given ``make_wrapper``) with that patch."""
    applied = getattr(func, MARK, frozenset())
    return bool(applied) if make_wrapper is None else patch_name(make_wrapper) in applied


def wrap(owner, attr: str, make_wrapper: Callable[[Callable], Callable]) -> bool:
    """Replace ``owner.attr`` with ``make_wrapper(original)`` unless this patch was already applied.

    Keeps a ``staticmethod`` or ``classmethod`` what it was, and gives the wrapper the original's name,
    docstring and signature (``functools.wraps``: libraries that inspect the signature still see the real
    one). Other patches of the same attribute stack: each applies once. Returns False, changing nothing, when
    the attribute is missing, this patch is already applied, or ``make_wrapper`` hands the original back.
    """
    raw = inspect.getattr_static(owner, attr, None)
    if raw is None:
        return False
    kind = type(raw) if isinstance(raw, (staticmethod, classmethod)) else None
    original = raw.__func__ if kind else raw
    if is_patched(original, make_wrapper):
        return False
    wrapper = make_wrapper(original)
    if wrapper is original:
        return False
    wrapper = functools.wraps(original)(wrapper)
    setattr(wrapper, MARK, getattr(original, MARK, frozenset()) | {patch_name(make_wrapper)})
    setattr(owner, attr, kind(wrapper) if kind else wrapper)
    return True
