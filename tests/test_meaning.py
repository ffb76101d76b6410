"""The script keeps the notebook's meaning: Colab forms, notebooks Jupyter opens, shell lines as IPython
expands them, setup order, the notebook's folder, notebook-only magics, syntax of newer Pythons."""

import json
import subprocess
import sys

import pytest
from IPython.utils.text import DollarFormatter

from nbddp.cells import Cell, load_notebook
from nbddp.convert.clean import clean_cell
from nbddp.convert.script import convert_cells, convert_notebook
from nbddp.errors import CellError, NotebookError
from nbddp.runtime.shell_lines import expand

from conftest import ROOT


def clean(src, index=1):
    return clean_cell(Cell(index, src))


# 1. Colab form cells


def test_colab_form_lines_before_a_cell_magic_make_it_the_cells_magic():
    c = clean('#@title Colab Extra Install { display-mode: "form" }\n%%capture\n!pip install unsloth\nimport os\n')
    assert [i.command for i in c.installs] == ["pip install unsloth"]
    assert c.code.splitlines()[-1] == "import os" and c.line_map[-1] == 4
    assert "%%capture: the cell's printed output is kept" in c.notes[0].message and c.capture == (2, "")


def test_colab_markdown_and_param_lines_are_form_lines_too():
    c = clean("# @markdown Pick a model\n#@markdown ---\n%%time\nx = 1 #@param {type:'integer'}\n")
    assert c.code.splitlines() == ["x = 1 #@param {type:'integer'}"] and c.line_map == (4,)


# 2. Notebooks Jupyter opens


def _raw_notebook(path, minor, output_extra=None, cell_id=True):
    output = {"output_type": "stream", "name": "stdout", "text": "1\n", **(output_extra or {})}
    cell = {"cell_type": "code", "metadata": {}, "execution_count": 1, "source": ["print(1)\n"], "outputs": [output]}
    if cell_id:
        cell["id"] = "abc123"
    nb = {"nbformat": 4, "nbformat_minor": minor, "metadata": {}, "cells": [
        {"cell_type": "markdown", "metadata": {}, "source": "# hi", **({"id": "m1"} if cell_id else {})}, cell]}
    path.write_text(json.dumps(nb))
    return path


def test_cell_ids_in_a_4_4_notebook_are_read_with_a_warning(tmp_path):
    path = _raw_notebook(tmp_path / "ids.ipynb", 4)
    cells, notes = load_notebook(path)
    assert [(c.index, c.source) for c in cells] == [(2, "print(1)\n")]
    assert "read as nbformat 4.5" in notes[0] and "'id' was unexpected" in notes[0]
    script = convert_notebook(path)
    assert "print(1)" in script.text and "read as nbformat 4.5" in script.warnings[0]
    compile(script.text, "script.py", "exec")


def test_unexpected_metadata_in_a_stream_output_is_read_with_a_warning(tmp_path):
    path = _raw_notebook(tmp_path / "meta.ipynb", 5, {"metadata": {"tags": []}})
    cells, notes = load_notebook(path)
    assert [c.source for c in cells] == ["print(1)\n"] and "'metadata' was unexpected" in notes[0]


def test_a_file_jupyter_cannot_open_is_still_refused(tmp_path):
    path = tmp_path / "bad.ipynb"
    path.write_text(json.dumps({"nbformat": 4, "nbformat_minor": 5, "metadata": {}, "cells": [{"source": "x"}]}))
    with pytest.raises(NotebookError, match="not a notebook|invalid notebook"):
        load_notebook(path)


# 3. Shell lines


CASES = [
    "tar xf {file_path}", "echo $name and $$HOME", "echo {n // 4} {names[1:]}", "echo '$name' $name.upper",
    "awk '{print $1}' {file_path}", "echo {missing}", "echo {{literal}} {n!r}",
]


@pytest.mark.parametrize("command", CASES)
def test_expand_is_ipythons_var_expand(command):
    file_path, name, n, names = "data.tar", "x y", 8, ["a", "b", "c"]  # noqa: F841 (read through the frame)
    try:
        ipython = DollarFormatter().vformat(command, [], {**globals(), **locals()})
    except Exception:
        ipython = command
    assert expand(command) == ipython


