"""A %%ddp cell's conversion (no kernel): the script the ranks read, its map, and only what a cell needs."""

from __future__ import annotations

from nbddp.cells import Cell
from nbddp.convert import convert_cells
from nbddp.kept.cell import convert_kept_cell
from nbddp.runtime.sourcemap import read_source_map

HISTORY = [Cell(1, "import torch\nfrom transformers import Trainer, TrainingArguments\n"
                   "trainer = Trainer(model=None, args=TrainingArguments(output_dir='outputs'))"),
           Cell(2, "trainer.train()")]


def test_a_kept_cell_is_its_own_lines_of_the_whole_script_with_its_map(tmp_path):
    kept = convert_kept_cell("x = 1\nprint(x)", HISTORY, tmp_path, 7)
    assert kept.path == tmp_path / "ddp-cell-7.py" and kept.path.read_text() == kept.script.text
    # after a training, a cell that only prints runs on rank 0; its lines keep their place in cell 3
    assert kept.code.splitlines()[1:] == ["# %%ddp", "if _nbddp.on_rank0():", "    x = 1", "    print(x)"]
    source_map = read_source_map(kept.path)
    mapped = [source_map.lookup(n) for n in range(kept.first, kept.last + 1)]
    assert [m for m in mapped if m] == [(3, 1), (3, 1), (3, 2), (3, 3)]  # the magic's line and the guard are line 1
    # the launcher's facts are not read for a cell that launches nothing; the script is the same
    whole = convert_cells([*HISTORY, kept.cell], origin=HISTORY[0].origin)
    assert whole.text == kept.script.text and whole.output_targets and kept.script.output_targets == ()
