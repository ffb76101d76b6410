"""A kept job's %%ddp cell predicts on every GPU: its prediction loops split over the ranks as a predicting
notebook's do (``convert/facts/predicts.py``), and every rank holds the whole results in row order afterwards,
as the kernel's one process would (a later cell runs on every rank; ``%ddp_pull`` brings rank 0's)."""

from __future__ import annotations

import json

import pytest
import torch

from kernel import errors, kernel_env, stream
from test_kept_kernel import STILL, STOP, _client, _run

from nbddp.cells import Cell
from nbddp.errors import NbddpError
from nbddp.kept.cell import convert_kept_cell

#: A plain loop's kept job, as ``%%ddp_train --keep`` leaves it: its cells before the %%ddp cell.
HISTORY = [Cell(1, "import torch\nmodel = torch.nn.Linear(4, 3)\noptimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"
                   "test_loader = torch.utils.data.DataLoader(list(range(8)), batch_size=2)"),
           Cell(2, "for _ in range(3):\n    loss = model(torch.randn(8, 4)).pow(2).mean()\n"
                   "    optimizer.zero_grad()\n    loss.backward()\n    optimizer.step()")]


def _code(tmp_path, source: str) -> list[str]:
    return convert_kept_cell(source, HISTORY, tmp_path, 1).code.splitlines()[2:]


def test_a_kept_cells_prediction_loop_takes_its_share_and_every_rank_gathers_the_whole(tmp_path):
    source = ("preds, correct = [], 0\nwith torch.no_grad():\n    for x, y in test_loader:\n"
              "        out = model(x).argmax(-1)\n        preds.append(out)\n"
              "        correct += (out == y).sum().item()\nprint(correct)")
    kept = convert_kept_cell(source, HISTORY, tmp_path, 1)
    assert kept.code.splitlines()[2:] == [
        "preds, correct = [], 0",
        "with torch.no_grad():",
        "    import nbddp.runtime.predict",  # the cell runs without the script's prelude
        "    for x, y in (_nbddp_rows := _nbddp.predict.Rows(test_loader, preds=preds, correct=correct)):",
        "        out = model(x).argmax(-1)",
        "        preds.append(out)",
        "        correct += _nbddp_rows.add('correct', (out == y).sum().item())",
        "    else:",
        "        preds, correct, = _nbddp_rows.gathered()",
        "        _nbddp_rows.settle(globals(), 'out', 'x', 'y')",  # as the rank of the last row left them
        "print(correct)",  # on every rank, as every statement of a %%ddp cell: a later cell reads it anywhere
    ]
    assert kept.script.warnings == (
        "this %%ddp cell, line 4: for … in test_loader: each rank predicts its share of the rows (a DataLoader's: a "
        "contiguous block of whole batches; other rows: the next chunk whenever the rank is free), "
        "and after the loop preds, correct hold every rank's results in the rows' order (every rank holds them)",)


def test_a_kept_cells_function_splits_each_call_and_a_loop_calling_it_stays_whole(tmp_path):
    code = _code(tmp_path, "def inference(model, loader):\n    out = []\n    for x in loader:\n"
                           "        out.append(model(x))\n    return out\n"
                           "folds = [inference(m, test_loader) for m in [model]]\nall_preds = []\n"
                           "for m in [model]:\n    all_preds.append(inference(m, test_loader))")
    text = "\n".join(code)
    assert text.count("_nbddp.predict.Rows(") == 1 and "Rows(loader, out=out)" in text
    assert "for m in [model]:" in code  # whole on every rank: each call of inference splits its own rows
    assert "settle" not in text  # a function's names are its own; one read after its loop is refused instead


def test_a_kept_cell_that_trains_or_only_predicts_with_the_trainer_is_left_to_their_rules(tmp_path):
    code = _code(tmp_path, "for x in test_loader:\n    loss = model(x).sum()\n    preds.append(loss)\n    loss.backward()")
    assert "_nbddp.predict" not in "\n".join(code)
    history = [Cell(1, "from transformers import Trainer\ntrainer = Trainer(model=None)"), Cell(2, "trainer.train()")]
    kept = convert_kept_cell("out = trainer.predict(test_ds)\nmetrics = trainer.evaluate()", history, tmp_path, 2)
    assert kept.code.splitlines()[2:] == ["out = trainer.predict(test_ds)", "metrics = trainer.evaluate()"]


