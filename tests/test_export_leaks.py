"""Kaggle export: a token built from pieces is still found; tokens where the export does not look (markdown,
outputs, metadata, skipped cells) are reported; the printed push command survives any folder name."""

import shlex

import nbformat
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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


TOKEN = HEAD + TAIL


@pytest.mark.parametrize("cells, cell, line", [
    ([f'prefix = "{HEAD}"\ntok = prefix + "{TAIL}"'], 1, 2),  # a name bound in the same cell
    ([f'prefix = "{HEAD}"', "x = 1", f'login(token=prefix + "{TAIL}")'], 3, 1),  # … in an earlier cell
    ([f'tok = "{HEAD}"', f'tok += "{TAIL}"'], 2, 1),
    ([f'rest = "{TAIL}"', f'tok = "{HEAD}" + rest'], 2, 1),
    ([f'tok = "hf_{{}}".format("{TOKEN[3:]}")'], 1, 1),
    ([f'tok = "hf_{{rest}}".format(rest="{TOKEN[3:]}")'], 1, 1),
    ([f'tok = "hf_%s" % "{TOKEN[3:]}"'], 1, 1),
    ([f'tok = "hf_%s%s" % ("{HEAD[3:]}", "{TAIL}")'], 1, 1),
    ([f'p = "{TOKEN[3:]}"', 'login(token=f"hf_{p}")'], 2, 1),
    ([f'p = "{TOKEN[3:]}"', 'login(token=f"hf_{p!s:>10}")'], 2, 1),
    ([f'sep = ""\nhead = "{HEAD}"', f'tok = sep.join([head, "{TAIL}"])'], 2, 1),
    ([f'a = "{HEAD}"\nb = a', f'os.environ["HF_TOKEN"] = b + "{TAIL}"'], 2, 1),  # a name copied
])
def test_a_token_the_code_computes_from_constants_is_found(cells, cell, line):
    (finding,) = find_secrets(cells_from_sources(cells))
    assert (finding.cell, finding.line, finding.kind) == (cell, line, "Hugging Face token")
    assert TAIL not in finding.masked


@pytest.mark.parametrize("cells", [
    [f'prefix = "{HEAD}"', "prefix = input()", f'tok = prefix + "{TAIL}"'],  # rebound to an unknown value
    [f'prefix = "{HEAD}"', "for prefix in names: pass", f'tok = prefix + "{TAIL}"'],
    [f'prefix = "{HEAD}"', "del prefix", f'tok = prefix + "{TAIL}"'],
    [f'tok = prefix + "{TAIL}"', f'prefix = "{HEAD}"'],  # bound only after the line that uses it
])
def test_a_name_no_longer_bound_to_the_constant_is_not_folded(cells):
    assert find_secrets(cells_from_sources(cells)) == []


@pytest.mark.parametrize("source", [
    'x = "{:>999999999}".format("a")', 'x = "%999999999s" % "a"', 'x = "%*s" % (999999999, "a")',
    'x = f"{1:999999999}"', 'x = "{0.__class__}".format("a")', 'a = "ab"\n' + "a = a + a\n" * 64,
    'x = "a"' + ' + "a"' * 3000,
])
def test_folding_never_builds_a_large_value(source):
    assert find_secrets(cells_from_sources([source])) == []  # answered at once, with nothing found


@settings(max_examples=60, deadline=None)
@given(cut=st.integers(min_value=1, max_value=len(TOKEN) - 1),
       shape=st.sampled_from(["plus", "augmented", "format", "percent", "f-string", "join"]),
       across=st.booleans())
def test_a_token_cut_anywhere_into_two_constants_is_found(cut, shape, across):
    head, tail = TOKEN[:cut], TOKEN[cut:]
    build = {
        "plus": "tok = head + tail",
        "augmented": "tok = head\ntok += tail",
        "format": 'tok = "{}{}".format(head, tail)',
        "percent": 'tok = "%s%s" % (head, tail)',
        "f-string": 'tok = f"{head}{tail}"',
        "join": 'tok = "".join([head, tail])',
    }[shape]
    binds = f"head = {head!r}\ntail = {tail!r}"
    cells = [binds, build] if across else [f"{binds}\n{build}"]
    built_at = (2, 1) if across else (1, 3)
    built_at = (built_at[0], built_at[1] + 1) if shape == "augmented" else built_at
    findings = find_secrets(cells_from_sources(cells))
    assert built_at in [(f.cell, f.line) for f in findings], (cells, findings)  # a long head is a token itself too
    assert {f.kind for f in findings} == {"Hugging Face token"}


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
