"""A %%ddp cell's conversion (no kernel): the script the ranks read, its map, and only what a cell needs."""

from __future__ import annotations

from nbddp.cells import Cell
from nbddp.convert import convert_cells
from nbddp.kept.cell import convert_kept_cell
from nbddp.runtime.sourcemap import read_source_map

HISTORY = [Cell(1, "import torch\nfrom transformers import Trainer, TrainingArguments\n"
                   "trainer = Trainer(model=None, args=TrainingArguments(output_dir='outputs'))"),
           Cell(2, "trainer.train()")]


def test_a_kept_cell_is_its_own_lines_of_the_whole_script_with_its_map(tmp_path):
    kept = convert_kept_cell("x = 1\nprint(x)", HISTORY, tmp_path, 7)
    assert kept.path == tmp_path / "ddp-cell-7.py" and kept.path.read_text() == kept.script.text
    # after a training too, a cell that binds and prints runs on every rank as written, in cell 3's lines
    assert kept.code.splitlines()[1:] == ["# %%ddp", "x = 1", "print(x)"]
    source_map = read_source_map(kept.path)
    mapped = [source_map.lookup(n) for n in range(kept.first, kept.last + 1)]
    assert [m for m in mapped if m] == [(3, 1), (3, 2), (3, 3)]  # the magic's line is line 1
    # the launcher's facts are not read for a cell that launches nothing; the script is the same
    whole = convert_cells([*HISTORY, kept.cell], origin=HISTORY[0].origin, kept_cell=True)
    assert whole.text == kept.script.text and whole.output_targets and kept.script.output_targets == ()


def _kept(tmp_path, source: str):
    kept = convert_kept_cell(source, HISTORY, tmp_path, 1)
    return kept, kept.code.splitlines()[2:]


def test_a_kept_cell_that_computes_and_prints_runs_on_every_rank(tmp_path):
    """A job's code after training runs on rank 0; a %%ddp cell's must not, or its names exist on rank 0 alone
    and the next cell's collective fails on the other ranks (issue 40)."""
    kept, code = _kept(tmp_path, "n_test = len(data['test'])\nprint(n_test)\nout = model.generate(**inputs)\n"
                                 "print(tokenizer.decode(out[0]))\nplt.plot(losses)\nplt.show()\nmetrics = trainer.evaluate()")
    assert code == ["n_test = len(data['test'])", "print(n_test)", "out = model.generate(**inputs)",
                    "print(tokenizer.decode(out[0]))", "plt.plot(losses)", "plt.show()", "metrics = trainer.evaluate()"]
    assert "_nbddp.on_rank0()" not in kept.code and not kept.script.warnings


def test_a_kept_cell_writes_and_pushes_once_and_sends_what_they_bind(tmp_path):
    kept, code = _kept(tmp_path, "x = 1\nmodel.save_pretrained('out')\ncommit = model.push_to_hub('me/x')\n"
                                 "with open('notes.txt', 'a') as fh:\n    fh.write('kept')\nprint(x, commit)\n"
                                 "with open('notes.txt') as fh:\n    read = fh.read()")
    assert code == [
        "x = 1",
        "with _nbddp.from_rank0(globals(), 'commit', 'fh'):  # [nbddp] it writes or pushes: once, on rank 0; "
        "commit, fh sent to every rank",
        "    if _nbddp.on_rank0():",
        "        model.save_pretrained('out')",
        "        commit = model.push_to_hub('me/x')",
        "        with open('notes.txt', 'a') as fh:",
        "            fh.write('kept')",
        "print(x, commit)",
        "with open('notes.txt') as fh:",  # reading: every rank
        "    read = fh.read()",
    ]
    # the cell says so as it runs, at the line the person sees (the %%ddp line is line 1)
    assert kept.script.warnings[-1] == ("this %%ddp cell, line 3: runs on rank 0 only, as it writes or pushes, then "
                                        "commit, fh sent from rank 0 to every rank (in a kept job the other statements "
                                        "run on every rank)")
    source_map = read_source_map(kept.path)
    mapped = [source_map.lookup(n) for n in range(kept.first, kept.last + 1)]
    assert [m for m in mapped if m][4:8] == [(3, 3), (3, 4), (3, 5), (3, 6)]  # the guarded lines keep their own


