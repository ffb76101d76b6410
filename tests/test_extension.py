"""``%load_ext nbddp`` in an in-process IPython shell: what gets registered, and the cells a dry run takes."""

import json

import pytest
from IPython.core.interactiveshell import InteractiveShell


@pytest.fixture
def shell():
    ip = InteractiveShell.instance()
    ip.run_cell("%load_ext nbddp", store_history=True)
    yield ip
    ip.run_cell("%unload_ext nbddp")
    InteractiveShell.clear_instance()


def test_the_extension_registers_every_magic(shell):
    magics = shell.magics_manager.magics
    assert {"ddp_train", "ddp_setup"} <= set(magics["cell"]) and {"ddp_train", "ddp_setup", "ddp_doctor"} <= set(magics["line"])
    assert "%%ddp_train" in magics["cell"]["ddp_train"].__doc__ and "--source" in magics["cell"]["ddp_train"].__doc__


def test_reloading_follows_cell_runs_once(shell):
    before = len(shell.events.callbacks["pre_run_cell"])
    shell.run_cell("%reload_ext nbddp")
    assert len(shell.events.callbacks["pre_run_cell"]) == before


def test_a_rerun_cell_replaces_its_registration_by_cell_id(shell, capsys):
    shell.run_cell("%%ddp_setup\nsteps = 10", store_history=True, cell_id="cell-a")
    shell.run_cell("%%ddp_setup\nlr = 0.1", store_history=True, cell_id="cell-b")
    shell.run_cell("%%ddp_setup\nsteps = 20", store_history=True, cell_id="cell-a")  # edited, run again
    assert "steps" not in shell.user_ns and "lr" not in shell.user_ns  # registered, not run here
    capsys.readouterr()
    result = shell.run_cell("%%ddp_train --dry-run --every-rank\nprint(steps, lr)", store_history=True)
    assert result.success
    out = capsys.readouterr().out
    assert "2 cells from %%ddp_setup cells (registered) and this cell: In [4], In [3], In [5]" in out
    assert "steps = 20" in out and "steps = 10" not in out


def test_errors_show_as_one_line_without_nbddp_frames(shell, capsys):
    result = shell.run_cell("%%ddp_train --dry-run --source registered\nx = 1", store_history=True)
    assert not result.success
    err = capsys.readouterr()
    shown = err.out + err.err
    assert "NbddpError: no cells registered: mark the cells of the job with %%ddp_setup first" in shown
    assert "magics.py" not in shown and "Traceback" not in shown


def test_ddp_export_writes_the_kaggle_kernel_of_the_notebook_this_kernel_runs(shell, tmp_path, capsys):
    from conftest import QUICKSTART

    out = tmp_path / "kaggle"
    shell.user_ns["__vsc_ipynb_file__"] = str(QUICKSTART)  # what VS Code tells the kernel
    assert shell.run_cell(f"%ddp_export --kaggle {out} --id someone/quickstart-ddp --public").success
    meta = json.loads((out / "kernel-metadata.json").read_text())
    assert meta["id"] == "someone/quickstart-ddp" and meta["is_private"] is False
    assert meta["machine_shape"] == "NvidiaTeslaT4"  # two T4s unless told otherwise
    assert (out / "quickstart-ddp.py").read_text().startswith("#")
    printed = capsys.readouterr().out
    assert "exported quickstart.ipynb" in printed and f"kaggle kernels push -p {out}" in printed


def test_ddp_export_without_a_known_notebook_says_how_to_name_it(shell, tmp_path, capsys):
    result = shell.run_cell(f"%ddp_export --kaggle {tmp_path} --id someone/x")
    assert not result.success
    assert "give its path, %ddp_export my_notebook.ipynb" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_ddp_export_stops_at_a_secret_with_cell_and_line(shell, tmp_path, capsys):
    from conftest import write_notebook

    nb = write_notebook(tmp_path / "leaky.ipynb", ["import os", 'x = 1\nHF_TOKEN = "hf_' + "a" * 34 + '"'])
    result = shell.run_cell(f"%ddp_export {nb} --kaggle {tmp_path / 'k'} --id someone/leaky")
    assert not result.success
    shown = "".join(capsys.readouterr())
    assert "cell 2, line 2" in shown and "Traceback" not in shown
    assert not (tmp_path / "k").exists()
