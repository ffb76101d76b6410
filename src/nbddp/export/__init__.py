"""Exports of a notebook to places that train it on their own: a Kaggle Script kernel (``export_kaggle``)."""

from .kaggle import KaggleExport, export_kaggle

__all__ = ["KaggleExport", "export_kaggle"]
