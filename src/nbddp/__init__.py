"""nbddp — train a notebook's fine-tune on every GPU of the machine, from one cell, through torchrun."""

from ._version import __version__

#: The magics ``%load_ext nbddp`` registered in this process, if any.
_magics = None


def load_ipython_extension(ipython) -> None:
    """``%load_ext nbddp``: register ``%%ddp_train``, ``%%ddp_setup``, ``%ddp_doctor`` and ``%ddp_export``.

    The magics module (and what it imports) loads only here, so ``import nbddp`` stays cheap.
    """
    from .magics import NbddpMagics

    global _magics
    _magics = NbddpMagics(ipython)
    ipython.register_magics(_magics)
    ipython.register_magics(_magics.kept)


def unload_ipython_extension(ipython) -> None:
    """``%unload_ext nbddp``: stop following cell runs (the magics stay until the kernel restarts)."""
    if _magics is not None:
        _magics.unregister()