def test_a_kept_write_without_names_is_guarded_alone(tmp_path):
    kept, code = _kept(tmp_path, "trainer.save_model('out')\nprint('saved')")
    assert code == ["with _nbddp.from_rank0(globals()):  # [nbddp] it writes or pushes: once, on rank 0",
                    "    if _nbddp.on_rank0():", "        trainer.save_model('out')", "print('saved')"]


def test_a_kept_value_that_may_differ_between_ranks_is_said_at_its_line(tmp_path):
    kept, code = _kept(tmp_path, "noise = torch.randn(2)\nrank = torch.distributed.get_rank()\n"
                                 "out = model.generate(**inputs, do_sample=True)\nsame = model.generate(**inputs, do_sample=False)\n"
                                 "pd.DataFrame([trainer.evaluate()]).to_csv('m.csv')")
    assert "_nbddp" not in kept.code  # each runs on every rank, as written
    said = [w for w in kept.script.warnings if w.startswith("this %%ddp cell")]
    assert said == [
        "this %%ddp cell, line 2: noise may differ between ranks (torch.randn() draws at random on each rank): "
        "each rank holds its own value, and rank 0's is the one shown",
        "this %%ddp cell, line 3: rank may differ between ranks (torch.distributed.get_rank() is each rank's own): "
        "each rank holds its own value, and rank 0's is the one shown",
        "this %%ddp cell, line 4: out may differ between ranks (model.generate() samples on each rank): each rank "
        "holds its own value, and rank 0's is the one shown",
        "this %%ddp cell, line 6: runs on every rank, since trainer.evaluate() needs every rank, so every rank runs "
        "to_csv(): put that in a statement of its own to run it once",
    ]


def test_a_jobs_script_keeps_its_after_training_rule(tmp_path):
    """The kept rule is the %%ddp cell's alone: the same code as a job's last cell still runs on rank 0."""
    whole = convert_cells([*HISTORY, Cell(3, "x = 1\nprint(x)")], origin=HISTORY[0].origin)
    assert "if _nbddp.on_rank0():\n    x = 1\n    print(x)" in whole.text


def test_a_kept_jobs_own_code_after_training_runs_on_every_rank_but_its_writes():
    """%%ddp_train --keep: the cells after it run on every rank, so what its code after training binds must be
    there too (the script's after-training rule would leave it on rank 0)."""
    cells = [HISTORY[0], Cell(2, "trainer.train()\nrows = 8\nprint(rows)\nmodel.save_pretrained('lora')")]
    kept = convert_cells(cells, origin=HISTORY[0].origin, kept_tail=True)
    assert ("trainer.train()\nrows = 8\nprint(rows)\nwith _nbddp.from_rank0(globals()):  # [nbddp] it writes or pushes: "
            "once, on rank 0\n    if _nbddp.on_rank0():\n        model.save_pretrained('lora')\n") in kept.text
    assert "if _nbddp.on_rank0():\n    rows = 8" in convert_cells(cells, origin=HISTORY[0].origin).text  # a job's


def test_a_plain_loops_kept_write_sees_the_model_unwrapped_and_every_rank_keeps_the_wrapper():
    cells = [Cell(1, "import torch\nmodel = torch.nn.Linear(4, 1)\noptimizer = torch.optim.SGD(model.parameters(), lr=0.1)"),
             Cell(2, "for _ in range(3):\n    loss = model(torch.randn(8, 4)).pow(2).mean()\n    optimizer.zero_grad()\n"
                     "    loss.backward()\n    optimizer.step()\ntorch.save(model.state_dict(), 'small.pt')")]
    text = convert_cells(cells, kept_tail=True).text
    assert ("with _nbddp.from_rank0(globals(), unwrapped=('model',)):  # [nbddp] it writes or pushes: once, on rank 0\n"
            "    if _nbddp.on_rank0():\n        torch.save(_nbddp.unwrap(model).state_dict(), 'small.pt')\n") in text
    assert "model = _nbddp.unwrap(model)" not in text  # which would leave rank 0 alone with the bare model
