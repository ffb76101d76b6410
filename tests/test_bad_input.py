"""Inputs a person should never have to see nbddp's traceback for: a cell holding a NUL byte, option values
and paths that cannot work, a notebook whose code deletes its own run directory. Each gets one clear line
before anything launches (or, for what only the run can show, a report pointing at the user's code)."""

import os

import nbformat
import pytest

from nbddp import cli, preflight, strategy
from nbddp.convert import convert_notebook
from nbddp.errors import NbddpError

NUL_CELL = "x = 1\x00\nprint(x)"


@pytest.fixture
def nul_notebook(tmp_path):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(NUL_CELL),
                                         nbformat.v4.new_code_cell("print('trained')")])
    path = tmp_path / "nul.ipynb"
    nbformat.write(nb, str(path))
    return path


def test_a_nul_byte_is_named_not_printed(nul_notebook, capsys):
    assert cli.main(["convert", str(nul_notebook)]) == 2
    err = capsys.readouterr().err
    assert "\x00" not in err
    assert "cell 1, line 1: not valid Python: source code string cannot contain null bytes" in err
    assert "x = 1\\x00" in err  # the byte, escaped


def test_a_skipped_nul_cell_leaves_a_script_that_compiles(nul_notebook, tmp_path, capsys):
    out = tmp_path / "train.py"
    assert cli.main(["convert", str(nul_notebook), "--skip-bad-cells", "-o", str(out)]) == 0
    text = out.read_text()
    assert "\x00" not in text and "\x00" not in capsys.readouterr().err
    compile(text, str(out), "exec")  # the header's comment of the skipped cell holds no NUL
    assert "skipped cell 1" in text and "print('trained')" in text


def test_run_with_skip_bad_cells_decides_a_strategy_for_it(nul_notebook):
    script = convert_notebook(nul_notebook, skip_bad_cells=True)
    assert strategy.read_shape(script.text).model is None  # used to raise: source cannot contain null bytes
    assert strategy.decide(script.text, nul_notebook.parent, gpu_free=()).strategy == "ddp"
