"""What a training loop over a sharded loader adds up (an epoch's loss, correct answers, rows seen), made the whole
data set's after the loop: summed over the ranks, or averaged where the notebook divides it by a count of the
rank's own. Before, ``trn_loss / len(data_train)`` printed half the epoch's loss on two ranks.

The first notebook is the shape of a public Kaggle notebook's training cell (the "blind" competition's training
notebook, cell 17: ``trn_loss += loss.item() * inputs.size(0)`` … ``trn_loss / len(data_train)``), cut to a tiny
model with a learning rate of 0, so one process and two ranks see the same losses."""

import json
import subprocess
import sys

import pytest

from conftest import write_notebook
from nbddp.cells import Cell
from nbddp.convert.script import convert_cells
from nbddp.display.view import QuietView
from nbddp.job import run_job
from nbddp.options import RunOptions

SETUP = """import json, torch, torch.nn as nn
torch.manual_seed(0)
X = torch.randn(96, 8); Y = (X[:, 0] > 0).long()
data_train = torch.utils.data.TensorDataset(X[:64], Y[:64])
data_valid = torch.utils.data.TensorDataset(X[64:], Y[64:])
train_loader = torch.utils.data.DataLoader(data_train, batch_size=8, shuffle=True)
valid_loader = torch.utils.data.DataLoader(data_valid, batch_size=8, shuffle=False)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
criterion = nn.CrossEntropyLoss()
n_batches = len(train_loader)  # bound in another cell than the loop's: each rank's own count once sharded"""

TRAIN = """history, examples_seen = [], 0
for epoch in range(2):
    summed = torch.zeros(())
    trn_loss, running, per_batch, correct, seen, batches, step = 0.0, 0.0, 0.0, 0, 0, 0, 0
    stats = {"loss": 0.0, "batch_loss": 0.0}  # sums kept in a dict's items
    model.train()
    for i, (inputs, labels) in enumerate(train_loader):
        optimizer.zero_grad()
        out = model(inputs)
        loss = criterion(out, labels)
        loss.backward(); optimizer.step()
        trn_loss += loss.item() * inputs.size(0)
        running += loss.item()
        correct += (out.argmax(1) == labels).sum().item()
        seen += labels.size(0)
        examples_seen += labels.size(0)  # across epochs, never reset
        summed += loss.detach() * inputs.size(0)  # a tensor, added to in place
        per_batch += loss.item()
        stats["loss"] += loss.item() * inputs.size(0)
        stats["batch_loss"] += loss.item()
        batches += 1
        step += 1
    val_loss = 0.0
    with torch.no_grad():
        for inputs, labels in valid_loader:
            val_loss += criterion(model(inputs), labels).item() * inputs.size(0)
    history.append({"trn_loss": trn_loss / len(data_train), "by_batches": running / len(train_loader),
                    "by_index": running / (i + 1), "accuracy": correct / seen, "seen": seen, "step": step,
                    "batches": batches, "val_loss": val_loss / len(data_valid),
                    "examples_seen": examples_seen, "summed": summed.item() / len(data_train),
                    "by_bound_count": per_batch / n_batches, "item_loss": stats["loss"] / len(data_train),
                    "item_by_batches": stats["batch_loss"] / len(train_loader)})
    print(history[-1])
json.dump(history, open("history.json", "w"))"""


