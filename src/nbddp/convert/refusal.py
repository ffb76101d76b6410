"""A refusal before launch at a line of a cell, as the notebook's cell shows it (``CellError``).

Facts record a refusal as (the cell's position among the cleaned cells, a line of the cleaned code, why); this
maps that line back to the cell's own source, so the message names the line the person wrote.
"""

from __future__ import annotations

from ..errors import CellError


def refuse_at(position: int, line: int, cleaned, message: str) -> None:
    """Raise ``CellError(message)`` at line ``line`` of the cleaned code of cell ``position``."""
    clean = cleaned[position]
    j = line - 1
    at = clean.line_map[j] if 0 <= j < len(clean.line_map) else None
    lines = clean.cell.source.splitlines()
    source = lines[at - 1] if at and at <= len(lines) else ""
    raise CellError(message, cell=clean.cell.index, line=at, source=source)
