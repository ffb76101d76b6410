"""Notebook cells → a DDP training script: clean (IPython → Python), rewrite (libcst rules), assemble."""

from .script import Change, Script, SourceMap, convert_cells, convert_notebook

__all__ = ["Change", "Script", "SourceMap", "convert_cells", "convert_notebook"]
