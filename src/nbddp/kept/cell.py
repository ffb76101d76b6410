"""A ``%%ddp`` cell converted by the same rules as a job's cells: the cell is converted after every cell the
kept job has run (its facts see the trainers, models and trainings before it), and only its own lines are
run. Unlike a job's code after training, every statement runs on every rank, so every name the cell binds
exists on every rank (a second ``trainer.train()``, evaluation, printing, generation: only rank 0's output is
shown); a statement that writes files or pushes runs on rank 0 once, and the names it binds are sent from
rank 0 to the others (``convert/facts/kept.py``). A prediction loop is split over the ranks as a predicting
notebook's, every rank gathering the whole results (``convert/rules/predict.py``); one that cannot be split is
refused at this cell's line before the ranks hear of it. What the cell does so is said as it runs. The whole
script is written beside the job's, with its source map, so a rank compiles the cell's lines at their script
line numbers and its traceback maps to the cell's line.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from ..cells import Cell
from ..convert import Script, convert_cells
from ..convert.rules.predict import PredictRule
from ..convert.rules.rank_zero import RankZeroRule
from ..errors import CellError, NbddpError
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
    try:
        script = convert_cells([*history, cell], origin=history[0].origin if history else "<cells>",
                               launcher_facts=False, kept_cell=True)
    except CellError as exc:
        if exc.cell != index:
            raise
        # said as the cell's own line (the magic's line is line 1), not as a cell number the notebook lacks;
        # raised before the ranks hear of the cell, so the kept job is as it was
        raise NbddpError("this %%ddp cell" + str(exc)[len(f"cell {index}"):]) from None
    lines = script.text.splitlines()
    header = f"# [cell {index}]"
    starts = [n for n, text in enumerate(lines, start=1) if text == header]
    ends = [n for n, text in enumerate(lines, start=1) if text.startswith(_EPILOGUE)]
    if not starts or not ends:
        raise NbddpError("the %%ddp cell could not be found in its converted script; run it as a job instead")
    path = _write(script, run_dir / f"ddp-cell-{number}.py")
    return KeptCell(cell, _with_notes(script, index), path, starts[-1], ends[-1] - 1)


def _with_notes(script: Script, index: int) -> Script:
    """Where the cell runs, said as the cell runs (the magic prints the script's warnings): the writes rank 0
    runs alone and the names it sends, values that may differ between ranks, the prediction loops split over
    the ranks. The rest runs on every rank."""
    notes = tuple(f"this %%ddp cell, line {c.line}: {c.message}" for c in script.changes
                  if c.cell == index and c.rule in (RankZeroRule.name, PredictRule.name))
    return replace(script, warnings=script.warnings + notes) if notes else script


def _write(script: Script, path: Path) -> Path:
    """The script and its map, plainly: the ranks read them as soon as this returns and the kept job does not
    outlive the machine, so the fsyncs of a job's script (``Script.write``) would only slow each cell."""
    path.write_text(script.text, encoding="utf-8")
    map_path(path).write_text(script.source_map.to_json(), encoding="utf-8")
    return path
