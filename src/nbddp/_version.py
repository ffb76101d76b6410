"""nbddp's version, in a module of its own: the modules that print it import it without the package root,
which imports the magics (no import circle, ``tests/test_imports.py``)."""

__version__ = "0.1.0"