def test_shell_lines_keep_their_expansions_for_the_runtime():
    c = clean("!tar xf {file_path}\n%cd {os.getcwd()}/repo\n%env OUT=$base/out\n")
    assert c.code.splitlines() == [
        "_nbddp.shell('tar xf {file_path}')",
        "_nbddp.cd('{os.getcwd()}/repo')",
        "os.environ['OUT'] = _nbddp.expand('$base/out')",
    ]


def test_bash_cell_is_one_script():
    c = clean("%%bash\nX=1\nfor i in 1 2; do\n  echo $X$i\ndone\n", index=4)
    assert c.code == "_nbddp.shell_cell('bash', 'X=1\\nfor i in 1 2; do\\n  echo $X$i\\ndone\\n')\n"
    assert c.line_map == (1,) and not c.installs
    assert clean("%%script bash -e\necho 1\n").code.startswith("_nbddp.shell_cell('bash -e', ")
    assert clean("%%sh\necho 1\n").code.startswith("_nbddp.shell_cell('sh', ")
    assert clean("%%bash --no-raise-error\nfalse\n").code.startswith("_nbddp.shell_cell('bash --no-raise-error', ")


def test_bash_cell_of_installs_joins_the_install_plan():
    c = clean("%%bash\npip install trl\n# and\napt-get install -y git\n")
    assert [(i.line, i.command) for i in c.installs] == [(2, "pip install trl"), (4, "apt-get install -y git")]
    assert c.code == ""


SHELL_NOTEBOOK = [
    "import os\nfile_path = 'my file.txt'\nn = 8\nname = 'x'\nos.makedirs('repo', exist_ok=True)",
    "!echo hello > '{file_path}'\n!cat *.txt\n!echo $name {n // 4} '$name'",
    "%%bash\nX=3\nfor i in 1 2; do\n  echo $X$i \\\n    done\ndone",
    "%cd {os.getcwd()}/repo\nprint(os.path.basename(os.getcwd()))\n%cd ..\n%cd -q \"repo\"\n%cd /no/such/dir\n%cd ..",
    "!exit 3\nprint('exit code', _exit_code)\nfiles = !ls\nprint(sorted(f for f in files if f.endswith('.txt')))",
]


def _kernel_output(nb):
    from kernel import stream

    return [stream(cell, "stdout") for cell in nb.cells]


@pytest.mark.e2e
def test_shell_lines_print_what_the_kernel_prints(tmp_path):
    """The same cells in a real kernel and as the converted script (one process): the same output."""
    from kernel import execute

    (tmp_path / "k").mkdir()
    (tmp_path / "s").mkdir()
    nb, _ = execute(tmp_path / "k" / "nb.ipynb", SHELL_NOTEBOOK)
    expected = "".join(_kernel_output(nb)).replace(str(tmp_path / "k"), "<here>").replace("\r\n", "\n")
    script = convert_cells([Cell(i, src) for i, src in enumerate(SHELL_NOTEBOOK, 1)])
    path = tmp_path / "s" / "script.py"
    script.write(path)
    proc = subprocess.run([sys.executable, str(path)], cwd=tmp_path / "s", capture_output=True, text=True,
                          env={**__import__("os").environ, "PYTHONPATH": str(ROOT / "src")}, timeout=300)
    assert proc.returncode == 0, proc.stderr
    got = proc.stdout.replace(str(tmp_path / "s"), "<here>")
    assert "hello" in expected and "my file.txt" in expected and "x 2 $name" in expected  # the cells ran
    assert got.endswith(expected), (got, expected)


@pytest.mark.e2e
def test_a_failing_bash_cell_raises_as_in_ipython(tmp_path):
    script = convert_cells([Cell(1, "%%bash\necho out\nexit 4"), Cell(2, "print('after')")])
    path = tmp_path / "script.py"
    script.write(path)
    proc = subprocess.run([sys.executable, str(path)], cwd=tmp_path, capture_output=True, text=True,
                          env={**__import__("os").environ, "PYTHONPATH": str(ROOT / "src")}, timeout=300)
    assert proc.returncode != 0 and "out" in proc.stdout and "after" not in proc.stdout
    assert "CalledProcessError" in proc.stderr


