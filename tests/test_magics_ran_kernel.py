"""%%ddp_train in a real kernel trains what the person ran: spoken to as JupyterLab speaks (each request with
its cell's id in ``cellId``) and as Colab or papermill speak (no id), with the notebook file saved or not
known."""

import re
import subprocess
import sys

import nbformat
import pytest

from conftest import no_rank_processes
from kernel import FrontEnd, colab_kernel_dirs, kernel_env

pytestmark = pytest.mark.e2e

TRAIN = '''%%ddp_train --nproc 2
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(steps):
    loss = model(torch.randn(8, 4)[torch.distributed.get_rank()::2]).pow(2).mean()  # each rank its own rows
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
print(f"trained {step + 1} steps in {torch.distributed.get_world_size()} processes")'''


@pytest.fixture
def front_end(tmp_path):
    started = []

    def start(**options):
        started.append(FrontEnd(tmp_path, **options))
        return started[-1]

    yield start
    for kernel in started:
        kernel.close()


def test_an_unsaved_edit_is_trained_on_two_ranks_and_a_cell_never_run_comes_from_the_file(tmp_path, front_end):
    cells = [("%load_ext nbddp", "load"), ("steps = 30", "steps"), ("import torch", "imports"), (TRAIN, "train")]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(src, id=cid) for src, cid in cells])
    nbformat.write(nb, str(tmp_path / "nb.ipynb"))
    kernel = front_end(JPY_SESSION_NAME="nb.ipynb")  # Jupyter's server names the kernel's notebook
    assert kernel.run("%load_ext nbddp", "load").error is None
    assert kernel.run("steps = 60", "steps").error is None  # edited in the browser and run, not saved
    job = kernel.run(TRAIN, "train")  # the imports cell never ran here: the job takes it from the file
    assert job.error is None, job.shown
    assert "trained 60 steps in 2 processes" in job.shown
    assert ("3 cells from nb.ipynb (notebook): cell 2, cell 3, cell 4 · as run here: 2 (not as saved: 2) "
            "· saved file: 3") in job.shown
    assert "cell 2 differs from the saved nb.ipynb: the job takes it as run here" in job.shown
    assert no_rank_processes(str(tmp_path))


FAILED_THEN_FIXED = [
    ("x = 1\nraise ValueError('typo in the loader cell')", "loader"),
    ("x = 2", "loader"),
    ("steps = 30", "steps"),
    ("steps = 60", "steps"),
]


@pytest.mark.parametrize("ids", [True, False], ids=["cell ids sent (JupyterLab)", "no cell ids (Colab, Kaggle)"])
def test_the_history_holds_each_cell_once_fixed_and_at_its_last_version(front_end, ids):
    kernel = front_end()  # no notebook file known: the kernel's history
    kernel.run("%load_ext nbddp", "load" if ids else None)
    errors = [kernel.run(source, cell_id if ids else None).error for source, cell_id in FAILED_THEN_FIXED]
    assert errors == ["ValueError: typo in the loader cell", None, None, None]
    dry = kernel.run("%%ddp_train --dry-run --every-rank\nprint(x, steps)", "train" if ids else None)
    assert dry.error is None, dry.shown
    script = dry.script()
    assert "x = 2" in script and "raise ValueError" not in script and script.count("x = 2") == 1
    assert "left out, raised here: In [2]" in dry.shown
    assert re.search(r"  In \[2\]\s+left out: it raised here", dry.shown)  # --dry-run: per cell
    if ids:
        assert "steps = 60" in script and "steps = 30" not in script
        assert "3 cells from the kernel's history (history): In [3], In [5], In [6]" in dry.shown
    else:  # an edit cannot be told from a new cell: both versions run, in order
        assert script.index("steps = 30") < script.index("steps = 60")
        assert "no cell ids from this front end" in dry.shown


def test_a_kernel_that_ran_only_the_magic_cell_says_so(front_end):
    kernel = front_end()
    kernel.run("%load_ext nbddp")
    dry = kernel.run("%%ddp_train --dry-run --every-rank\nprint('alone')")
    assert "nothing else ran in this kernel without raising: the job is this cell alone" in dry.shown
    assert "print('alone')" in dry.script()


def saved_notebook(path, cells):
    """``cells``: (source, id, tags) saved as JupyterLab writes nbformat 4.5."""
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(src, id=cid, metadata={"tags": list(tags)})
                                         for src, cid, tags in cells])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, str(path))
    return path


def test_vscode_cell_uris_name_the_notebook_and_follow_an_unsaved_edit(tmp_path, front_end):
    cells = [("%load_ext nbddp", "a", ()), ("steps = 30", "b", ()), ("lr = 0.1", "c", ()),
             ("%%ddp_train --dry-run --every-rank\nprint(steps, lr)", "d", ())]
    path = saved_notebook(tmp_path / "nb.ipynb", cells)
    kernel = front_end()  # VS Code also sets __vsc_ipynb_file__; the cell URIs alone name the notebook here

    def uri(handle):  # VS Code's cell URI: the notebook's path, the cell's handle in its fragment
        return f"vscode-notebook-cell:{path}#W{handle}sZmlsZQ%3D%3D"

    kernel.run("%load_ext nbddp", uri(0))
    kernel.run("steps = 30", uri(1))  # as saved
    kernel.run("steps = 60", uri(1))  # then edited: VS Code does not save by itself
    kernel.run("lr = 0.2", uri(2))  # edited before it ever ran as saved: nothing ties it to cell 3 but resemblance
    dry = kernel.run("%%ddp_train --dry-run --every-rank\nprint(steps, lr)", uri(3))
    assert dry.error is None, dry.shown
    assert "steps = 60" in dry.script() and "lr = 0.1" in dry.script()
    assert "3 cells from nb.ipynb (notebook): cell 2, cell 3, cell 4" in dry.shown
    assert "In [4] `lr = 0.2`, an edit of cell 3?" in dry.shown


