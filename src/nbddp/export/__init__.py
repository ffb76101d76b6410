"""Exports of a notebook to places that train it on their own: a Kaggle Script kernel (``export_kaggle``).

``options`` holds the command-line options; the exporter itself (and the converter it needs) loads on first use.
"""

from .options import OPTIONS, export_options

__all__ = ["OPTIONS", "KaggleExport", "export_kaggle", "export_options"]


def __getattr__(name: str):
    if name in ("KaggleExport", "export_kaggle"):
        from . import kaggle

        return getattr(kaggle, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
