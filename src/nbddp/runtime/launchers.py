"""Launchers a notebook calls itself, made plain calls inside the ranks torchrun already started.

``accelerate.notebook_launcher(fn, args, num_processes=2)`` starts its own processes; inside a rank of an
nbddp job that would nest one job in each rank (and hang on the port). Under nbddp every rank is already
one of the processes, so each runs ``fn(*args)`` itself and Accelerate's ``Accelerator()`` inside joins the
job's process group. Patched when the notebook imports ``accelerate`` (``patching.when_imported``).
"""

from __future__ import annotations

import functools


def install() -> None:
    from .patching import when_imported

    when_imported("accelerate", _patch)


def _patch(accelerate) -> None:
    import importlib

    from .patching import wrap

    wrap(accelerate, "notebook_launcher", _in_this_rank)
    launchers = importlib.import_module("accelerate.launchers")
    wrap(launchers, "notebook_launcher", _in_this_rank)


def _in_this_rank(launch):
    @functools.wraps(launch)
    def notebook_launcher(function, args=(), num_processes=None, *more, **kwargs):
        from .rank import rank_info, say

        if rank_info().world_size < 2:
            return launch(function, args, num_processes, *more, **kwargs)
        say(f"nbddp: notebook_launcher({getattr(function, '__name__', 'function')}, num_processes="
            f"{num_processes}): each of the job's {rank_info().world_size} ranks runs it")
        return _with_precision(kwargs.get("mixed_precision", more[0] if more else None), function, args)

    return notebook_launcher


def _with_precision(precision, function, args):
    """``function(*args)`` with ``ACCELERATE_MIXED_PRECISION`` set as Accelerate's launcher sets it from its
    ``mixed_precision=`` (the ``Accelerator()`` inside reads it), and restored after."""
    import os

    if precision is None:
        return function(*args)
    before = os.environ.get("ACCELERATE_MIXED_PRECISION")
    os.environ["ACCELERATE_MIXED_PRECISION"] = str(precision).lower()
    try:
        return function(*args)
    finally:
        if before is None:
            os.environ.pop("ACCELERATE_MIXED_PRECISION", None)
        else:
            os.environ["ACCELERATE_MIXED_PRECISION"] = before
