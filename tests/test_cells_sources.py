"""Where a %%ddp_train job's cells come from: registered cells, the notebook file, the kernel's history."""

import pytest

from nbddp.cells import (
    Registry,
    cells_above,
    cells_from_history,
    find_notebook,
    job_source,
    select_cells,
    split_cell_magic,
)
from nbddp.convert import convert_cells
from nbddp.errors import NbddpError


def test_split_cell_magic():
    assert split_cell_magic("%%ddp_train --nproc 2\nx = 1") == ("ddp_train", "--nproc 2", "x = 1")
    assert split_cell_magic("\n%%ddp_setup\n") == ("ddp_setup", "", "")
    assert split_cell_magic("x = 1\n%%time") is None


@pytest.mark.parametrize(
    "source, expected",
    [
        ("x = 1", "x = 1"),
        ("%%ddp_train\ntrainer.train()", None),  # another job
        ("%load_ext nbddp", None),  # nothing left but a comment
        ("%ddp_doctor\n%reload_ext nbddp", None),
        ("%%ddp_setup --also-here\nimport torch", "# %%ddp_setup --also-here\nimport torch"),
        ("import os\n%ddp_doctor\nx = 2", "import os\n# %ddp_doctor\nx = 2"),  # lines keep their numbers
        ("%load_ext autoreload", "%load_ext autoreload"),  # not nbddp's: the converter's business
    ],
)
def test_job_source(source, expected):
    assert job_source(source) == expected


def test_registry_replaces_a_rerun_cell_in_its_place():
    reg = Registry()
    reg.add("%%ddp_setup\na = 1", 2, cell_id="c1")
    reg.add("%%ddp_setup\nb = 1", 3, cell_id="c2")
    reg.add("%%ddp_setup\na = 2", 5, cell_id="c1")  # the first cell, edited and run again
    assert [(c.index, c.source) for c in reg.cells] == [(5, "# %%ddp_setup\na = 2"), (3, "# %%ddp_setup\nb = 1")]
    reg.add("%%ddp_setup\nb = 1", 6)  # no cell id: the same source is the same cell
    reg.add("%%ddp_setup\nb = 1", 7)
    assert len(reg) == 3
    assert reg.describe().splitlines() == ["nbddp: 3 cell(s) registered for the job", "  In [5]: a = 2",
                                           "  In [3]: b = 1", "  In [7]: b = 1"]
    assert reg.add("%%ddp_setup\n", 8) is None and len(reg) == 3
    reg.clear()
    assert reg.cells == ()


def test_find_notebook_from_what_the_front_end_tells(tmp_path):
    nb = tmp_path / "nb.ipynb"
    nb.write_text("{}")
    assert find_notebook({"__vsc_ipynb_file__": str(nb)}, {}, "/") == nb
    assert find_notebook({"PAPERMILL_INPUT_PATH": str(nb)}, {}, "/") == nb
    # Jupyter: a path relative to the server's root; the kernel starts in the notebook's folder
    assert find_notebook({"__session__": "work/sub/nb.ipynb"}, {}, tmp_path) == nb
    assert find_notebook({}, {"JPY_SESSION_NAME": "nb.ipynb"}, tmp_path) == nb
    assert find_notebook({"__session__": "a-console-session"}, {}, tmp_path) is None
    assert find_notebook({"__vsc_ipynb_file__": str(tmp_path / "gone.ipynb")}, {}, tmp_path) is None


def test_cells_above_the_magic_cell(notebook):
    path = notebook(
        [
            "%load_ext nbddp",
            "import os",
            "%%ddp_train --dry-run\nprint(1)",
            "x = 1",
            "%%ddp_train --nproc 2\nprint(x)\nprint(os.sep)",
            "after = 1",
        ],
        markdown_first=True,
    )
    sel = cells_above(path, "--nproc 2", "print(x)\nprint(os.sep)\n")
    assert [c.index for c in sel.cells] == [3, 5, 6]
    assert sel.describe() == "nbddp: 3 cells from nb.ipynb (notebook): cell 3, cell 5, cell 6"
    assert sel.cells[-1].source == "# %%ddp_train --nproc 2\nprint(x)\nprint(os.sep)\n"
    assert cells_above(path, "", "print('edited since the last save')") is None


def test_history_takes_a_repeated_cell_once_and_numbers_by_execution():
    inputs = ["", "%load_ext nbddp", "import os", "x = 1", "import os", "%%ddp_train\nold()", "%%ddp_train\nnew()"]
    sel = cells_from_history(inputs, "", "new()")
    assert [(c.index, c.source) for c in sel.cells] == [(2, "import os"), (3, "x = 1"), (6, "# %%ddp_train\nnew()")]
    assert sel.label(6) == "In [6]" and "taken once" in sel.notes[0]


def test_select_cells_prefers_registered_then_notebook_then_history(notebook):
    history = ["", "a = 1", "%%ddp_train\nb = a"]
    reg = Registry()
    reg.add("%%ddp_setup\nz = 0", 1)
    assert select_cells("", "b = a", registered=reg.cells, history=history).source == "registered"
    path = notebook(["a = 1", "%%ddp_train\nb = a"])
    assert select_cells("", "b = a", notebook=path, history=history).source == "notebook"
    stale = select_cells("", "b = a + 1", notebook=path, history=history)
    assert stale.source == "history" and "save the notebook" in stale.notes[0]
    assert select_cells("", "b = a", source="history", notebook=path, history=history).source == "history"
    with pytest.raises(NbddpError, match="no cells registered"):
        select_cells("", "b = a", source="registered", history=history)
    with pytest.raises(NbddpError, match="does not say which notebook"):
        select_cells("", "b = a", source="notebook", history=history)
    with pytest.raises(NbddpError, match="--source must be one of"):
        select_cells("", "b = a", source="files", history=history)


def test_a_train_cell_line_maps_to_the_line_the_person_sees():
    sel = cells_from_history(["", "import os", "%%ddp_train\nx = 1\nraise ValueError"], "", "x = 1\nraise ValueError")
    script = convert_cells(list(sel.cells), origin=sel.origin)
    line = script.text.splitlines().index("raise ValueError") + 1
    assert script.source_map.lookup(line) == (2, 3)  # In [2], line 3: the %%ddp_train header is line 1