def test_a_training_loops_sums_are_summed_over_the_ranks_and_those_divided_by_its_own_counts_averaged():
    script = convert_cells([Cell(1, SETUP), Cell(2, TRAIN)], origin="nb.ipynb")
    lines = script.text.splitlines()
    after = lines.index(next(ln for ln in lines if "trn_loss = _nbddp.over_ranks(trn_loss, since=_nbddp_trn_loss)" in ln))
    assert lines[after - 1].strip() == "step += 1"  # right after the loop over train_loader, inside the epoch loop
    assert "running = _nbddp.over_ranks(running, since=_nbddp_running, mean=True)" in lines[after + 1]
    assert [ln.strip() for ln in lines[after + 2:after + 5]] == [
        "correct = _nbddp.over_ranks(correct, since=_nbddp_correct)", "seen = _nbddp.over_ranks(seen, since=_nbddp_seen)",
        "examples_seen = _nbddp.over_ranks(examples_seen, since=_nbddp_examples_seen)"]
    loop = lines.index(next(ln for ln in lines if "for i, (inputs, labels) in enumerate(train_loader):" in ln))
    assert lines[loop - 9].strip() == "_nbddp_trn_loss = _nbddp.before_loop(trn_loss)"  # where each sum starts
    assert lines[loop - 10].strip() == "model.train()"
    assert lines[loop - 2].strip() == "_nbddp_stats_loss = _nbddp.before_loop(stats['loss'])"  # as Python spells it
    assert "stats['loss'] = _nbddp.over_ranks(stats['loss'], since=_nbddp_stats_loss)\n" in script.text
    assert "stats['batch_loss'] = _nbddp.over_ranks(stats['batch_loss'], since=_nbddp_stats_batch_loss, mean=True)" \
        in script.text
    assert "over_ranks(step" not in script.text and "over_ranks(batches" not in script.text  # counts of one's own
    assert "over_ranks(val_loss" not in script.text  # the validation loader is whole on every rank
    assert any(c.rule == "loop_sums" and "adds to trn_loss, correct, seen, examples_seen, summed, stats['loss'] is summed over the ranks" in c.message
               and "adds to running, per_batch, stats['batch_loss'] is averaged" in c.message for c in script.changes)
    assert "per_batch = _nbddp.over_ranks(per_batch, since=_nbddp_per_batch, mean=True)" in script.text


@pytest.mark.parametrize("loop", [
    "for x, y in train_loader:\n    total = 0\n    total += y.sum().item()",  # set in the loop: a batch's own
    "with torch.no_grad():\n    for x, y in valid_loader:\n        total += y.sum().item()",  # a whole loader
])
def test_a_name_the_loop_sets_or_a_loop_over_a_whole_loader_is_left(loop):
    script = convert_cells([Cell(1, SETUP), Cell(2, TRAIN), Cell(3, "total = 0\n" + loop)], origin="nb.ipynb")
    assert "over_ranks(total" not in script.text and "over_ranks(trn_loss" in script.text


#: How a Kaggle kernel uses its two GPUs: DataParallel splits each batch over them. nbddp's ranks take a part of
#: each batch instead (``data_parallel_batch``), so a batch's loss is each rank's part's, and its counts too.
DATA_PARALLEL = "model = nn.DataParallel(model)"


@pytest.mark.e2e
@pytest.mark.parametrize("cells, steps", [((SETUP, TRAIN), 4), ((SETUP, DATA_PARALLEL, TRAIN), 8)],
                         ids=["sharded", "data-parallel"])
def test_two_ranks_print_and_write_the_epoch_losses_one_process_does(tmp_path, monkeypatch, cells, steps):
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    subprocess.run([sys.executable, "-c", "\n".join(cells)], cwd=one, check=True, capture_output=True, timeout=120)
    notebook = write_notebook(two / "train.ipynb", list(cells))
    monkeypatch.chdir(two)
    result = run_job(notebook, RunOptions(nproc=2, runs_dir=tmp_path / "runs"), QuietView()).run
    assert result.ok, result.failure
    want, got = (json.loads((d / "history.json").read_text()) for d in (one, two))
    for epoch_want, epoch_got in zip(want, got, strict=True):
        for key in ("trn_loss", "by_batches", "by_index", "accuracy", "val_loss", "summed", "by_bound_count",
                    "item_loss", "item_by_batches"):
            assert epoch_got[key] == pytest.approx(epoch_want[key], rel=1e-6), key  # half of it before
        assert (epoch_got["seen"], epoch_want["seen"]) == (64, 64)
        assert epoch_got["examples_seen"] == epoch_want["examples_seen"]  # 64, then 128: not counted again
        # each rank's own count of its batches: half of them, or with DataParallel a part of each of them
        assert (epoch_got["step"], epoch_want["step"]) == (steps, 8)


