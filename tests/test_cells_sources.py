"""Where a %%ddp_train job's cells come from: registered cells, the notebook file, the kernel's history."""

import pytest

from nbddp.kernel_cells import cells_above, cells_from_history, select_cells
from nbddp.selection import EDITED, RAN, SAVED, THIS, Registry, find_notebook, job_source, split_cell_magic
from nbddp.convert import convert_cells
from nbddp.errors import NbddpError
from nbddp.executions import Execution, KernelRuns


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
        ("%unload_ext nbddp", None),
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
    assert sel.describe() == "nbddp: 3 cells from nb.ipynb (notebook): cell 3, cell 5, cell 6 · saved file: 3, 5"
    assert sel.cells[-1].source == "# %%ddp_train --nproc 2\nprint(x)\nprint(os.sep)\n"
    assert cells_above(path, "", "print('edited since the last save')") is None


def test_history_takes_a_repeated_cell_once_at_its_first_place_and_numbers_by_execution():
    inputs = ["", "%load_ext nbddp", "import os", "x = 1", "import os", "%%ddp_train\nold()", "%%ddp_train\nnew()"]
    sel = cells_from_history(inputs, "", "new()")
    # the cell's last run names it (its [N] in the front end), its first run places it
    assert [(c.index, c.source) for c in sel.cells] == [(4, "import os"), (3, "x = 1"), (6, "# %%ddp_train\nnew()")]
    assert sel.label(6) == "In [6]" and "each cell is taken at its last version" in sel.notes[0]


def test_select_cells_prefers_registered_then_notebook_then_history(notebook):
    history = KernelRuns.from_inputs(["", "a = 1", "%%ddp_train\nb = a"])
    reg = Registry()
    reg.add("%%ddp_setup\nz = 0", 1)
    assert select_cells("", "b = a", registered=reg.cells, kernel=history).source == "registered"
    path = notebook(["a = 1", "%%ddp_train\nb = a"])
    assert select_cells("", "b = a", notebook=path, kernel=history).source == "notebook"
    stale = select_cells("", "b = a + 1", notebook=path, kernel=history)
    assert stale.source == "history" and "save the notebook" in stale.notes[0]
    assert "nb.ipynb on disk does not hold this cell" in stale.notes[0]
    assert select_cells("", "b = a", source="history", notebook=path, kernel=history).source == "history"
    with pytest.raises(NbddpError, match="no cells registered"):
        select_cells("", "b = a", source="registered", kernel=history)
    with pytest.raises(NbddpError, match="does not say which notebook"):
        select_cells("", "b = a", source="notebook", kernel=history)
    with pytest.raises(NbddpError, match="--source must be one of"):
        select_cells("", "b = a", source="files", kernel=history)


def test_a_train_cell_line_maps_to_the_line_the_person_sees():
    sel = cells_from_history(["", "import os", "%%ddp_train\nx = 1\nraise ValueError"], "", "x = 1\nraise ValueError")
    script = convert_cells(list(sel.cells), origin=sel.origin)
    line = script.text.splitlines().index("raise ValueError") + 1
    assert script.source_map.lookup(line) == (2, 3)  # In [2], line 3: the %%ddp_train header is line 1


# -- the saved notebook and what the kernel ran -------------------------------------------------------------------


def saved(tmp_path, cells, name="nb.ipynb"):
    """A notebook saved with the given (source, id) code cells, as JupyterLab writes nbformat 4.5."""
    import nbformat

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(src, id=cid) for src, cid in cells])
    nbformat.write(nb, str(tmp_path / name))
    return tmp_path / name


NOTEBOOK = [("import os", "a"), ("steps = 30", "b"), ("lr = 0.1", "c"), ("%%ddp_train\nprint(steps, lr)", "d")]


def kernel(*runs, running_id=None):
    """A kernel that ran ``runs`` ((source, cell id, ok), from In [1] on) and now runs the %%ddp_train cell."""
    done = tuple(Execution(n, src, cid, ok) for n, (src, cid, ok) in enumerate(runs, start=1))
    return KernelRuns(done, Execution(len(runs) + 1, "%%ddp_train\nprint(steps, lr)", running_id, ok=None))


