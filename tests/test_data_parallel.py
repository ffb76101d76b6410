"""A Kaggle 2×T4 notebook's ``nn.DataParallel`` on two gloo ranks: the converted script has no DataParallel
around (or under) nbddp's DDP, each rank trains its own rows, the replicas agree, and the notebook's own
``model.module`` and ``module.``-prefixed save work after training as in its kernel. And Kaggle's other way to its
second T4, Accelerate's ``notebook_launcher`` over a helper's loader: each rank trains its half, sharded once."""

import json

import pytest

from conftest import write_notebook
from nbddp.job import run_job
from nbddp.options import RunOptions
from views import Said

pytestmark = pytest.mark.e2e

NOTEBOOK = [
    "import json, os\nimport torch\nfrom torch import nn\nfrom torch.utils.data import DataLoader, TensorDataset\n"
    "torch.cuda.device_count = lambda: 2  # the kernel's two T4s, counted on a machine without them",
    "torch.manual_seed(0)\nx = torch.randn(64, 4)\ny = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])\n"
    "data = TensorDataset(torch.arange(64), x, y)\n"
    "train_loader = DataLoader(data, batch_size=4 * torch.cuda.device_count(), shuffle=True)",
    "class Net(nn.Module):\n    def __init__(self):\n        super().__init__()\n        self.fc = nn.Linear(4, 1)\n"
    "    def forward(self, x):\n        return self.fc(x)\n"
    "device = torch.device('cuda' if torch.cuda.is_available() else 'cpu')\n"
    "n_gpus = torch.cuda.device_count()\n"
    "model = Net()\nmodel = nn.DataParallel(model, device_ids=list(range(n_gpus)))\nmodel.to(device)\n"
    "optimizer = torch.optim.SGD(model.parameters(), lr=0.05)",
    "seen = []\nfor epoch in range(2):\n    for ib, xb, yb in train_loader:\n        if epoch == 0:\n"
    "            seen.append(ib.tolist())\n        loss = ((model(xb.to(device)) - yb.to(device)) ** 2).mean()\n"
    "        optimizer.zero_grad()\n        loss.backward()\n        optimizer.step()\n"
    "    if epoch == 1:\n        with open(f\"seen-{os.environ['RANK']}.json\", 'w') as fh:\n            json.dump(seen, fh)\n"
    "        with open(f\"weights-{os.environ['RANK']}.json\", 'w') as fh:\n"
    "            json.dump({k: v.tolist() for k, v in model.module.named_parameters()}, fh)",
    "torch.save(model.state_dict(), 'dp.pt')\nplain = Net()\nplain.load_state_dict(model.module.state_dict())\n"
    "print('saved keys', sorted(torch.load('dp.pt')))",
]


def test_data_parallel_trains_as_ddp_on_disjoint_rows(tmp_path):
    text = _trains_as_ddp_on_disjoint_rows(tmp_path, NOTEBOOK)
    assert "nn.DataParallel(" not in text and "_nbddp.data_parallel(model, device_ids=" in text


#: The same notebook with DataParallel under a name of its own, bound in an earlier cell (``DP = nn.DataParallel``).
ALIASED = [NOTEBOOK[0] + "\nDP = nn.DataParallel", NOTEBOOK[1],
           NOTEBOOK[2].replace("nn.DataParallel(model,", "DP(model,"), *NOTEBOOK[3:]]


def test_data_parallel_under_an_alias_trains_as_ddp_on_disjoint_rows(tmp_path):
    assert "model = DP(model, device_ids=" in ALIASED[2]
    text = _trains_as_ddp_on_disjoint_rows(tmp_path, ALIASED)
    assert "DP(model" not in text and "_nbddp.data_parallel(model, device_ids=" in text


#: The same notebook with a fixed ``batch_size=8``: the step DataParallel split over the kernel's two GPUs, 4 each.
FIXED_BATCH = [NOTEBOOK[0], NOTEBOOK[1].replace("batch_size=4 * torch.cuda.device_count()", "batch_size=8"),
               *NOTEBOOK[2:]]


