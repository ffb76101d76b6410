"""Notebook files nbformat's reader or validator fails on with a Python error (a number + "_cell", ``'list' object
has no attribute 'get'``) and cell magics IPython refuses: each is one line naming what is wrong and the cell,
never an internal error (the shapes the CLI fuzz, ``test_cli_fuzz.py``, found)."""

import copy
import json

import pytest

from nbddp import cli

NOTEBOOK = {
    "cells": [
        {"cell_type": "markdown", "id": "a", "metadata": {}, "source": "# title"},
        {"cell_type": "code", "id": "b", "execution_count": None, "metadata": {}, "outputs": [], "source": "x = 1"},
        {"cell_type": "code", "id": "c", "execution_count": None, "metadata": {}, "outputs": [], "source": "y = 2"},
    ],
    "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
    "nbformat": 4,
    "nbformat_minor": 5,
}


def said(tmp_path, capsys, content) -> str:
    """``nbddp convert`` of a file holding ``content`` (JSON): exit 2 and one error line, which is returned."""
    path = tmp_path / "nb.ipynb"
    path.write_text(json.dumps(content))
    assert cli.main(["convert", str(path)]) == 2
    err = capsys.readouterr().err
    errors = [ln for ln in err.splitlines() if ln.startswith("nbddp: error: ")]
    assert len(errors) == 1 and "internal error" not in err and "Traceback" not in err, err
    return errors[0].removeprefix(f"nbddp: error: {path}: ")


def changed(**where) -> dict:
    nb = copy.deepcopy(NOTEBOOK)
    for key, value in where.items():
        if key.startswith("cell3_"):
            nb["cells"][2][key.removeprefix("cell3_")] = value
        elif key.startswith("meta_"):
            nb["metadata"][key.removeprefix("meta_")] = value
        else:
            nb[key] = value
    return nb


@pytest.mark.parametrize("content, message", [
    ([NOTEBOOK], 'not a notebook: the file holds a JSON array (list), not a notebook (an object with "cells")'),
    ("notebook", 'not a notebook: the file holds a JSON string, not a notebook (an object with "cells")'),
    (changed(cells="x = 1"), 'not a notebook: "cells" is a JSON string, not a list of cells'),
    (changed(cells=[["x = 1"]]), 'not a notebook: cell 1 is a JSON array (list), not a cell (an object with '
                                 '"cell_type" and "source")'),
    (changed(cell3_source=[1]), 'not a notebook: cell 3: "source" is a JSON array (list), not text'),
    (changed(metadata=None), 'not a notebook: "metadata" is a JSON null, not an object'),
])
def test_json_of_no_notebook_shape_is_named(tmp_path, capsys, content, message):
    assert said(tmp_path, capsys, content).startswith(message)


@pytest.mark.parametrize("cell_type", [1, None, [], {"a": 1}])
@pytest.mark.parametrize("kernelspec", ["x", [], {"name": 1}, {}, None])
def test_a_cell_type_that_is_no_text_is_named_at_its_cell(tmp_path, capsys, cell_type, kernelspec):
    """With the kernelspec malformed too, nbformat's validator itself failed (``1 + "_cell"``): internal error."""
    message = said(tmp_path, capsys, changed(cell3_cell_type=cell_type, meta_kernelspec=kernelspec))
    assert message.startswith('not a notebook: cell 3: "cell_type" is a JSON ')
    assert message.endswith(', not "code", "markdown" or "raw"')


@pytest.mark.parametrize("change, message", [
    ({"cell3_outputs": [None]}, 'cell 3: "outputs[0]" is a JSON null, not an object'),
    ({"cell3_outputs": [{"output_type": "stream", "name": "stdout", "text": [1]}]},
     'cell 3: "outputs[0].text[0]" is a JSON number, not a string'),
    ({"cell3_outputs": [{"output_type": {}}]}, 'cell 3: "outputs[0].output_type" is {}, a kind nbformat does not know'),
    ({"cell3_metadata": 7}, 'cell 3: "metadata" is a JSON number, not an object'),
    ({"cell3_outputs": [{"output_type": "display_data", "data": [], "metadata": {}}]},
     'cell 3: "outputs[0].data" is a JSON array (list), not an object'),
])
def test_where_a_cell_breaks_the_schema_is_said_not_pythons_error(tmp_path, capsys, change, message):
    assert said(tmp_path, capsys, changed(**change)) == f"not a notebook: {message}"


@pytest.mark.parametrize("quote", ["'", '"'])
def test_a_writefile_line_with_an_unclosed_quote_is_refused_at_its_cell(tmp_path, capsys, quote):
    nb = copy.deepcopy(NOTEBOOK)
    nb["cells"][2]["source"] = f"%%writefile {quote}train.py\nprint('hello')\n"
    path = tmp_path / "nb.ipynb"
    path.write_text(json.dumps(nb))
    assert cli.main(["convert", str(path)]) == 2
    err = capsys.readouterr().err
    assert "internal error" not in err
    assert err.startswith("nbddp: error: cell 3, line 1: %%writefile's line cannot be read: no closing quotation; "
                          f"close the quote around the file name\n    %%writefile {quote}train.py")
