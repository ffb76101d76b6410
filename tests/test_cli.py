import subprocess
import sys

import pytest

from conftest import QUICKSTART, ROOT


def nbddp(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "nbddp.cli", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"})


@pytest.mark.e2e
def test_convert_writes_a_runnable_script_and_its_map(tmp_path):
    out = tmp_path / "train.py"
    proc = nbddp("convert", QUICKSTART, "-o", out)
    assert proc.returncode == 0, proc.stderr
    text = out.read_text()
    compile(text, str(out), "exec")
    assert "_nbddp.setup()" in text and text.rstrip().endswith("_nbddp.cleanup()")
    assert (tmp_path / "train.py.map.json").exists()


@pytest.mark.e2e
def test_convert_explain_and_diff(tmp_path):
    proc = nbddp("convert", QUICKSTART, "--explain")
    assert "device_map=\"auto\" → this rank's device  [device_map]" in proc.stdout
    assert "install before launch: pip install -q trl peft accelerate datasets  [install]" in proc.stdout
    proc = nbddp("convert", QUICKSTART, "--diff")
    assert proc.stdout.startswith("---") and "+_nbddp.setup()" in proc.stdout


@pytest.mark.e2e
def test_bad_input_is_one_line_and_exit_2(tmp_path):
    bad = tmp_path / "bad.ipynb"
    bad.write_text("{oops")
    proc = nbddp("convert", bad)
    assert proc.returncode == 2
    assert proc.stderr.startswith("nbddp: error: ") and "Traceback" not in proc.stderr


@pytest.mark.e2e
def test_unparsable_cell_names_cell_and_line(tmp_path):
    import nbformat

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("a = 1"), nbformat.v4.new_code_cell("b = (\n")])
    path = tmp_path / "nb.ipynb"
    nbformat.write(nb, str(path))
    proc = nbddp("convert", path)
    assert proc.returncode == 2 and "cell 2, line 1" in proc.stderr
    proc = nbddp("convert", path, "--skip-bad-cells")
    assert proc.returncode == 0 and "a = 1" in proc.stdout and "skipped cell 2" in proc.stderr
