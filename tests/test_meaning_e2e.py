"""A notebook that uses the kernel's conveniences runs under ``nbddp run --nproc 2`` and prints what a
kernel prints for it, once: a Colab form cell, ``{x}``/``$x`` shell lines, a ``%%bash`` cell, a module next
to the notebook, ``%tensorboard``, saved as nbformat 4.4 with cell ids."""

import json
import os
import subprocess
import sys

import nbformat
import pytest

from conftest import ROOT, no_rank_processes
from kernel import execute, stream

FORM = '#@title Setup { display-mode: "form" }\n'
CELLS = [
    '%%capture\nimport os\nos.environ["DEMO_FLAG"] = "on"\nprint("captured, never shown")',
    'file_name = "data file.txt"\nx = 21\n!echo "x is {x}, twice {x*2}" > "{file_name}"\n!cat "$file_name"\n'
    '!echo $x {os.environ.get("DEMO_FLAG")} $$HOME-literal',
    '%%bash\nGREETING=hello\nfor n in 1 2; do\n  echo "$GREETING $n" \\\n    from bash\ndone',
    "import helper\nprint(helper.double(x))",
    "%load_ext tensorboard\n%tensorboard --logdir runs",
    '%cd {os.getcwd()}\n!exit 2\nprint("exit code", _exit_code)',
]


def _save_4_4_with_ids(path, sources):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# Demo")]
                                  + [nbformat.v4.new_code_cell(s) for s in sources])
    data = json.loads(nbformat.writes(nb))
    data["nbformat_minor"] = 4  # as some editors save it: ids, with the minor version of before ids
    assert all("id" in c for c in data["cells"])
    path.write_text(json.dumps(data))


@pytest.mark.e2e
def test_a_notebook_of_kernel_conveniences_runs_on_two_ranks_as_in_the_kernel(tmp_path):
    kernel_dir, job_dir = tmp_path / "kernel", tmp_path / "job"
    for folder in (kernel_dir, job_dir):
        folder.mkdir()
        (folder / "helper.py").write_text("def double(v):\n    return 2 * v\n")
    # Jupyter has no Colab forms: the kernel gets the cell without its form line, which is what Colab runs
    nb, _ = execute(kernel_dir / "nb.ipynb", CELLS)
    expected = "".join(stream(c, "stdout") for c in nb.cells).replace("\r\n", "\n")
    expected = expected.replace(str(kernel_dir), "<folder>")
    assert "x is 21, twice 42" in expected and "hello 2 from bash" in expected and "42\n" in expected

    path = job_dir / "demo.ipynb"
    _save_4_4_with_ids(path, [FORM + CELLS[0]] + CELLS[1:])
    proc = subprocess.run(
        [sys.executable, "-m", "nbddp.cli", "run", str(path), "--nproc", "2", "--runs-dir", str(tmp_path / "runs")],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = "".join(ln for ln in proc.stdout.splitlines(keepends=True) if not ln.startswith("nbddp"))
    assert printed.replace(str(job_dir), "<folder>") == expected
    assert "read as nbformat 4.5" in proc.stderr
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert no_rank_processes(str(run_dir))