# 4. Setup order


def test_an_install_of_local_files_keeps_its_place():
    c = clean("!git clone https://github.com/x/REPO\n!pip install -e ./REPO[train]\n!pip install trl\n")
    assert [i.command for i in c.installs] == ["pip install trl"]
    assert c.code.splitlines()[:2] == [
        "_nbddp.shell('git clone https://github.com/x/REPO')",
        "_nbddp.shell('pip install -e ./REPO[train]')",
    ]
    c = clean("%cd REPO\n%pip install -r requirements.txt\n")
    assert not c.installs and c.code.splitlines()[1] == "_nbddp.shell('pip install -r requirements.txt')"


def test_an_install_that_would_replace_torch_is_named_and_skipped(monkeypatch):
    from importlib.metadata import version

    from nbddp.launch import run_installs
    from nbddp.runtime.shell_lines import stack_replacement

    monkeypatch.delenv("NBDDP_REPLACE_TORCH", raising=False)
    said = []
    harmless = ["--dry-run", "--index-url", "http://127.0.0.1:9/simple"]  # should it run after all
    run_installs([["pip", "install", "torch==2.0.0", *harmless]], sink=lambda stream, text: said.append(text))
    assert said == [f"nbddp: not installing `pip install torch==2.0.0 {' '.join(harmless)}`: torch==2.0.0 would "
                    f"replace the running torch {version('torch')} (NBDDP_REPLACE_TORCH=1 installs it)\n"]
    other_index = "pip install torch torchvision --index-url https://download.pytorch.org/whl/cu118".split()
    assert "--index-url" in stack_replacement(other_index)
    assert stack_replacement("pip install -q torch trl peft".split()) is None
    assert stack_replacement(["pip", "install", f"torch=={version('torch')}"]) is None


