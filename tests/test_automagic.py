"""Bare ``pip install x`` / ``conda …`` / ``cd dir`` / ``ls`` cells, which IPython's automagic runs as magics, are
read as IPython reads them, not refused as "not valid Python" nor run as Python (no process started)."""

from __future__ import annotations

import pytest

from nbddp.cells import Cell
from nbddp.convert.clean import clean_cell
from nbddp.convert.script import convert_cells
from nbddp.errors import CellError


def convert(*sources):
    return convert_cells([Cell(i, s) for i, s in enumerate(sources, start=1)])


def test_a_bare_pip_install_cell_runs_once_before_launch():
    script = convert("pip install transformers\n", "import transformers\n")
    assert [(i.cell, i.line, i.command) for i in script.installs] == [(1, 1, "pip install transformers")]
    assert "# [cell 1]\n# nbddp: `pip install transformers` runs once before launch\n" in script.text


@pytest.mark.parametrize("line, command", [
    ("conda install -y faiss-cpu", "conda install -y faiss-cpu"),
    ("pip install -q -U peft", "pip install -q -U peft"),
])
def test_bare_installs_of_each_manager(line, command):
    assert [i.command for i in convert(line).installs] == [command]


def test_a_bare_install_under_capture_is_read_as_the_kernel_reads_the_cell_body():
    assert [i.command for i in convert("%%capture\npip install peft\n").installs] == ["pip install peft"]


@pytest.mark.parametrize("line, code", [
    ("cd /kaggle/working", "_nbddp.cd('/kaggle/working')"),  # Python reads it too: a division
    ("cd ..", "_nbddp.cd('..')"),
    ("ls data/", "_nbddp.shell('ls -F --color data/')"),  # IPython's alias, with the options it adds
    ("ls", "_nbddp.shell('ls -F --color')"),
    ("mkdir -p out", "_nbddp.shell('mkdir -p out')"),
])
def test_bare_shell_magics_and_aliases_run_as_in_the_kernel(line, code):
    assert clean_cell(Cell(1, line), set()).code == code + "\n"


def test_a_name_the_notebook_binds_keeps_the_line_python():
    script = convert("ls = ['a', 'b']\n", "ls\n")
    assert "\nls\n" in script.text and "_nbddp.shell" not in script.text


def test_an_assignment_to_a_magic_name_stays_python():
    assert clean_cell(Cell(1, "pip = 3"), set()).code == "pip = 3\n"


def test_automagic_reads_one_line_cells_only_as_ipython_does():
    # IPython prefilters a cell only when it is one line: in a longer cell the line is a syntax error there too
    with pytest.raises(CellError, match="cell 1, line 2: not valid Python"):
        convert("import os\npip install transformers\n")


@pytest.mark.parametrize("line, argv", [
    ("pip install torch  # already there", ["pip", "install", "torch"]),
    ("!pip install -q peft # the adapter", ["pip", "install", "-q", "peft"]),
    ("pip install git+https://github.com/x/y.git#egg=y", ["pip", "install", "git+https://github.com/x/y.git#egg=y"]),
    # a quote in the comment is the comment's (the course notebooks' "# this is the version we're using"): it was
    # refused as an unclosed quote, though the kernel's shell runs the line
    ("!pip install torchmetrics==0.9.3 # this is the version we're using", ["pip", "install", "torchmetrics==0.9.3"]),
    ("!pip install -q torchmetrics -U mlxtend # <- Note: If you're using Colab", ["pip", "install", "-q", "torchmetrics",
                                                                                 "-U", "mlxtend"]),
    ("!pip install 'a # b' c # it's quoted", ["pip", "install", "a # b", "c"]),
    ("!pip install a\\\\ #b", ["pip", "install", "a\\"]),  # an escaped backslash, then a comment
    ("!pip install a\\ #b", ["pip", "install", "a #b"]),  # an escaped space: the # is inside the word
])
def test_an_install_runs_without_its_trailing_comment_as_the_shell_runs_it(line, argv):
    assert [i.argv() for i in convert(line).installs] == [argv]


def test_an_install_line_with_an_unclosed_quote_before_its_comment_is_refused():
    with pytest.raises(CellError, match="cannot read this install line"):
        [i.argv() for i in convert("!pip install 'torch # why").installs]
