"""In a notebook that calls ``nn.DataParallel``, a training loader's ``batch_size`` is the step DataParallel split
over the kernel's GPUs: each rank takes its part (``_nbddp.data_parallel_batch``), so a step holds the kernel's
samples and the loss follows the kernel's curve; ``torch.cuda.device_count()`` stays torch's there (the batch a
notebook sized with it is the kernel's step too). Notebooks without DataParallel keep the batch per rank."""

import importlib

import pytest

from conftest import rewrite_cells

runtime = importlib.import_module("nbddp.runtime.data_parallel")  # the module: the package's name is its function

LOOP = ("model = Net()\n{wrap}\nopt = SGD(model.parameters(), lr=0.1)\n"
        "for x, y in train_loader:\n    crit(model(x), y).backward()\n    opt.step()\n")
IMPORTS = "import torch\nfrom torch import nn\nfrom torch.utils.data import DataLoader\n"


@pytest.fixture(params=["checks", "every statement"])
def rewrite(request):
    def run(*cells):
        return rewrite_cells(cells, every_statement=request.param != "checks")
    return run


@pytest.mark.parametrize("loader, expected", [
    ("DataLoader(ds, batch_size=64, shuffle=True)", "batch_size=_nbddp.data_parallel_batch(64)"),
    ("DataLoader(ds, 64, shuffle=True)", "DataLoader(ds, _nbddp.data_parallel_batch(64), sampler="),
    ("DataLoader(ds, batch_size=bs, sampler=RandomSampler(ds))", "batch_size=_nbddp.data_parallel_batch(bs)"),
])
def test_a_training_loaders_batch_is_shared_out_where_the_notebook_calls_data_parallel(rewrite, loader, expected):
    cells, changes = rewrite(IMPORTS + f"train_loader = {loader}\n",  # the loader above the DataParallel call
                             LOOP.format(wrap="if torch.cuda.device_count() > 1:\n    model = nn.DataParallel(model)"))
    assert expected in cells[0]
    assert any(rule == "sampler" and "the step DataParallel split over the GPUs" in message
               for _, rule, _, message in changes)


def test_device_count_stays_torchs_where_the_notebook_calls_data_parallel(rewrite):
    cells, _ = rewrite(IMPORTS + "bs = 32 * torch.cuda.device_count()\n"
                       "train_loader = DataLoader(ds, batch_size=bs, shuffle=True)\n",
                       LOOP.format(wrap="model = nn.DataParallel(model)"))
    assert "bs = 32 * torch.cuda.device_count()" in cells[0]  # 64 on the kernel's two GPUs: the step it took
    assert "batch_size=_nbddp.data_parallel_batch(bs)" in cells[0]


@pytest.mark.parametrize("wrap", ["model = model.to('cuda')",  # no DataParallel: the batch is each rank's
                                  "from torch_geometric.nn import DataParallel\nmodel = DataParallel(model)"])
def test_without_torchs_data_parallel_the_batch_and_device_count_are_each_ranks(rewrite, wrap):
    cells, _ = rewrite(IMPORTS + "bs = 32 * torch.cuda.device_count()\n"
                       "train_loader = DataLoader(ds, batch_size=bs, shuffle=True)\n", LOOP.format(wrap=wrap))
    assert "data_parallel_batch" not in cells[0]
    assert "bs = 32 * _nbddp.device_count()" in cells[0]


def test_an_evaluation_loader_and_a_loader_without_a_batch_size_are_left_alone(rewrite):
    cells, _ = rewrite(IMPORTS + "train_loader = DataLoader(ds, shuffle=True)\n"
                       "test_loader = DataLoader(test_ds, batch_size=50)\n",
                       LOOP.format(wrap="model = nn.DataParallel(model)"))
    assert "data_parallel_batch" not in cells[0]
    assert "test_loader = DataLoader(test_ds, batch_size=50)" in cells[0]


@pytest.mark.parametrize("world, size, part", [(1, 50, 50), (2, 50, 25), (2, 33, 17), (4, 64, 16), (2, 1, 1),
                                               (2, "auto", "auto"), (2, None, None)])
def test_each_rank_takes_its_part_of_the_step(monkeypatch, capsys, world, size, part):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(runtime, "_said_uneven", set())
    assert runtime.data_parallel_batch(size) == part
    said = capsys.readouterr().out
    assert ("does not divide" in said) == (world > 1 and size in (33, 1)), said


def test_a_helpers_training_loader_takes_its_part_of_the_step_where_the_notebook_calls_data_parallel(rewrite):
    cells, changes = rewrite("from helpers import create_dataloader\nimport torch\nfrom torch import nn\n"
                             "train_loader = create_dataloader(ds, batch_size=8)\n",
                             LOOP.format(wrap="model = nn.DataParallel(model)"))
    assert ("train_loader = _nbddp.shard_loader(create_dataloader(ds, batch_size=8), name='train_loader', "
            "data_parallel=True)") in cells[0]
    assert any("its batch is the step DataParallel split" in message for _, _, _, message in changes)


@pytest.mark.parametrize("data_parallel, batch", [(True, 4), (False, 8)])
def test_a_helpers_loader_rebuilt_over_the_rank_share_keeps_or_shares_out_its_batch(monkeypatch, data_parallel, batch):
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from nbddp.runtime.loaders import shard_loader

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    loader = DataLoader(TensorDataset(torch.arange(32)), batch_size=8, shuffle=True, drop_last=True)
    mine = shard_loader(loader, name="train_loader", data_parallel=data_parallel)
    assert mine.batch_size == batch and mine.drop_last
    assert len(mine.sampler) == 16 and len(mine) == 16 // batch


@pytest.mark.parametrize("wrap, said", [("model = nn.DataParallel(model)", True), ("model = model.to('cuda')", False)])
def test_an_index_slice_loop_in_a_data_parallel_notebook_says_its_step_is_the_kernels_times_the_ranks(
        rewrite, wrap, said):
    """A loop that slices its own batches (``X[i:i+bs]``) keeps each window whole on each rank: nbddp cannot
    share the rows out as it does a loader's batch, so it says the step is not the kernel's and how to make it."""
    cells, changes = rewrite(IMPORTS + "model = Net()\n" + wrap + "\nopt = SGD(model.parameters(), lr=0.1)\n"
                             "for epoch in range(3):\n"
                             "    for i in range(0, len(X), bs):\n"
                             "        crit(model(X[i:i + bs]), y[i:i + bs]).backward()\n"
                             "        opt.step()\n")
    assert "_nbddp.shard_range(range(0, len(X), bs))" in cells[0]
    notes = [message for _, rule, _, message in changes if rule == "shard_loop"]
    assert len(notes) == 1
    assert ("divide the loop's batch size by the number of GPUs" in notes[0]) is said
