import pytest

from nbddp.cells import Cell
from nbddp.convert.clean import clean_cell
from nbddp.convert.ipython import is_install
from nbddp.errors import CellError


def clean(src, index=1):
    return clean_cell(Cell(index, src))


def test_pip_lines_leave_the_code_and_join_the_install_plan():
    c = clean("!pip install -q trl peft\n%pip install datasets\nx = 1\n")
    assert [(i.line, i.command) for i in c.installs] == [(1, "pip install -q trl peft"), (2, "pip install datasets")]
    assert c.code.splitlines() == [
        "# nbddp: `pip install -q trl peft` runs once before launch",
        "# nbddp: `pip install datasets` runs once before launch",
        "x = 1",
    ]
    assert c.line_map == (1, 2, 3)


def test_capture_cell_keeps_its_body_and_maps_lines_past_the_magic():
    c = clean("%%capture\n!pip install unsloth\nimport os\nprint(os.sep)\n")
    assert "capture" not in c.code
    assert [i.command for i in c.installs] == ["pip install unsloth"]
    assert c.code.splitlines()[1:] == ["import os", "print(os.sep)"]
    assert c.line_map == (2, 3, 4)


def test_backslash_continued_install_is_one_command():
    c = clean("!pip install -q a \\\n    b\ny = 2\n")
    assert c.installs[0].command.split() == ["pip", "install", "-q", "a", "b"]
    assert c.code.splitlines()[1] == "y = 2" and c.line_map == (1, 3)


def test_line_magics_become_python_or_go():
    c = clean("%matplotlib inline\n%time z = 1 + 1\n%env MY_VAR=7\n%cd /tmp\nx = !ls\n")
    lines = c.code.splitlines()
    assert lines == [
        "# nbddp: %matplotlib inline dropped (notebook-only)",
        "z = 1 + 1",
        "os.environ['MY_VAR'] = '7'",
        "_nbddp.cd('/tmp')",
        "x = _nbddp.getoutput('ls')",
    ]
    assert c.line_map == (1, 2, 3, 4, 5)


def test_other_shell_commands_run_through_the_runtime():
    c = clean("!nvidia-smi\n")
    assert c.code.strip() == "_nbddp.shell('nvidia-smi')" and not c.installs


def test_install_with_interpolation_stays_in_the_script():
    c = clean("pkg = 'trl'\n!pip install {pkg}\n")
    assert not c.installs and "_nbddp.shell('pip install {pkg}')" in c.code


def test_syntax_error_names_cell_and_line():
    with pytest.raises(CellError) as err:
        clean("x = 1\n\ndef f(:\n    pass\n", index=7)
    assert err.value.cell == 7 and err.value.line == 3
    assert "cell 7, line 3" in str(err.value) and "def f(:" in str(err.value)


def test_install_alone_in_a_block_leaves_a_pass():
    c = clean("if True:\n    !pip install x\nz = 3\n")
    assert c.code.splitlines()[1] == "    pass  # nbddp: `pip install x` runs once before launch"
    compile(c.code, "cell", "exec")


def test_display_only_cell_magic_is_left_out():
    c = clean("%%html\n<b>hi</b>\n")
    assert c.code == "" and "left out" in c.notes[0].message


@pytest.mark.parametrize(
    "cmd, yes",
    [("pip install x", True), ("python -m pip install x", True), ("uv pip install x", True),
     ("apt-get install -y git", True), ("pip list", False), ("nvidia-smi", False)],
)
def test_is_install(cmd, yes):
    assert is_install(cmd) is yes


def test_installs_inside_if_false_stay_where_they_are():
    c = clean("if False:\n    !pip install llama-cpp-python\n    %pip install gguf\n!pip install trl\n")
    assert [i.command for i in c.installs] == ["pip install trl"]
    assert c.code.splitlines()[:3] == [
        "if False:",
        "    _nbddp.shell('pip install llama-cpp-python')",
        "    _nbddp.shell('pip install gguf')",
    ]


def test_time_cell_magic_keeps_the_body():
    c = clean("%%time\nstats = trainer.train()\n")
    assert c.code.splitlines() == ["stats = trainer.train()"] and c.line_map == (2,)
    assert "%%time dropped" in c.notes[0].message


def test_capture_cell_magic_with_a_name():
    c = clean("%%capture out\nimport os\n")
    assert c.code.splitlines()[-1] == "import os" and c.line_map[-1] == 2


def test_display_and_env_with_spaces():
    c = clean("%env HF_HUB_ENABLE_HF_TRANSFER 1\ndisplay(df.head())\n")
    assert c.code.splitlines() == ["os.environ['HF_HUB_ENABLE_HF_TRANSFER'] = '1'", "display(df.head())"]


def test_unknown_magic_names_cell_and_line():
    with pytest.raises(CellError) as err:
        clean("x = 1\n\n%debug\n", index=4)
    assert (err.value.cell, err.value.line) == (4, 3) and "%debug" in str(err.value)


def test_time_magic_around_bad_code_names_its_line():
    with pytest.raises(CellError) as err:
        clean("a = 1\n%time b = (\n", index=2)
    assert err.value.line == 2


def test_comments_and_blank_lines_above_a_replaced_magic_stay():
    src = "x = 1\n# install it\n\n!pip install foo\n# go there\n%cd /tmp\n\n%env A=1\n# hush\n%matplotlib inline\n"
    c = clean(src)
    assert c.code.splitlines() == [
        "x = 1",
        "# install it",
        "",
        "# nbddp: `pip install foo` runs once before launch",
        "# go there",
        "_nbddp.cd('/tmp')",
        "",
        "os.environ['A'] = '1'",
        "# hush",
        "# nbddp: %matplotlib inline dropped (notebook-only)",
    ]
    assert c.line_map == tuple(range(1, 11))
    assert [(i.line, i.command) for i in c.installs] == [(4, "pip install foo")]