def test_vscode_cell_uris_follow_a_cell_from_its_saved_version_to_its_edit(tmp_path):
    path = saved(tmp_path, NOTEBOOK)
    uri = f"vscode-notebook-cell:{path}#W"  # VS Code sends the cell's document URI, not the file's id
    ran = kernel(("import os", uri + "0", True), ("steps = 30", uri + "1", True), ("steps = 60", uri + "1", True),
                 ("lr = 0.2", uri + "2", True), running_id=uri + "3")
    sel = select_cells("", "print(steps, lr)", kernel=ran)  # the URI names the notebook: no other hint needed
    assert [c.source for c in sel.cells[:-1]] == ["import os", "steps = 60", "lr = 0.1"]
    assert [(o.index, o.how, o.run) for o in sel.origins] == [
        (1, RAN, 1), (2, EDITED, 3), (3, SAVED, None), (4, THIS, None)]
    # cell 3 was edited before it ever ran as saved: nothing ties its run to it but resemblance
    (warning,) = sel.warnings
    assert "In [4] `lr = 0.2`, an edit of cell 3?" in warning and "Save the notebook" in warning


def test_a_front_end_without_ids_is_matched_by_code(tmp_path):
    path = saved(tmp_path, NOTEBOOK)
    ran = kernel(("import os", None, True), ("steps = 30", None, True), ("steps = 60", None, True))
    sel = select_cells("", "print(steps, lr)", notebook=path, kernel=ran)
    assert [c.source for c in sel.cells[:-1]] == ["import os", "steps = 30", "lr = 0.1"]
    assert "In [3] `steps = 60`, an edit of cell 2?" in sel.warnings[0]
    assert sel.describe().endswith("· as run here: 1, 2 · saved file: 3")


def test_a_cell_whose_last_run_raised_is_taken_at_its_last_run_that_did_not(tmp_path):
    path = saved(tmp_path, NOTEBOOK)
    ran = kernel(("steps = 30", "b", True), ("steps = 60\nraise KeyError", "b", False), ("lr = oops", "c", False),
                 running_id="d")
    sel = select_cells("", "print(steps, lr)", notebook=path, kernel=ran)
    assert [c.source for c in sel.cells[:-1]] == ["import os", "steps = 30"]  # lr's cell never ran without raising
    assert "cell 2 raised when last run (In [2]): its last run that did not raise is taken (In [1])" in sel.notes
    assert sel.describe() == ("nbddp: 3 cells from nb.ipynb (notebook): cell 1, cell 2, cell 4 · as run here: 2 "
                              "· saved file: 1 · left out, raised here: 3")
    text = sel.report(per_cell=True)
    assert "  cell 3    left out: it raised here (In [3])" in text
    assert "  cell 1    the saved file (not run in this kernel)" in text


def test_a_new_cell_run_but_not_saved_is_named(tmp_path):
    path = saved(tmp_path, NOTEBOOK)
    ran = kernel(("warmup = 5", "new-unsaved-cell", True), ("print(steps)", "deleted-scratch", False), running_id="d")
    sel = select_cells("", "print(steps, lr)", notebook=path, kernel=ran)
    (warning,) = sel.warnings  # the scratch cell raised: it changed nothing worth a word
    assert "ran here but not in the saved nb.ipynb, so not in the job: In [1] `warmup = 5`." in warning


def test_a_cell_known_by_its_code_run_again_after_another_rebound_its_name_is_said():
    # no cell ids (Colab): lr = 1e-3, lr = 1e-4, then lr = 1e-3 again; the kernel holds 1e-3
    inputs = ["", "lr = 1e-3", "lr = 1e-4", "lr = 1e-3", "%%ddp_train\nprint(lr)"]
    sel = cells_from_history(KernelRuns.from_inputs(inputs), "", "print(lr)")
    assert [c.source for c in sel.cells[:-1]] == ["lr = 1e-3", "lr = 1e-4"]  # where each first ran
    assert any("In [3] ran the code of In [1] again after In [2] rebound lr" in n for n in sel.notes)
    inputs = ["", "import os", "x = 1", "import os", "%%ddp_train\nx"]
    plain = cells_from_history(KernelRuns.from_inputs(inputs), "", "x")
    assert not any("rebound" in n for n in plain.notes)  # x = 1 binds nothing import os does
