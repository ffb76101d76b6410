"""A plain loop that trains on a whole tensor at every step (``for epoch in range(n): model(X_train)``) is refused
before launch, at its cell and line: every rank would train on the same rows, two GPUs doing one GPU's work. Loops
whose steps do get different rows (batches, sampled indices, a helper's training, a loader's batch) are left."""

import textwrap

import pytest

from nbddp.cells import Cell
from nbddp.convert import convert_cells
from nbddp.convert.code import CellCode, CodeError
from nbddp.convert.engine.plan import plan_cell
from nbddp.convert.engine.rewrite import rewrite
from nbddp.convert.facts import gather_facts
from nbddp.convert.rules import RULES
from nbddp.convert.rules.full_batch import FullBatchRule
from nbddp.errors import CellError

DATA = ("import torch\nfrom torch import nn\nfrom sklearn.model_selection import train_test_split\n"
        "X_train, X_test, y_train, y_test = train_test_split(X, y)\n"
        "X_train = torch.tensor(X_train, dtype=torch.float32)\ny_train = torch.tensor(y_train)\n")
MODEL = "model = nn.Linear(4, 2)\ncrit = nn.CrossEntropyLoss()\nopt = torch.optim.Adam(model.parameters(), lr=1e-3)\n"
FULL_BATCH = """\
losses = []
for epoch in range(n_epochs):
    model.train()
    out = model(X_train); loss = crit(out, y_train)
    opt.zero_grad(); loss.backward(); opt.step()
    losses.append(loss.item())
"""


def convert(*sources):
    return convert_cells([Cell(index=i + 1, source=textwrap.dedent(s)) for i, s in enumerate(sources)])


def test_a_full_batch_loop_is_refused_at_its_cell_and_line_with_the_fix():
    with pytest.raises(CellError) as refused:
        convert(DATA, MODEL, FULL_BATCH)
    error = refused.value
    assert (error.cell, error.line) == (3, 2) and error.source == "for epoch in range(n_epochs):"
    said = str(error)
    assert "\n" not in said.partition("\n    ")[0]  # one line, then the source line
    assert "trains on all of X_train at every step on every rank, so two GPUs would do one GPU's work" in said
    assert "TensorDataset(X_train, y_train)" in said and "X_train[i:i+bs]" in said
    assert "range(0, len(X_train), bs)" in said and "in the notebook's kernel" in said


@pytest.mark.parametrize("loop", [
    "for epoch in tqdm(range(100), desc='epochs'):\n    loss = crit(model(X_train.to(device)), y_train)\n",
    "for epoch in range(100):\n    with torch.autocast('cpu'):\n"
    "        loss = ((model(X_train) - y_train) ** 2).mean()\n",
])
def test_a_full_batch_loop_in_a_progress_bar_or_a_block_is_refused_too(loop):
    with pytest.raises(CellError, match="trains on all of X_train") as refused:
        convert(DATA, MODEL, "device = 'cpu'\n" + loop + "    opt.zero_grad()\n    loss.backward()\n    opt.step()\n")
    assert refused.value.line == 2


def test_a_graphs_whole_node_features_are_refused_by_their_attribute():
    # a PyG node classifier: every step trains on the whole graph
    src = ("data = dataset[0]\nfor epoch in range(200):\n    out = model(data.x, data.edge_index)\n"
           "    loss = F.nll_loss(out[data.train_mask], data.y[data.train_mask])\n"
           "    loss.backward()\n    opt.step()\n")
    with pytest.raises(CellError, match=r"trains on all of data\.x at every step") as refused:
        convert(DATA, MODEL, src)
    said = str(refused.value)
    # a graph's edges are no rows to batch beside its nodes: no TensorDataset(data.x, data.edge_index) offered
    assert "TensorDataset" not in said and "data.x[i:i+bs]" not in said
    assert "graph" in said and "in the notebook's kernel" in said


def test_a_model_of_two_inputs_is_offered_a_dataset_of_both_and_the_target():
    src = ("x_num, x_cat = X_train[:, :2], X_train[:, 2:].long()\nfor epoch in range(50):\n"
           "    loss = crit(model(x_num, x_cat), y_train)\n    loss.backward(); opt.step()\n")
    with pytest.raises(CellError, match=r"TensorDataset\(x_num, x_cat, y_train\)"):
        convert(DATA, MODEL, src)


