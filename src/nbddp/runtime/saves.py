"""Weight and checkpoint files written atomically, so a rank stopped mid-save leaves no truncated file.

When one rank dies, torchrun stops the others at once; rank 0 may be halfway through writing an adapter or
a Trainer checkpoint, and a truncated ``.safetensors`` or ``.pt`` file then breaks the next load or
``--resume``. ``install()`` wraps the two functions that write those files — ``torch.save`` and
``safetensors.torch.save_file`` — so that, given a file path, they write a temporary file beside it and
rename it into place (``runtime.io.atomic_path``); a save that fails carries a note naming its path. Writes to
open file objects pass through unchanged.

It runs in ``setup()``, before the notebook's code imports transformers or peft, whose modules bind
``save_file`` under their own names at import time and so pick up the wrapped one. Small JSON files the
libraries write themselves (``config.json``, tokenizer files) are not covered.
"""

from __future__ import annotations

import functools
import importlib.util
import os

from .io import atomic_path

#: Added to an exception a save to a path raised, before the path: the traceback then says what was written.
WRITING_NOTE = "nbddp: while writing "


def atomic_writer(write):
    """Wrap ``write(obj, path, *args, **kwargs)`` so a path target is written through a temporary file."""
    if getattr(write, "_nbddp_atomic", False):
        return write

    @functools.wraps(write)
    def wrapper(obj, f, *args, **kwargs):
        if not isinstance(f, (str, os.PathLike)):
            return write(obj, f, *args, **kwargs)
        try:
            with atomic_path(f) as tmp:
                return write(obj, tmp, *args, **kwargs)
        except (OSError, RuntimeError) as exc:  # the launcher names the folder of a save the disk refused
            if hasattr(exc, "add_note"):
                exc.add_note(f"{WRITING_NOTE}{os.path.abspath(f)}")
            raise

    wrapper._nbddp_atomic = True
    return wrapper


def install() -> list[str]:
    """Wrap ``torch.save`` and ``safetensors.torch.save_file`` where installed; the names wrapped."""
    wrapped = []
    if importlib.util.find_spec("torch") is not None:
        import torch

        torch.save = atomic_writer(torch.save)
        wrapped.append("torch.save")
    if importlib.util.find_spec("safetensors") is not None and importlib.util.find_spec("torch") is not None:
        import safetensors.torch

        safetensors.torch.save_file = atomic_writer(safetensors.torch.save_file)
        wrapped.append("safetensors.torch.save_file")
    return wrapped
