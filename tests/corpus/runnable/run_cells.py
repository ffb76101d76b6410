"""Run a notebook as written, top to bottom, in one Python process: the baseline of a two-rank run.

``python run_cells.py NOTEBOOK`` runs each code cell (less those tagged ``nbddp-skip``, as nbddp leaves them
out too) in one IPython shell, as a kernel would, in the notebook's folder; it stops at the first cell that
fails, with exit status 1.
"""

import os
import sys
from pathlib import Path

import nbformat
from IPython.core.interactiveshell import InteractiveShell


def main(path: Path) -> int:
    os.chdir(path.parent)
    sys.path.insert(0, "")  # a kernel imports modules next to the notebook
    shell = InteractiveShell.instance()
    shell.enable_gui = lambda gui=None: None  # ipykernel's shell accepts `%matplotlib inline`; the base one raises
    os.environ.setdefault("MPLBACKEND", "agg")  # figures are drawn, not shown
    cells = nbformat.read(path, as_version=4).cells
    for number, cell in enumerate(cells, start=1):
        if cell.cell_type != "code" or "nbddp-skip" in cell.metadata.get("tags", []):
            continue
        result = shell.run_cell(cell.source, store_history=True)
        if not result.success:
            print(f"cell {number} failed", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]).resolve()))