def test_a_loop_over_batch_positions_shared_out_has_its_sums_summed_too():
    loop = ("for epoch in range(2):\n    total = 0.0\n    for i in range(0, len(X), 8):\n"
            "        loss = criterion(model(X[i:i + 8]), Y[i:i + 8])\n        loss.backward(); optimizer.step()\n"
            "        total += loss.item() * 8\n    print(total / len(X))")
    setup = SETUP.split("\ntrain_loader")[0] + ("\nmodel = nn.Linear(8, 2)\ncriterion = nn.CrossEntropyLoss()\n"
                                                 "optimizer = torch.optim.SGD(model.parameters(), lr=0.0)")
    text = convert_cells([Cell(1, setup), Cell(2, loop)], origin="nb.ipynb").text
    assert "DataLoader" not in text  # no loader at all: the loop's own positions are what is shared out
    assert "_nbddp.shard_range(range(0, len(X), 8))" in text
    assert "    total = _nbddp.over_ranks(total, since=_nbddp_total)\n" in text


@pytest.mark.parametrize("count, averaged", [
    ("n = len(train_loader)", True),
    ("n = len(train_loader)\nn = len(data_train)", False),  # bound to something else too: what it counts is unknown
    ("n = len(valid_loader)", False),  # a whole loader's length: every rank's is the whole set's
    ("n = len(train_loader)\nfor n in range(3):\n    pass", False),
])
def test_a_sum_divided_by_a_name_bound_to_the_sharded_loaders_length_is_averaged(count, averaged):
    loop = ("for epoch in range(2):\n    total = 0.0\n    for x, y in train_loader:\n"
            "        loss = criterion(model(x), y)\n        loss.backward(); optimizer.step()\n"
            "        total += loss.item()\n    print(total / n)")
    text = convert_cells([Cell(1, SETUP), Cell(2, count), Cell(3, loop)], origin="nb.ipynb").text
    assert ("total = _nbddp.over_ranks(total, since=_nbddp_total, mean=True)" in text) is averaged
    assert "total = _nbddp.over_ranks(total, since=_nbddp_total" in text


METER = '''class AverageMeter(object):
    """Computes and stores the average and current value"""
    def __init__(self):
        self.reset()
    def reset(self):
        self.val = 0
        self.avg = 0
        self.sum = 0
        self.count = 0
    def update(self, val, n=1):
        self.val = val
        self.sum += val * n
        self.count += n
        self.avg = self.sum / self.count'''

#: The shape of a Kaggle training notebook's ``train_fn`` (the ImageNet example's meter, created in the function).
TRAIN_FN = '''def train_fn(train_loader, model, criterion, optimizer, epoch):
    model.train()
    losses = AverageMeter()
    for step, (x, y) in enumerate(train_loader):
        loss = criterion(model(x), y)
        losses.update(loss.item(), x.size(0))
        optimizer.zero_grad(); loss.backward(); optimizer.step()
    return losses.avg

history = []
for epoch in range(2):
    avg_loss = train_fn(train_loader, model, criterion, optimizer, epoch)
    history.append(avg_loss)
    print(f"epoch {epoch} loss {avg_loss:.4f}")
json.dump(history, open("history.json", "w"))'''


def test_an_average_meters_sums_are_summed_over_the_ranks_and_its_average_derived_again():
    script = convert_cells([Cell(1, SETUP), Cell(2, METER), Cell(3, TRAIN_FN)], origin="nb.ipynb")
    assert "    _nbddp_losses = _nbddp.before_meter(losses, ('sum', 'count'))\n    for step" in script.text
    assert "        optimizer.zero_grad(); loss.backward(); optimizer.step()\n" \
           "    _nbddp.meter_over_ranks(losses, _nbddp_losses, (('avg', 'sum', 'count'),))\n    return losses.avg" \
           in script.text
    # a meter the loop resets, or one a whole loader's loop updates: left as it is
    for loop in ("for x, y in train_loader:\n    meter.reset()\n    meter.update(1.0)",
                 "for x, y in valid_loader:\n    meter.update(criterion(model(x), y).item())"):
        text = convert_cells([Cell(1, SETUP), Cell(2, METER), Cell(3, TRAIN_FN),
                              Cell(4, "meter = AverageMeter()\n" + loop)], origin="nb.ipynb").text
        assert "before_meter(meter" not in text and "before_meter(losses" in text


