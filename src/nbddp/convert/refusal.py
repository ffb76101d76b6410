"""A refusal before launch at a line of a cell, as the notebook's cell shows it (``CellError``).

Facts record a refusal as (the cell's position among the cleaned cells, a line of the cleaned code, why); this
maps that line back to the cell's own source, so the message names the line the person wrote.
"""

from __future__ import annotations

from ..errors import CellError


def cell_error(clean, line: int, message: str) -> CellError:
    """``CellError(message)`` at line ``line`` of ``clean``'s cleaned code, as the cell's own line and source."""
    j = line - 1
    at = clean.line_map[j] if 0 <= j < len(clean.line_map) and clean.line_map[j] else None
    lines = clean.cell.source.splitlines()
    source = lines[at - 1] if at and at <= len(lines) else ""
    return CellError(message, cell=clean.cell.index, line=at, source=source)


def refuse_at(position: int, line: int, cleaned, message: str) -> None:
    """Raise ``cell_error`` at line ``line`` of the cleaned code of cell ``position``."""
    raise cell_error(cleaned[position], line, message)
