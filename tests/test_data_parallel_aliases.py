"""A notebook's ``nn.DataParallel`` under whatever name the notebook binds it to (an alias assignment, an import's
``as``, a module alias) becomes ``_nbddp.data_parallel``; a name bound to something else is left alone."""

import pytest

from conftest import rewrite_cells

LOOP = "opt = SGD(model.parameters())\nfor x, y in loader:\n    crit(model(x), y).backward()\n    opt.step()\n"


@pytest.fixture(params=["checks", "every statement"])
def rewrite(request):
    """``rewrite_cells`` both ways: the new sources and the data_parallel rule's ``(cell position, line, message)``
    changes."""

    def run(*cells):
        out, changes = rewrite_cells(cells, every_statement=request.param != "checks")
        return out, [(position, line, message) for position, rule, line, message in changes if rule == "data_parallel"]

    return run


@pytest.mark.parametrize("binding, call", [
    ("DP = nn.DataParallel", "DP(model, device_ids=[0, 1])"),
    ("from torch.nn import DataParallel as DP", "DP(model, device_ids=[0, 1])"),
    ("from torch.nn.parallel import DataParallel", "DataParallel(model, device_ids=[0, 1])"),
    ("import torch.nn as tnn", "tnn.DataParallel(model, device_ids=[0, 1])"),
    ("import torch.nn.parallel as par", "par.DataParallel(model, device_ids=[0, 1])"),
    ("from torch import nn as tnn", "tnn.parallel.DataParallel(model, device_ids=[0, 1])"),
    ("import torch", "torch.nn.parallel.DataParallel(model, device_ids=[0, 1])"),
])
def test_data_parallel_under_the_name_the_notebook_binds_becomes_ddp(rewrite, binding, call):
    cells, said = rewrite(f"import torch\nfrom torch import nn\n{binding}\nloader = DataLoader(ds, shuffle=True)\n",
                          f"model = Net()\nmodel = {call}\n" + LOOP)
    assert "model = _nbddp.data_parallel(model, device_ids=[0, 1])\n" in cells[1]
    spelled = call.partition("(")[0]
    assert said == [(1, 2, f"{spelled}(…) → DistributedDataParallel over the ranks, one GPU each (DataParallel "
                           "would split each batch over the GPUs both ranks use); .module and the state dict's "
                           "module. keys stay")]


def test_an_alias_bound_earlier_in_the_same_cell_or_in_a_block_counts(rewrite):
    cells, said = rewrite("loader = DataLoader(ds, shuffle=True)\nmodel = Net()\n",
                          "if torch.cuda.device_count() > 1:\n    DP = torch.nn.DataParallel\n    model = DP(model)\n"
                          + LOOP)
    assert "    model = _nbddp.data_parallel(model)\n" in cells[1] and [line for _, line, _ in said] == [3]


def test_a_name_rebound_to_something_else_is_left_alone(rewrite):
    cells, said = rewrite(
        "from torch.nn import DataParallel as DP\nimport mylib as tnn\nloader = DataLoader(ds, shuffle=True)\n",
        "model = Net()\nmodel = DP(model)\n" + LOOP,
        "DP = make_pipeline\nreport = DP(model)\nother = tnn.DataParallel(model)\n")
    assert "model = _nbddp.data_parallel(model)\n" in cells[1]
    assert "    report = DP(model)\n    other = tnn.DataParallel(model)\n" in cells[2]  # rank 0's, after training
    assert [(cell, line) for cell, line, _ in said] == [(1, 2)]


def test_another_librarys_data_parallel_and_isinstance_checks_stay(rewrite):
    src = ("from torch_geometric.nn import DataParallel\nDP = nn.DataParallel\nmodel = DataParallel(model)\n"
           "inner = model.module if isinstance(model, DP) else model\n")
    (code,), said = rewrite(src)
    assert code == src and not said