PARAMETERS = [("%load_ext nbddp", "load", ()), ("steps = 30", "parameters", ("parameters",)),
              ("import torch", "imports", ())]


def papermill(tmp_path, name, *options):
    """Run ``name`` with papermill's CLI (its kernel imports nbddp from this tree); the executed notebook."""
    out = tmp_path / f"out-{name}"
    subprocess.run([sys.executable, "-m", "papermill", name, out.name, "-k", "python3", "-p", "steps", "60",
                    *options], cwd=tmp_path, env=kernel_env(), check=True, capture_output=True, timeout=600)
    return nbformat.read(str(out), as_version=4)


def text_of(cell) -> str:
    return "".join(o.get("text", "") or o.get("data", {}).get("text/plain", "") for o in cell.outputs)


def test_papermill_trains_the_parameters_it_was_given(tmp_path):
    saved_notebook(tmp_path / "nb.ipynb", [*PARAMETERS, (TRAIN, "train", ())])
    out = papermill(tmp_path, "nb.ipynb")  # the kernel names no notebook: its history, the injected cell in it
    shown = text_of(out.cells[-1])
    assert "trained 60 steps in 2 processes" in shown, shown
    assert no_rank_processes(str(tmp_path))


def test_papermill_with_the_input_path_injected_takes_its_parameters_too(tmp_path):
    saved_notebook(tmp_path / "nb.ipynb", [*PARAMETERS, ("%%ddp_train --dry-run --every-rank\nprint(steps)", "train", ())])
    out = papermill(tmp_path, "nb.ipynb", "--inject-input-path")  # PAPERMILL_INPUT_PATH: the file, as saved
    shown = text_of(out.cells[-1])
    assert "3 cells from nb.ipynb (notebook): cell 2, cell 3, cell 4" in shown, shown
    assert "cell 2: with the parameters papermill injected after it" in shown
    script = shown[shown.index("# [cell 2]"):]
    assert script.index("steps = 30") < script.index("steps = 60") < script.index("import torch")


@pytest.mark.colab
@pytest.mark.parametrize("ids", [False, True], ids=["no cell ids", "cellId in the request"])
def test_colab_and_kaggle_ipython_7_34_take_the_history_once_each_and_fixed(front_end, ids):
    # IPython 7.34 has no ExecutionInfo.cell_id: an id the front end sends is read from the request ipykernel serves
    kernel = front_end(kernel_dirs=colab_kernel_dirs(), kernel_name="colab")
    assert kernel.run("import IPython; print(IPython.__version__)").shown.strip() == "7.34.0"
    kernel.run("%load_ext nbddp", "load" if ids else None)
    errors = [kernel.run(source, cell_id if ids else None).error for source, cell_id in FAILED_THEN_FIXED]
    assert errors == ["ValueError: typo in the loader cell", None, None, None]
    dry = kernel.run("%%ddp_train --dry-run --every-rank\nprint(x, steps)", "train" if ids else None)
    assert dry.error is None, dry.shown
    script = dry.script()
    assert "x = 2" in script and "raise ValueError" not in script
    assert "left out, raised here: In [3]" in dry.shown
    assert "In [1] ran before %load_ext nbddp: whether it raised is not known" in dry.shown  # no record before 9
    if ids:
        assert "steps = 60" in script and "steps = 30" not in script
    else:
        assert script.index("steps = 30") < script.index("steps = 60")


def test_a_notebook_renamed_after_the_kernel_started(tmp_path, front_end):
    cells = [("%load_ext nbddp", "load", ()), ("steps = 30", "steps", ()),
             ("%%ddp_train --dry-run --every-rank\nprint(steps)", "train", ())]
    saved_notebook(tmp_path / "nb.ipynb", cells)
    kernel = front_end(JPY_SESSION_NAME="nb.ipynb")
    kernel.run("%load_ext nbddp", "load")
    kernel.run("steps = 60", "steps")
    (tmp_path / "nb.ipynb").rename(tmp_path / "renamed.ipynb")
    dry = kernel.run("%%ddp_train --dry-run --every-rank\nprint(steps)", "train")  # the cell's id finds the file
    assert "2 cells from renamed.ipynb (notebook): cell 2, cell 3" in dry.shown and "steps = 60" in dry.script()
    assert "found by this cell's id in renamed.ipynb, not in the notebook the kernel names" in dry.shown
    dry = kernel.run("%%ddp_train --dry-run --every-rank\nprint(steps)")  # no id: the history, and why
    assert "2 cells from the kernel's history (history)" in dry.shown and "steps = 60" in dry.script()
    assert "or names one that is gone: renamed since the kernel started?" in dry.shown
