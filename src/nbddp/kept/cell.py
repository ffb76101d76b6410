"""A ``%%ddp`` cell converted by the same rules as a job's cells: the cell is converted after every cell the
kept job has run (its facts see the trainers, models and trainings before it), and only its own lines are
run. So a second ``trainer.train()`` runs on every rank, generation, saving, printing and plotting after a
training on rank 0, evaluation on all. The whole script is written beside the job's, with its source map, so
a rank compiles the cell's lines at their script line numbers and its traceback maps to the cell's line.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..cells import Cell
from ..convert import Script, convert_cells
from ..errors import NbddpError
from ..runtime.sourcemap import map_path

#: The line the cell's code is known by: kept as a comment, so its line numbers are the cell's own.
MAGIC_LINE = "# %%ddp"
_EPILOGUE = "# [nbddp] every rank ends here"


@dataclass(frozen=True)
class KeptCell:
    """One ``%%ddp`` cell ready to run: the script holding it, and the script lines that are its own."""

    cell: Cell
    script: Script
    path: Path
    first: int
    last: int

    @property
    def code(self) -> str:
        return "\n".join(self.script.text.splitlines()[self.first - 1:self.last])


def convert_kept_cell(source: str, history: list[Cell], run_dir: Path, number: int) -> KeptCell:
    """Convert ``source`` as the cell after ``history``; write the script as ``ddp-cell-<number>.py``."""
    index = max((c.index for c in history), default=0) + 1
    cell = Cell(index, f"{MAGIC_LINE}\n{source}", history[0].origin if history else "<cells>")
    script = convert_cells([*history, cell], origin=history[0].origin if history else "<cells>", launcher_facts=False)
    lines = script.text.splitlines()
    header = f"# [cell {index}]"
    starts = [n for n, text in enumerate(lines, start=1) if text == header]
    ends = [n for n, text in enumerate(lines, start=1) if text.startswith(_EPILOGUE)]
    if not starts or not ends:
        raise NbddpError("the %%ddp cell could not be found in its converted script; run it as a job instead")
    path = _write(script, run_dir / f"ddp-cell-{number}.py")
    return KeptCell(cell, script, path, starts[-1], ends[-1] - 1)


def _write(script: Script, path: Path) -> Path:
    """The script and its map, plainly: the ranks read them as soon as this returns and the kept job does not
    outlive the machine, so the fsyncs of a job's script (``Script.write``) would only slow each cell."""
    path.write_text(script.text, encoding="utf-8")
    map_path(path).write_text(script.source_map.to_json(), encoding="utf-8")
    return path
