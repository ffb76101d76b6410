"""%%ddp_train in a real kernel trains what the person ran: spoken to as JupyterLab speaks (each request with
its cell's id in ``cellId``) and as Colab or papermill speak (no id), with the notebook file saved or not
known."""

import re

import nbformat
import pytest

from conftest import no_rank_processes
from kernel import FrontEnd

pytestmark = pytest.mark.e2e

TRAIN = '''%%ddp_train --nproc 2
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(steps):
    loss = model(torch.randn(8, 4)).pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
print(f"trained {step + 1} steps in {torch.distributed.get_world_size()} processes")'''


@pytest.fixture
def front_end(tmp_path):
    started = []

    def start(**env):
        started.append(FrontEnd(tmp_path, **env))
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
    assert "3 cells from nb.ipynb (notebook): cell 2, cell 3, cell 4 · as run here: 2 (not as saved: 2) · saved file: 3" \
        in job.shown
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
    dry = kernel.run("%%ddp_train --dry-run\nprint(x, steps)", "train" if ids else None)
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
    dry = kernel.run("%%ddp_train --dry-run\nprint('alone')")
    assert "nothing else ran in this kernel without raising: the job is this cell alone" in dry.shown
    assert "print('alone')" in dry.script()