def test_a_kept_cells_split_loop_writes_after_it_once_and_stays_on_every_rank(tmp_path):
    """A statement holding a split loop runs on every rank even where it writes (rank 0 alone would wait for the
    others' shares in the gather): its write after the loop is rank 0's."""
    code = _code(tmp_path, "with torch.no_grad():\n    preds = []\n    for x in test_loader:\n"
                           "        preds.append(model(x))\n    torch.save(preds, 'preds.pt')")
    text = "\n".join(code)
    assert "from_rank0" not in text and "Rows(test_loader, preds=preds)" in text
    assert "    if _nbddp.on_rank0():\n        torch.save(preds, 'preds.pt')" in text


@pytest.mark.parametrize("source, line, why", [
    ("preds = []\nfor x in test_loader:\n    preds.append(model(x))\n    if len(preds) > 2:\n        break",
     3, "it stops with break"),
    ("preds, seen = [], {}\nfor i, x in enumerate(test_loader):\n    preds.append(model(x))\n    seen[i] = x",
     3, "it writes into seen[i] row by row"),
    ("loader = torch.utils.data.DataLoader(list(range(8)), batch_size=2, shuffle=True)\npreds = []\n"
     "for x in loader:\n    preds.append(model(x))", 4, "gives its rows in a random order"),
])
def test_a_kept_cells_unsplittable_loop_is_refused_at_this_cells_line(tmp_path, source, line, why):
    with pytest.raises(NbddpError) as refused:
        convert_kept_cell(source, HISTORY, tmp_path, 1)
    message = str(refused.value)
    assert message.startswith(f"this %%ddp cell, line {line}: nbddp cannot split this prediction loop"), message
    assert why in message and "The kept job's ranks are kept, and nothing of this cell ran" in message, message


#: A kept job that made a pipeline in an earlier cell.
PIPE_HISTORY = [*HISTORY, Cell(3, "from transformers import pipeline\npipe = pipeline('text-classification', model=model)")]


def test_a_kept_cells_pipeline_call_over_rows_is_split_and_every_rank_holds_the_results(tmp_path):
    source = "texts = ['a', 'b', 'c']\npreds = pipe(texts, batch_size=2)\nfor out in pipe(texts):\n    print(out)"
    kept = convert_kept_cell(source, PIPE_HISTORY, tmp_path, 1)
    assert kept.code.splitlines()[2:] == [
        "texts = ['a', 'b', 'c']",
        "import nbddp.runtime.predict",  # the cell runs without the script's prelude
        "preds = _nbddp.predict.split_call(pipe, texts, batch_size=2)",
        "import nbddp.runtime.predict",
        "for out in _nbddp.predict.split_call(pipe, texts):",
        "    print(out)",
    ]
    assert [w.split(":")[0] for w in kept.script.warnings] == ["this %%ddp cell, line 3", "this %%ddp cell, line 4"]
    assert all(w.endswith("(every rank holds them)") for w in kept.script.warnings), kept.script.warnings
    # as the kernel's one process runs it: the pipeline's own results, and the loop's name left at the last one
    import nbddp.runtime

    scope = {"_nbddp": nbddp.runtime, "pipe": lambda rows, batch_size=1: [r.upper() for r in rows]}
    exec(compile(kept.code, "cell", "exec"), scope)
    assert scope["preds"] == ["A", "B", "C"] and scope["out"] == "C"


def test_a_kept_cells_pipeline_call_that_cannot_be_split_runs_whole_on_every_rank(tmp_path):
    code = _code(tmp_path, "print(pipe(['a', 'b']), pipe(['c']))")
    assert code == ["print(pipe(['a', 'b']), pipe(['c']))"]


#: The kept job: a tiny classifier with a BatchNorm (DDP broadcasts its buffers in a forward with gradients on)
#: trained on 2 gloo ranks, and a test set whose 7 batches the ranks share unevenly (3 and 4).
SETUP = ("%%ddp_setup\nimport torch\ntorch.manual_seed(0)\n"
         "model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))\n"
         "optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"
         "test_x = torch.randn(37, 4, generator=torch.Generator().manual_seed(1))\n"
         "test_y = torch.randint(0, 3, (37,), generator=torch.Generator().manual_seed(2))\n"
         "test_loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(test_x, test_y), batch_size=6)\n")
TRAIN = ("%%ddp_train --keep --nproc 2\nfor _ in range(3):\n"
         "    x = torch.randn(8, 4)[torch.distributed.get_rank()::2]\n"
         "    loss = torch.nn.functional.cross_entropy(model(x), x.argmax(-1) % 3)\n"
         "    optimizer.zero_grad()\n    loss.backward()\n    optimizer.step()\n")
