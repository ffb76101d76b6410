import pytest

from nbddp.cells import read_notebook
from nbddp.errors import NotebookError


def test_reads_code_cells_numbered_like_the_ui(notebook):
    path = notebook(["a = 1", "b = 2"], markdown_first=True)
    cells = read_notebook(path)
    assert [(c.index, c.source) for c in cells] == [(2, "a = 1"), (3, "b = 2")]


@pytest.mark.parametrize(
    "content, reason",
    [
        (b"{not json", "not valid JSON"),
        (b'{"cells": 3, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}', "notebook"),
        ("{}".encode("utf-16"), "not UTF-8"),
    ],
)
def test_bad_files_raise_one_clear_error(tmp_path, content, reason):
    path = tmp_path / "bad.ipynb"
    path.write_bytes(content)
    with pytest.raises(NotebookError, match=reason):
        read_notebook(path)


def test_missing_file(tmp_path):
    with pytest.raises(NotebookError, match="no such notebook"):
        read_notebook(tmp_path / "nope.ipynb")
