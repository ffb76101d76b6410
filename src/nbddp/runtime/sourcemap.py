"""The source map: which notebook cell and line each line of a generated script came from.

The converter writes it beside the script (``script.py.map.json``); the launcher maps tracebacks and stack
dumps with it, and a rank (``divergence``) names the cell and line it stopped at. One format, read and
written here. Imported in every rank: nothing here imports torch, IPython, nbformat or libcst.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class SourceMap:
    """Script line (1-based) → (cell, line in that cell), for the lines that came from a cell."""

    origin: str
    lines: dict[int, tuple[int, int]]

    def lookup(self, script_line: int) -> tuple[int, int] | None:
        return self.lines.get(script_line)

    def to_json(self) -> str:
        return json.dumps({"origin": self.origin, "lines": {str(k): list(v) for k, v in self.lines.items()}})

    @classmethod
    def from_json(cls, text: str) -> "SourceMap":
        data = json.loads(text)
        return cls(data["origin"], {int(k): (v[0], v[1]) for k, v in data["lines"].items()})


def map_path(script_path: str | Path) -> Path:
    """Where a script's source map lies: ``<script>.map.json``."""
    return Path(f"{script_path}.map.json")


def read_source_map(script_path: str | Path) -> SourceMap | None:
    """The source map beside a script; None when there is none or it cannot be read."""
    try:
        return SourceMap.from_json(map_path(script_path).read_text(encoding="utf-8"))
    except (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError):
        return None
