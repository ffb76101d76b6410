"""Kaggle export: a token built from pieces is still found; tokens where the export does not look (markdown,
outputs, metadata, skipped cells) are reported; the printed push command survives any folder name."""

import shlex

import nbformat
import pytest

from nbddp.cells import cells_from_sources
from nbddp.errors import SecretError
from nbddp.export import export_kaggle
from nbddp.export.secrets import find_secrets

HEAD, TAIL = "hf_aBcDeFgHiJkLmNo", "pQrStUvWxYz0123456789"  # a token of 39 characters, in two pieces


@pytest.mark.parametrize("source, line", [
    (f'login(token="{HEAD}" + "{TAIL}")', 1),
    (f'x = 1\ntoken = ("{HEAD}"\n         "{TAIL}")', 2),  # adjacent literals over two lines
    (f'parts = 0\nos.environ["HF_TOKEN"] = "{HEAD}" + \\\n    "{TAIL}"', 2),
    (f'key = "".join(["{HEAD}", "{TAIL}"])', 1),
    (f'!echo hi\nlogin(token="{HEAD[:8]}" + "{HEAD[8:]}" + "{TAIL}")', 2),  # beside an IPython escape
])
def test_a_token_split_by_concatenation_is_found(source, line):
    (finding,) = find_secrets(cells_from_sources(["import os", source]))
    assert (finding.cell, finding.line, finding.kind) == (2, line, "Hugging Face token")
    assert HEAD + TAIL not in finding.masked and TAIL not in finding.masked


def test_pieces_that_are_no_token_stay_quiet():
    cells = cells_from_sources(['name = "meta-llama/" + "Llama-3.2-1B"\npath = "outputs" + "/" + str(3)\n'
                                'msg = "hf_" + "x"'])
    assert find_secrets(cells) == []


def notebook_with_leaks(path):
    token = HEAD + TAIL
    nb = nbformat.v4.new_notebook(
        cells=[
            nbformat.v4.new_markdown_cell(f"Log in with `{token}` first"),
            nbformat.v4.new_code_cell("print('hello')", outputs=[
                nbformat.v4.new_output("stream", name="stdout", text=f"token is {token}\n")]),
            nbformat.v4.new_code_cell(f'login("{token}")', metadata={"tags": ["nbddp-skip"]}),
            nbformat.v4.new_code_cell("x = 2", metadata={"note": f"{token}"}),
        ],
        metadata={"secret_note": token},
    )
    nbformat.write(nb, str(path))
    return path


def test_tokens_the_export_leaves_behind_are_reported_by_cell(tmp_path):
    nb = notebook_with_leaks(tmp_path / "nb.ipynb")
    result = export_kaggle(nb, tmp_path / "out", kernel_id="me/run-one", every_rank=True)  # no training call: as asked
    assert (HEAD + TAIL) not in result.script.read_text()  # none of them is exported …
    warnings = "\n".join(result.warnings)
    assert (HEAD + TAIL) not in warnings  # … nor repeated
    for where in ("cell 1 (markdown), line 1", "cell 2 (its output)", "cell 3 (tagged nbddp-skip), line 1",
                  "cell 4 (its metadata)", "the notebook's metadata"):
        assert f"{where}: a Hugging Face token" in warnings, warnings
    assert "not exported" in warnings


def test_the_printed_push_command_is_shell_quoted(tmp_path):
    nb = tmp_path / "nb.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x = 1")]), str(nb))
    folder = tmp_path / "my kernel; rm -rf ~"
    result = export_kaggle(nb, folder, kernel_id="me/run-one", every_rank=True)  # no training call: as asked
    command = str(result).splitlines()[-1].split("push it with:", 1)[1].strip()
    assert shlex.split(command) == ["kaggle", "kernels", "push", "-p", str(folder)]


def test_a_secret_in_code_still_stops_the_export(tmp_path):
    nb = tmp_path / "nb.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(f'tok = "{HEAD}" + "{TAIL}"')]), str(nb))
    with pytest.raises(SecretError) as info:
        export_kaggle(nb, tmp_path / "out", kernel_id="me/run-one")
    assert (info.value.cell, info.value.line) == (1, 1)
    assert not (tmp_path / "out").exists()