def test_where_it_is_refused_is_recorded_in_the_facts():
    codes = [CellCode.read(textwrap.dedent(s), position=i) for i, s in enumerate([DATA, MODEL, FULL_BATCH])]
    facts = gather_facts(codes)
    with pytest.raises(CodeError) as refused:
        for code in codes:
            plan = plan_cell(code, facts, RULES)
            if plan is not None:
                rewrite(code, plan, facts)
    assert refused.value.line == 2
    assert facts.full_batch_loops == [(2, 2, ["X_train", "y_train"])]


LEFT_ALONE = {
    "a helper that trains": (
        "def train_step(model, X, y):\n    loss = crit(model(X), y)\n    opt.zero_grad(); loss.backward(); opt.step()\n"
        "for epoch in range(10):\n    train_step(model, X_train, y_train)\n"),
    "indices sampled each step": (
        "for step in range(1000):\n    idx = torch.randint(0, len(X_train), (64,))\n"
        "    loss = crit(model(X_train[idx]), y_train[idx])\n    loss.backward(); opt.step()\n"),
    "a permutation's windows": (
        "for epoch in range(10):\n    perm = torch.randperm(len(X_train))\n    for i in range(0, len(X_train), 32):\n"
        "        xb = X_train[perm[i:i+32]]\n        loss = crit(model(xb), y_train[perm[i:i+32]])\n"
        "        loss.backward(); opt.step()\n"),
    "one batch of a loader, overfitted": (
        "train_loader = DataLoader(ds, batch_size=8, shuffle=True)\nxb, yb = next(iter(train_loader))\n"
        "for step in range(100):\n    loss = crit(model(xb), yb)\n    loss.backward(); opt.step()\n"),
    "steps on each batch of a loader": (
        "for xb, yb in DataLoader(ds, batch_size=8, shuffle=True):\n    for _ in range(3):\n"
        "        loss = crit(model(xb), yb)\n        loss.backward(); opt.step()\n"),
    "a function training on what it is given": (
        "def fit(model, X, y, epochs):\n    for epoch in range(epochs):\n        loss = crit(model(X), y)\n"
        "        loss.backward(); opt.step()\n"
        "for xb, yb in DataLoader(ds, batch_size=8, shuffle=True):\n    fit(model, xb, yb, 1)\n"),
    "noise drawn each step": (
        "for step in range(100):\n    z = torch.randn(16, 4)\n    loss = model(z).pow(2).mean()\n"
        "    loss.backward(); opt.step()\n"),
    "a sampler object drawing the batch each step": (
        "sampler = Sampler(X_train, y_train, bs=64)\nfor step in range(1000):\n    sampler.next()\n"
        "    loss = crit(model(sampler.xb), sampler.yb)\n    loss.backward(); opt.step()\n"),
    "an object a helper refills each step": (
        "buf = Buffer()\nfor step in range(1000):\n    refill(buf, X_train, y_train)\n"
        "    loss = crit(model(buf.x), buf.y)\n    loss.backward(); opt.step()\n"),
    "an attribute set each step": (
        "batch = Batch()\nfor step in range(1000):\n    idx = torch.randint(0, len(X_train), (64,))\n"
        "    batch.x, batch.y = X_train[idx], y_train[idx]\n"
        "    loss = crit(model(batch.x), batch.y)\n    loss.backward(); opt.step()\n"),
}


@pytest.mark.parametrize("src", LEFT_ALONE.values(), ids=LEFT_ALONE)
def test_a_loop_whose_steps_get_other_rows_is_not_refused(src):
    convert(DATA, MODEL, "from torch.utils.data import DataLoader\n" + src)


def test_the_loop_rules_look_further_only_where_a_for_and_a_backward_are():
    # two searches, linear in the text (one pattern for…backward( scanned to the text's end from each for: 7 s for
    # a cell of 6,000 comprehensions), the same test for both loop rules
    from nbddp.convert.rules.shard_loop import ShardLoopRule

    comprehensions = "".join(f"y{i} = [a for a in range({i})]\n" for i in range(50))
    for rule in (FullBatchRule, ShardLoopRule):
        assert not rule.could_change(comprehensions, None)
        assert not rule.could_change("loss.backward()\n", None)
        assert rule.could_change(comprehensions + "loss.backward()\n", None)
        assert rule.could_change("for x in X:\n    model(x).sum().backward()\n", None)

