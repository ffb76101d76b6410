from nbddp.cells import cells_from_sources
from nbddp.convert import convert_cells
from nbddp.convert.script import SourceMap


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
