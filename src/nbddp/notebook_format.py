"""nbformat, imported without compiling IRI grammars nobody uses: ``from .notebook_format import nbformat``.

nbformat validates notebooks with jsonschema, whose format checkers import ``rfc3987_syntax`` at import time
where it is installed (``jsonschema[format-nongpl]``, which jupyter-events and so JupyterLab and Jupyter
Server bring, as on Kaggle and Colab). That module compiles 38 Lark grammars as it loads: 2.6 s of CPU on the
2-core CI machine, 1–2 s elsewhere (jsonschema issue #1428), paid by every ``nbddp run`` before torchrun
starts, for the ``iri`` and ``iri-reference`` formats, which no notebook schema names.

So while jsonschema is imported here, ``rfc3987_syntax`` is a stand-in whose ``is_valid_syntax`` loads the
real module on its first call and hands the call over: the checkers stay as they were, paid for by the first
schema that uses them. The stand-in leaves ``sys.modules`` as soon as jsonschema is loaded, so any other
import of ``rfc3987_syntax`` gets the real module. With jsonschema already imported, or ``rfc3987`` (which
jsonschema prefers) or no ``rfc3987_syntax`` installed, nothing is done.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types

_NAME = "rfc3987_syntax"


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _is_valid_syntax(term: str, value: str) -> bool:
    """The real ``rfc3987_syntax.is_valid_syntax``, loaded on the first call."""
    if sys.modules.get(_NAME) is _STAND_IN:
        del sys.modules[_NAME]
    return importlib.import_module(_NAME).is_valid_syntax(term, value)


_STAND_IN = types.ModuleType(_NAME, "nbddp's stand-in while jsonschema loads (nbddp.notebook_format)")
_STAND_IN.is_valid_syntax = _is_valid_syntax


def import_jsonschema_lazily() -> bool:
    """Import jsonschema with ``rfc3987_syntax`` loaded on first use; True when the stand-in was used."""
    if "jsonschema" in sys.modules or _NAME in sys.modules or _installed("rfc3987") or not _installed(_NAME):
        return False
    sys.modules[_NAME] = _STAND_IN
    try:
        import jsonschema  # noqa: F401
    finally:
        if sys.modules.get(_NAME) is _STAND_IN:
            del sys.modules[_NAME]
    return True


import_jsonschema_lazily()
import nbformat  # noqa: E402  (after jsonschema is in)

__all__ = ["nbformat", "import_jsonschema_lazily"]
