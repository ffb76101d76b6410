import re
import subprocess
import sys
from pathlib import Path

import pytest

from nbddp.cells import cells_from_sources
from nbddp.convert import convert_cells
from nbddp.convert.script import SourceMap
from nbddp.errors import CellError


def test_every_mapped_line_comes_from_its_cell():
    cells = cells_from_sources([
        "!pip install -q trl\nimport os",
        'model = AutoModelForCausalLM.from_pretrained(\n    "m",\n    device_map="auto",\n)',
        "trainer = SFTTrainer(model=model)\ntrainer.train()\nmodel.save_pretrained('o')\nprint('done')",
    ])
    script = convert_cells(cells, origin="nb.ipynb")
    compile(script.text, "script.py", "exec")
    lines = script.text.splitlines()
    for n, (cell, line) in script.source_map.lines.items():
        src = cells[cell - 1].source.splitlines()[line - 1].strip()
        out = lines[n - 1].strip()
        if "nbddp" not in out:  # unchanged lines are identical, rewritten ones map to what they replace
            assert out == src, (n, out, src)
    # the training call maps to cell 3, line 2
    n = next(i for i, t in enumerate(lines, 1) if t.strip() == "trainer.train()")
    assert script.source_map.lookup(n) == (3, 2)
    assert [i.command for i in script.installs] == ["pip install -q trl"]


def test_script_says_what_it_changed_and_round_trips_its_map():
    script = convert_cells(cells_from_sources(['m = AutoModel.from_pretrained("x", device_map="auto")']))
    assert 'cell 1, line 1: AutoModel.from_pretrained: device_map="auto" → this rank\'s device' in script.text
    assert "no training call found" in script.warnings[0]
    assert SourceMap.from_json(script.source_map.to_json()) == script.source_map


def test_diff_shows_the_rewrite():
    script = convert_cells(cells_from_sources(['m = AutoModel.from_pretrained("x")']))
    diff = script.diff()
    assert '-m = AutoModel.from_pretrained("x")' in diff
    assert '+m = AutoModel.from_pretrained("x", device_map=_nbddp.device_map())' in diff


def _check_map(script, cells):
    """Every mapped line is its cell line, or a line nbddp rewrote (it says _nbddp or names a rule's keyword)."""
    lines = script.text.splitlines()
    for n, (cell, line) in script.source_map.lines.items():
        src = cells[cell - 1].source.splitlines()[line - 1].strip()
        out = lines[n - 1].strip()
        assert out == src or "_nbddp" in out or "=False" in out, (n, out, src)


def test_lines_map_through_every_kind_of_rewrite():
    cells = cells_from_sources([
        "import torch\nfrom torch.utils.data import DataLoader",
        "train_loader = DataLoader(ds, batch_size=4, shuffle=True)\nmodel = Net().to('cuda:0')\nopt = torch.optim.SGD(model.parameters(), lr=0.1)",
        "for epoch in range(2):\n    for x, y in train_loader:\n        loss = model(x).sum()\n        loss.backward()\n        opt.step()\n    print(epoch, loss.item())",
        "# keep it\ntorch.save(model.state_dict(), 'm.pt')\nprint('saved')",
    ])
    script = convert_cells(cells, origin="nb.ipynb")
    compile(script.text, "script.py", "exec")
    _check_map(script, cells)
    lines = script.text.splitlines()
    at = {text.strip(): script.source_map.lookup(n) for n, text in enumerate(lines, start=1)}
    assert at["loss.backward()"] == (3, 4)  # below the inserted set_epoch line
    assert at["_nbddp.set_epoch(train_loader, epoch)"] == (3, 1)  # inserted lines belong to the line before
    assert at["model = _nbddp.ddp(model)"] == (2, 2)
    assert at["print('saved')"] == (4, 3)  # indented under the rank-0 guard
    assert at["_nbddp.print0(epoch, loss.item())"] == (3, 6)
    assert at["if _nbddp.on_rank0():"] == (4, 2)  # the guard maps to the first statement it guards


def test_changes_are_listed_in_line_order_with_their_cell():
    cells = cells_from_sources([
        'args = SFTConfig(output_dir="o")\nm = AutoModelForCausalLM.from_pretrained("x", device_map="auto")\n'
        "trainer = SFTTrainer(model=m, args=args, peft_config=cfg)\ntrainer.train()\nm.save_pretrained('o')"
    ])
    script = convert_cells(cells)
    assert [(c.cell, c.line, c.rule) for c in script.changes] == [
        (1, 1, "trainer_config"), (1, 1, "trainer_config"), (1, 2, "device_map"), (1, 5, "rank0")
    ]


def test_empty_notebook_is_one_clear_error(notebook):
    from nbddp.convert import convert_notebook
    from nbddp.errors import NotebookError

    with pytest.raises(NotebookError, match="no code to convert"):
        convert_notebook(notebook(["", "   \n"], markdown_first=True))


BAD = {
    "invalid_json": (b'{"cells": [', "not valid JSON"),
    "schema": (b'{"cells": 3, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}', "notebook"),
    "encoding": ('{"cells": []}'.encode("utf-16"), "not UTF-8"),
    "latin1": ('{"cells": [], "metadata": {"a": "caf\xe9"}, "nbformat": 4, "nbformat_minor": 5}'.encode("latin-1"), "not UTF-8"),
    "empty_file": (b"", "not valid JSON"),
    "no_cells": (b'{"cells": [], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}', "no code to convert"),
}