def test_a_fixed_batch_is_the_kernels_step_each_rank_takes_its_part(tmp_path):
    assert "batch_size=8," in FIXED_BATCH[1]
    text = _trains_as_ddp_on_disjoint_rows(tmp_path, FIXED_BATCH)
    assert "batch_size=_nbddp.data_parallel_batch(8)" in text


def _trains_as_ddp_on_disjoint_rows(tmp_path, cells) -> str:
    """Run the notebook on two gloo ranks; check each trained its own rows into one model; the script's code."""
    chunks = []
    job = run_job(write_notebook(tmp_path / "dp.ipynb", cells),
                  RunOptions(nproc=2, runs_dir=tmp_path / "runs", timeout_s=300), Said(chunks))
    out = "".join(chunks)
    text = "\n".join(line for line in job.script.text.splitlines() if not line.lstrip().startswith("#"))
    assert job.run.ok, out[-3000:]
    batches = [json.loads((tmp_path / f"seen-{rank}.json").read_text()) for rank in (0, 1)]
    # the kernel's step was 4 * 2 GPUs = 8 rows, which DataParallel split 4 a GPU: each rank takes 4, not 8
    assert [len(batch) for batch in batches[0] + batches[1]] == [4] * 16
    seen = [sum(batches[rank], []) for rank in (0, 1)]
    assert len(seen[0]) == len(seen[1]) == 32 and set(seen[0]).isdisjoint(seen[1])
    assert set(seen[0]) | set(seen[1]) == set(range(64))
    weights = [json.loads((tmp_path / f"weights-{rank}.json").read_text()) for rank in (0, 1)]
    assert weights[0] == weights[1]  # averaged gradients: one model
    assert "saved keys ['module.fc.bias', 'module.fc.weight']" in out  # DataParallel's keys, as in the kernel
    return text


ACCELERATE_HELPER = [
    "import json, os\nimport torch\nfrom torch import nn\nfrom torch.utils.data import DataLoader, TensorDataset\n"
    "from accelerate import Accelerator, notebook_launcher",
    "torch.manual_seed(0)\nx = torch.randn(80, 4)\ny = x.sum(1, keepdim=True)\ndata = TensorDataset(torch.arange(80), x, y)",
    "def make_loader(ds, bs, shuffle):\n    return DataLoader(ds, batch_size=bs, shuffle=shuffle)",
    "def train_fn(lr):\n    accelerator = Accelerator(cpu=True)\n    train_dl = make_loader(data, 8, True)\n"
    "    model = nn.Linear(4, 1)\n    optimizer = torch.optim.SGD(model.parameters(), lr=lr)\n"
    "    model, optimizer, train_dl = accelerator.prepare(model, optimizer, train_dl)\n    seen = []\n"
    "    for ib, xb, yb in train_dl:\n        seen += ib.tolist()\n        loss = ((model(xb) - yb) ** 2).mean()\n"
    "        accelerator.backward(loss)\n        optimizer.step()\n        optimizer.zero_grad()\n"
    "    with open(f\"seen-{os.environ.get('RANK', '0')}.json\", 'w') as fh:\n        json.dump(seen, fh)",
    "notebook_launcher(train_fn, (0.01,), num_processes=2)",
]


def test_a_helpers_loader_prepared_by_accelerate_is_sharded_once(tmp_path):
    # the LMSYS kernel's shape: each rank trained 20 of 80 rows (nbddp's sampler under Accelerate's sharding)
    chunks = []
    job = run_job(write_notebook(tmp_path / "acc.ipynb", ACCELERATE_HELPER),
                  RunOptions(nproc=2, runs_dir=tmp_path / "runs", timeout_s=300), Said(chunks))
    assert job.run.ok, "".join(chunks)[-3000:]
    seen = [json.loads((tmp_path / f"seen-{rank}.json").read_text()) for rank in (0, 1)]
    assert len(seen[0]) == len(seen[1]) == 40 and set(seen[0]).isdisjoint(seen[1])