def test_an_imported_average_meter_is_taken_to_have_the_usual_shape_and_one_the_notebook_defines_otherwise_is_not():
    imported = "from utils import AverageMeter"  # a Kaggle utility script's, or timm.utils'
    text = convert_cells([Cell(1, SETUP), Cell(2, imported), Cell(3, TRAIN_FN)], origin="nb.ipynb").text
    assert "_nbddp.meter_over_ranks(losses, _nbddp_losses, (('avg', 'sum', 'count'),))" in text
    windowed = ("class AverageMeter:\n    def __init__(self):\n        self.values = []\n"
                "    def update(self, val, n=1):\n        self.values = (self.values + [val])[-10:]\n"
                "        self.avg = sum(self.values) / len(self.values)")
    text = convert_cells([Cell(1, SETUP), Cell(2, windowed), Cell(3, TRAIN_FN)], origin="nb.ipynb").text
    assert "before_meter" not in text


@pytest.mark.e2e
def test_two_ranks_return_the_epoch_averages_one_process_does_from_average_meters(tmp_path, monkeypatch):
    """Two meters in one job: an ``AverageMeter`` imported from a utility script beside the notebook, as Kaggle
    notebooks import their helpers (``from utils import AverageMeter``), and a class of the notebook's own. Before,
    each rank returned its share's averages: rank 0's were printed and kept as the epoch's."""
    one, two = tmp_path / "one", tmp_path / "two"
    own = METER.replace("class AverageMeter(object):", "class Meter(object):")
    train = TRAIN_FN.replace("    losses = AverageMeter()\n", "    losses = AverageMeter()\n    positives = Meter()\n") \
        .replace("        losses.update(loss.item(), x.size(0))\n",
                 "        losses.update(loss.item(), x.size(0))\n        positives.update(y.float().mean().item(), x.size(0))\n") \
        .replace("    return losses.avg", "    return losses.avg, positives.avg").replace(":.4f}", "}")
    code = [SETUP, "from utils import AverageMeter", own, train]
    for folder in (one, two):
        folder.mkdir()
        (folder / "utils.py").write_text(METER + "\n")
    subprocess.run([sys.executable, "-c", "\n".join(code)], cwd=one, check=True, capture_output=True, timeout=120)
    notebook = write_notebook(two / "train.ipynb", code)
    monkeypatch.chdir(two)
    result = run_job(notebook, RunOptions(nproc=2, runs_dir=tmp_path / "runs"), QuietView()).run
    assert result.ok, result.failure
    want, got = (json.loads((d / "history.json").read_text()) for d in (one, two))
    assert [x for epoch in got for x in epoch] == pytest.approx([x for epoch in want for x in epoch], rel=1e-6)


@pytest.mark.parametrize("loop, summed", [
    ("for x, y in train_loader:\n    d['n'] += y.sum().item()", True),
    ("for x, y in train_loader:\n    d['n'] = 0\n    d['n'] += y.sum().item()", False),  # set in the loop: a batch's own
    ("for x, y in train_loader:\n    d.clear()\n    d['n'] += y.sum().item()", False),  # emptied in the loop
    ("for x, y in train_loader:\n    d[k] += y.sum().item()", False),  # a key not written out
])
def test_a_dicts_item_the_loop_adds_to_is_summed_unless_the_loop_changes_the_dict_otherwise(loop, summed):
    cells = [Cell(1, SETUP), Cell(2, TRAIN), Cell(3, "d, k = {'n': 0}, 'n'\n" + loop)]
    text = convert_cells(cells, origin="nb.ipynb").text
    assert ("d['n'] = _nbddp.over_ranks(d['n'], since=_nbddp_d_n)" in text) is summed
    assert "over_ranks(d[k]" not in text