#: Gradients on, as many a notebook's evaluation has them: DDP's forward would broadcast the BatchNorm's buffers
#: at each batch, which ranks with 3 and 4 batches cannot all enter.
PREDICT = ("%%ddp\nmodel.eval()\npreds, correct = [], 0\nfor x, y in test_loader:\n"
           "    out = model(x).argmax(-1)\n    preds.extend(out.tolist())\n    correct += (out == y).sum().item()\n"
           "state = {k: v.tolist() for k, v in model.module.state_dict().items()}\n")
#: A later cell, on every rank: each holds every row, and the last batch as the kernel's loop would leave it.
EVERY_RANK = ("%%ddp\nheld = torch.tensor([float(len(preds)), float(correct), float(len(x))])\n"
              "torch.distributed.all_reduce(held)\nprint('held', held.tolist())\n")
REFUSED = "%%ddp\nfirst = []\nfor x, y in test_loader:\n    first.append(model(x))\n    break\n"
#: A pipeline over the test rows, as transformers' is called (a list of rows in, a result per row out): the kept
#: cell splits the call over the ranks in whole batches of 4, and every rank gets every label back in order.
PIPE = ("%%ddp\ndef pipeline(task, model):\n    def call(rows, batch_size=1):\n        with torch.no_grad():\n"
        "            return [int(model(torch.tensor([r])).argmax()) for r in rows]\n    return call\n"
        "pipe = pipeline('text-classification', model=model)\nrows = test_x.tolist()\nlabels = pipe(rows, batch_size=4)\n")
PULL = ["%ddp_pull preds", "%ddp_pull correct", "%ddp_pull state", "%ddp_pull labels",
        "torch.save({'preds': preds, 'correct': correct, 'state': state, 'labels': labels}, 'pulled.pt')"]


@pytest.mark.e2e
def test_a_ddp_cell_predicts_on_every_rank_and_pulls_what_one_process_computes(tmp_path):
    nb, client = _client(tmp_path)
    with client.setup_kernel(env=kernel_env(NBDDP_CACHE=str(tmp_path / "cache"))):
        cells = _run(client, nb, ["%load_ext nbddp", "import torch", SETUP, TRAIN, PREDICT, EVERY_RANK, PIPE, *PULL])
        assert not any(errors(c) for c in cells), [(e.ename, e.evalue) for c in cells for e in errors(c)]
        held = stream(cells[5], "stdout")
        # a loop the ranks cannot split: refused at the cell's line before the ranks hear of it; the job is kept
        refused, still = _run(client, nb, [REFUSED, STILL])
        (error,) = errors(refused)
        assert "this %%ddp cell, line 3: nbddp cannot split this prediction loop" in error.evalue, error.evalue
        assert "still kept, world 2" in stream(still, "stdout"), still.outputs
        (stop,) = _run(client, nb, [STOP])
        assert "every rank has exited" in stream(stop, "stdout")

    # what one process computes with the trained weights, over the same rows in the same order
    pulled = torch.load(tmp_path / "pulled.pt")
    test_x = torch.randn(37, 4, generator=torch.Generator().manual_seed(1))
    test_y = torch.randint(0, 3, (37,), generator=torch.Generator().manual_seed(2))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(test_x, test_y), batch_size=6)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    model.load_state_dict({k: torch.tensor(v) for k, v in pulled["state"].items()})
    model.eval()
    preds, correct = [], 0
    for x, y in loader:
        out = model(x).argmax(-1)
        preds.extend(out.tolist())
        correct += (out == y).sum().item()
    assert pulled["preds"] == preds and len(preds) == 37 and pulled["correct"] == correct
    with torch.no_grad():
        assert pulled["labels"] == [int(model(torch.tensor([r])).argmax()) for r in test_x.tolist()]
    # every rank held all 37 rows and the count, and the last batch (of 1 row) as the kernel's loop leaves it
    assert f"held [74.0, {2.0 * correct}, 2.0]" in held, held

    # each rank predicted its own contiguous block of the 7 batches: disjoint, together every batch
    (run_dir,) = [p.parent.parent for p in (tmp_path / "nbddp_runs").glob("*/shares/rank0.jsonl")]
    shares = [[json.loads(line) for line in (run_dir / "shares" / f"rank{r}.jsonl").read_text().splitlines()]
              for r in (0, 1)]
    loop, call = ([[(s["unit"], s["total"], s["first"], s["end"]) for s in rank if s["unit"] == unit][-1]
                   for rank in shares] for unit in ("batches", "rows"))
    assert loop == [("batches", 7, 0, 3), ("batches", 7, 3, 7)]
    # and the pipeline's call its own block of the 37 rows, in whole batches of 4 (5 and 5 of the 10)
    assert call == [("rows", 37, 0, 20), ("rows", 37, 20, 37)]