@pytest.mark.e2e
@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_on_the_command_line_is_one_line_and_exit_2(tmp_path, case):
    content, reason = BAD[case]
    path = tmp_path / "bad.ipynb"
    path.write_bytes(content)
    proc = _cli("convert", path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("nbddp: error: ") and reason in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.e2e
def test_no_training_call_is_a_warning_not_an_error(notebook):
    proc = _cli("convert", notebook(["import os\nprint(os.sep)"]))
    assert proc.returncode == 0 and "nbddp: warning: no training call found" in proc.stderr


@pytest.mark.e2e
def test_bad_cell_names_cell_and_line_and_can_be_skipped(notebook):
    path = notebook(["a = 1", "%time x = (\n", "trainer = Trainer()\ntrainer.train()"], markdown_first=True)
    proc = _cli("convert", path)
    assert proc.returncode == 2 and "cell 3, line 1" in proc.stderr and "Traceback" not in proc.stderr
    proc = _cli("convert", path, "--skip-bad-cells")
    assert proc.returncode == 0 and "skipped cell 3" in proc.stderr


@pytest.mark.e2e
def test_explain_puts_every_change_at_a_cell_and_line():
    corpus = Path(__file__).resolve().parent / "corpus"
    for name in ("unsloth_kaggle_sft", "pytorch_image_cnn", "kaggle_magics"):
        proc = _cli("convert", corpus / f"{name}.ipynb", "--explain")
        assert proc.returncode == 0
        out = proc.stdout.strip().splitlines()
        assert out and all(re.match(r"cell \d+, line \d+: .+  \[\w+\]$", ln) for ln in out), out


def _cli(*args):
    root = Path(__file__).resolve().parent.parent
    return subprocess.run([sys.executable, "-m", "nbddp.cli", *map(str, args)], capture_output=True, text=True,
                          env={"PYTHONPATH": str(root / "src"), "PATH": "/usr/bin:/bin"})


ODD_CELLS = [
    "# only a comment",
    "%%capture",
    "\n\n   \n",
    "if True:\n\tx = 1\n\ty = 2",
    "async def f():\n    await g()\n",
    "match x:\n    case 1:\n        y = 2\n    case _:\n        pass",
    "a = 1; b = 2; print(a)",
    "if (n := len(xs)) > 2: print(n)",
    "@decorator\ndef f(x: int) -> str:\n    return f'{x!r:>{w}}'",
    "x = 1 \\\n    + 2",
    "global z\nz = 3",
    "class A:\n    def train(self):\n        pass\nA().train()",
    "m = AutoModelForCausalLM.from_pretrained(n, device_map='auto'); t = AutoTokenizer.from_pretrained(n)",
    "trainer = SFTTrainer(model=m); trainer.train(); m.save_pretrained('o')",
    "for i in range(2): trainer.train()\nprint('done')",
    "x = !ls\ny = %env\n%time trainer.train()",
    "lambda: trainer.train()",
    "try:\n    trainer.train()\nexcept KeyboardInterrupt:\n    pass\nfinally:\n    trainer.save_model('x')",
    "with torch.cuda.amp.autocast(): pass",
    "d = {'': 0}\nm = AutoModel.from_pretrained('x', device_map=d)",
    "model.to('cuda:0'); model.cuda(0)\nopt = torch.optim.Adam(model.parameters())\nfor e in range(2):\n    for x in train_loader:\n        model(x).sum().backward()",
    "print(torch.cuda.get_device_name(0))",
    "x = [y for y in range(3) if y]\n",
    "def f():\n    return (yield)\n",
    "if False:\n    trainer.train()\nelse:\n    pass",
    "df.filter(items=['a'])\nds = ds.map(f)\n",
]


@pytest.mark.parametrize("crlf", [False, True])
def test_odd_but_valid_cells_convert_and_compile(crlf):
    sources = [c.replace("\n", "\r\n") if crlf else c for c in ODD_CELLS]
    script = convert_cells(cells_from_sources(sources))
    compile(script.text, "script.py", "exec")


@pytest.mark.e2e
def test_the_job_api_imports_neither_libcst_nor_ipython():
    """libcst and IPython's transformers load with the first cell that needs them, not with nbddp's API."""
    code = ("import sys, nbddp.job, nbddp.launch, nbddp.cli, nbddp.convert\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('libcst', 'IPython')))")
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": str(root / "src"), "PATH": "/usr/bin:/bin"})
    assert out.stdout.strip() == "[]", out.stdout


def test_the_garbage_collector_is_paused_while_converting_and_left_as_found(monkeypatch):
    import gc

    from nbddp.convert import script as script_module

    seen = []
    real = script_module.clean_cell
    monkeypatch.setattr(script_module, "clean_cell", lambda cell, *more: seen.append(gc.isenabled()) or real(cell, *more))
    assert gc.isenabled()
    convert_cells(cells_from_sources(["x = 1\n"]))
    assert seen == [False] and gc.isenabled()
    with pytest.raises(CellError):
        convert_cells(cells_from_sources(["x = (\n"]))
    assert gc.isenabled()
    gc.disable()
    try:
        convert_cells(cells_from_sources(["x = 1\n"]))
        assert not gc.isenabled()
    finally:
        gc.enable()
