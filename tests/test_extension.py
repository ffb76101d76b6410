"""``%load_ext nbddp`` in an in-process IPython shell: what gets registered, and the cells a dry run takes."""

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
    result = shell.run_cell("%%ddp_train --dry-run\nprint(steps, lr)", store_history=True)
    assert result.success
    out = capsys.readouterr().out
    assert "3 cells from %%ddp_setup cells (registered): In [4], In [3], In [5]" in out
    assert "steps = 20" in out and "steps = 10" not in out


def test_errors_show_as_one_line_without_nbddp_frames(shell, capsys):
    result = shell.run_cell("%%ddp_train --dry-run --source registered\nx = 1", store_history=True)
    assert not result.success
    err = capsys.readouterr()
    shown = err.out + err.err
    assert "NbddpError: no cells registered: mark the cells of the job with %%ddp_setup first" in shown
    assert "magics.py" not in shown and "Traceback" not in shown