@pytest.mark.e2e
def test_an_install_in_the_script_that_would_replace_torch_is_skipped_in_the_rank(tmp_path):
    import os
    from importlib.metadata import version

    harmless = "--dry-run --index-url http://127.0.0.1:9/simple"  # should it run after all
    cells = [f"pin = 'torch==2.0.0'\n!pip install -qqq \"{{pin}}\" {harmless}\nprint('exit code', _exit_code)"]
    convert_cells([Cell(1, src) for src in cells]).write(tmp_path / "script.py")
    env = {k: v for k, v in os.environ.items() if k != "NBDDP_REPLACE_TORCH"}
    proc = subprocess.run([sys.executable, str(tmp_path / "script.py")], cwd=tmp_path, capture_output=True,
                          text=True, env={**env, "PYTHONPATH": str(ROOT / "src")}, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert (f"nbddp: not installing `pip install -qqq \"torch==2.0.0\" {harmless}`: torch==2.0.0 would replace the "
            f"running torch {version('torch')}") in proc.stdout
    assert "exit code 0" in proc.stdout


# 5. The notebook's folder


@pytest.mark.e2e
def test_script_imports_modules_from_its_working_directory(tmp_path):
    (tmp_path / "helper_functions.py").write_text("def hello():\n    return 'hi from helper'\n")
    run = tmp_path / "runs" / "r1"
    run.mkdir(parents=True)
    convert_cells([Cell(1, "import helper_functions\nprint(helper_functions.hello())")]).write(run / "script.py")
    proc = subprocess.run([sys.executable, str(run / "script.py")], cwd=tmp_path, capture_output=True, text=True,
                          env={**__import__("os").environ, "PYTHONPATH": str(ROOT / "src")}, timeout=300)
    assert proc.returncode == 0 and "hi from helper" in proc.stdout, proc.stderr


# 6. What waits for a person


def _run_as_rank(tmp_path, sources, **env):
    """The converted cells run as one rank that torchrun would have started (its environment), one process."""
    import os

    convert_cells([Cell(i, src) for i, src in enumerate(sources, 1)]).write(tmp_path / "script.py")
    rank_env = {k: v for k, v in os.environ.items() if k != "HF_TOKEN"}
    rank_env.update(PYTHONPATH=str(ROOT / "src"), LOCAL_RANK="0", RANK="0", WORLD_SIZE="1",
                    HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1", **env)
    return subprocess.run([sys.executable, str(tmp_path / "script.py")], cwd=tmp_path, capture_output=True,
                          text=True, env=rank_env, stdin=subprocess.DEVNULL, timeout=300)


@pytest.mark.e2e
def test_input_in_a_rank_says_what_to_do(tmp_path):
    proc = _run_as_rank(tmp_path, ["x = 1", "name = input('Your name: ')\nprint(name)"])
    assert proc.returncode != 0 and "input() waits for a person" in proc.stderr, proc.stderr
    note = clean("name = input('Your name: ')\n").notes[0]
    assert note.line == 1 and "input() waits for a person" in note.message


@pytest.mark.e2e
def test_hub_login_without_a_token_says_what_to_do(tmp_path):
    cells = ["from huggingface_hub import notebook_login\nnotebook_login()\nprint('logged in')"]
    proc = _run_as_rank(tmp_path, cells)
    assert proc.returncode != 0 and "log in before launch" in proc.stderr and "HF_TOKEN" in proc.stderr
    assert "logged in" not in proc.stdout
    proc = _run_as_rank(tmp_path, cells, HF_TOKEN="hf_" + "x" * 34)
    assert proc.returncode == 0 and "logged in" in proc.stdout, proc.stderr
    login = ["import huggingface_hub\nhuggingface_hub.login()\nprint('logged in')"]
    proc = _run_as_rank(tmp_path, login)
    assert proc.returncode != 0 and "log in before launch" in proc.stderr
    assert "without a token" in clean(login[0]).notes[0].message


# 8. Notebook-only magics; --skip-bad-cells


def test_notebook_only_magics_are_dropped_with_a_note():
    c = clean("%load_ext tensorboard\n%tensorboard --logdir runs\n%matplotlib inline\nx = 1\n")
    assert c.code.splitlines()[1] == "# nbddp: %tensorboard --logdir runs dropped (notebook-only)"
    assert [n.line for n in c.notes] == [1, 2, 3]


def test_skipped_cells_leave_a_script_that_compiles():
    cells = [Cell(1, "a = 1"), Cell(2, "def f(:\n    pass\n"), Cell(3, "  b = (\n")]
    script = convert_cells(cells, skip_bad_cells=True)
    compile(script.text, "script.py", "exec")
    assert [c.index for c in script.cells] == [1] and sum("skipped cell" in w for w in script.warnings) == 2


# 10. Syntax of a newer Python


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="Python 3.12 reads these cells")
@pytest.mark.parametrize("src, line, what", [
    ('d = {"k": 1}\nprint(f"{d["k"]}")\n', 2, "f-string"),
    ("x = 1\n!echo hi\nprint(f'{\"-\".join(\\'ab\\')}' + f'{x[\"a\"]}')\n", 3, "f-string"),
    ("type Vector = list[float]\n", 1, "type alias"),
    ("def first[T](xs: list[T]) -> T:\n    return xs[0]\n", 1, "type parameters"),
])
def test_a_cell_for_a_newer_python_names_the_version(src, line, what):
    with pytest.raises(CellError) as err:
        clean(src, index=5)
    assert (err.value.cell, err.value.line) == (5, line)
    assert "needs Python 3.12 or newer" in str(err.value) and what in str(err.value)
    assert f"this is Python {sys.version_info.major}.{sys.version_info.minor}" in str(err.value)


def test_an_ordinary_syntax_error_does_not_blame_the_python_version():
    with pytest.raises(CellError) as err:
        clean('print(f"{x}")\nx y\n')
    assert "needs Python" not in str(err.value) and err.value.line == 2


@pytest.mark.e2e
def test_a_captured_cell_keeps_its_shell_output_from_the_console(tmp_path):
    cells = ["print('before')", "%%capture out\n!echo from-shell\nprint('from-python')", "print('after', out.stdout.split())"]
    convert_cells([Cell(i, src) for i, src in enumerate(cells, 1)]).write(tmp_path / "script.py")
    proc = subprocess.run([sys.executable, str(tmp_path / "script.py")], cwd=tmp_path, capture_output=True, text=True,
                          env={**__import__("os").environ, "PYTHONPATH": str(ROOT / "src")}, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-2:] == ["before", "after ['from-shell', 'from-python']"]
