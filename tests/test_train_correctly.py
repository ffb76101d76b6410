"""Train correctly or refuse loudly: notebooks that used to train wrong in silence, run on two gloo ranks.

Each notebook is written in the style public notebooks use; the ranks write what they hold at the end
(weights, what they read) to files named by rank, and the test compares them.
"""

import json
import re

import pytest

from conftest import write_notebook
from nbddp.convert import convert_notebook
from nbddp.job import run_job
from nbddp.options import RunOptions
from views import Said

pytestmark = pytest.mark.e2e
#: The tests reading one module-scoped job: under pytest-xdist's ``--dist loadgroup`` they run on one worker, so
#: the job is launched once (under plain ``-n``, once per worker that gets one of them).
SHARED_SECOND_MODELS = pytest.mark.xdist_group("train_correctly_second_models")
SHARED_LOADERS = pytest.mark.xdist_group("train_correctly_loaders")

IMPORTS = (
    "import json, os\nimport torch\nfrom torch import nn\nfrom torch.utils.data import DataLoader, TensorDataset"
)
DATA = (
    "torch.manual_seed(0)\nx = torch.randn(64, 4)\ny = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])\n"
    "data = TensorDataset(x, y)\ntrain_loader = DataLoader(data, batch_size=8, shuffle=True)"
)
NET = (
    "class Net(nn.Module):\n"
    "    def __init__(self):\n"
    "        super().__init__()\n"
    "        self.fc1 = nn.Linear(4, 8)\n"
    "        self.fc2 = nn.Linear(8, 1)\n"
    "    def forward(self, x):\n"
    "        return self.fc2(torch.relu(self.fc1(x)))"
)


def loop(model: str, optimizer: str, *dumps: str) -> str:
    """A plain training loop; ``dumps`` run at its end inside it, on every rank (after it, rank 0 only)."""
    return (
        "for epoch in range(2):\n"
        "    for xb, yb in train_loader:\n"
        f"        loss = ((({model})(xb) - yb) ** 2).mean()\n"
        f"        {optimizer}.zero_grad()\n"
        "        loss.backward()\n"
        f"        {optimizer}.step()\n"
        "    print(f'epoch {epoch} loss {loss.item():.4f}')"
    ) + "".join("\n    if epoch == 1:\n" + "".join(f"        {line}\n" for line in d.splitlines()) for d in dumps)


def dump(model: str, name: str) -> str:
    """Each rank writes the model's trainable weights to ``<name>-<rank>.json``."""
    return (
        f"with open(f\"{name}-{{os.environ['RANK']}}.json\", 'w') as fh:\n"
        f"    json.dump({{k: v.tolist() for k, v in {model}.named_parameters() if v.requires_grad}}, fh)"
    )


def run(tmp_path, nb, **env):
    chunks = []
    job = run_job(nb, RunOptions(nproc=2, runs_dir=tmp_path / "runs", timeout_s=500, env=env or None), Said(chunks))
    script, result = job.script, job.run
    return script, result, "".join(chunks)


def same_on_both_ranks(tmp_path, name):
    a, b = (json.loads((tmp_path / f"{name}-{r}.json").read_text()) for r in (0, 1))
    assert a.keys() == b.keys() and a
    return a == b


# ------------------------------------------------------------------------------ 1. a second model


#: Two scenarios of a model trained after a wrapped loop, in one job (one launch): plain models trained one after
#: another (cells 3-6), then a PEFT model made from a trained one (cells 7-10). Their names are apart (the
#: converter's facts are by name) and only the data cell is shared, as each scenario shares it between its models.
SECOND_MODELS = [
    IMPORTS + "\nfrom peft import LoraConfig, get_peft_model",
    DATA,
    NET + "\nmodel_1 = Net()\noptimizer_1 = torch.optim.SGD(model_1.parameters(), lr=0.01)",
    loop("model_1", "optimizer_1"),
    "model_2 = Net()\noptimizer_2 = torch.optim.SGD(model_2.parameters(), lr=0.01)",
    loop("model_2", "optimizer_2", dump("model_1", "m1"), dump("model_2", "m2")),
    "module = Net()\noptimizer = torch.optim.SGD(module.parameters(), lr=0.01)",
    loop("module", "optimizer"),
    'config = LoraConfig(r=2, target_modules=["fc1"])\npeft_model = get_peft_model(module, config)\n'
    "peft_optimizer = torch.optim.SGD(peft_model.parameters(), lr=0.05)",
    loop("peft_model", "peft_optimizer", dump("peft_model", "lora")),
]


@pytest.fixture(scope="module")
def second_models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("second_models")
    return folder, *run(folder, write_notebook(folder / "nb.ipynb", SECOND_MODELS))


def ran_to_its_cells(result, out, cells: range):
    """The shared job ended well; where it failed, whether in this scenario's cells or before them."""
    failure = result.failure
    where = "this scenario's" if failure and failure.cell in cells else "another scenario's"
    assert result.ok, (f"the shared job failed in {where} cell {failure and failure.cell}", out[-3000:], failure)


@SHARED_SECOND_MODELS
def test_models_trained_one_after_another_are_each_wrapped(second_models):
    folder, script, result, out = second_models
    ran_to_its_cells(result, out, range(1, 7))
    assert same_on_both_ranks(folder, "m1") and same_on_both_ranks(folder, "m2")


@SHARED_SECOND_MODELS
def test_a_peft_model_trained_after_a_wrapped_loop_is_wrapped_too(second_models):
    folder, script, result, out = second_models
    ran_to_its_cells(result, out, range(7, 11))
    assert same_on_both_ranks(folder, "lora")
    assert "peft_model = _nbddp.ddp(peft_model)" in script.text


# ------------------------------------------------------------------------------------ the safety net

HIDDEN_MODEL = [
    IMPORTS,
    DATA,
    NET + "\nmodel = Net()\nparams = list(model.parameters())\noptimizer = torch.optim.SGD(params, lr=0.01)",
    loop("model", "optimizer", dump("model", "hidden")),
]


def test_replicas_that_diverge_stop_the_job_with_the_cell_the_model_and_the_fix(tmp_path, notebook):
    """The converter cannot see which model ``params`` holds: the net stops the job at the first step."""
    script, result, out = run(tmp_path, notebook(HIDDEN_MODEL))
    assert "_nbddp.ddp(model)" not in script.text  # the converter did not see it
    assert not result.ok and result.failure is not None
    message = result.failure.message
    assert "ReplicasDiverged" in message and "copies of model diverged after optimizer step 1" in message
    assert "cell 4, line 6" in message and "model = _nbddp.ddp(model)" in message
    assert "NBDDP_ALLOW_DIVERGENCE=1" in message
    assert (result.failure.cell, result.failure.line) == (4, 6)


def test_allow_divergence_lets_ranks_train_apart(tmp_path, notebook):
    script, result, out = run(tmp_path, notebook(HIDDEN_MODEL), NBDDP_ALLOW_DIVERGENCE="1")
    assert result.ok, (out[-3000:], result.failure)
    assert not same_on_both_ranks(tmp_path, "hidden")  # what the net stops otherwise


UNSHARDED = [
    IMPORTS,
    DATA.replace("shuffle=True", "sampler=torch.utils.data.WeightedRandomSampler([1.0] * 64, 64, generator="
                 "torch.Generator().manual_seed(0))"),
    NET + "\nmodel = Net()\noptimizer = torch.optim.SGD(model.parameters(), lr=0.01)",
    loop("model", "optimizer"),
]


def test_ranks_training_on_the_same_batches_stop_at_the_forward_with_the_fix(tmp_path, notebook):
    """The notebook's own sampler gives every rank the same batches: the replicas agree, the work repeats."""
    script, result, out = run(tmp_path, notebook(UNSHARDED))
    assert not result.ok and result.failure is not None, out[-3000:]
    message = result.failure.message
    assert "SameBatches" in message and "ranks 0 and 1 trained on the same samples" in message
    assert "cell 4, line 3" in message and "--allow-divergence" in message and "DataLoader(" in message
    assert (result.failure.cell, result.failure.line) == (4, 3)


#: After training, a metric over the training loader (rank 0's code) counts what it saw.
COUNTED = ("def count_examples(model, loader):\n    with torch.no_grad():\n"
           "        return sum(len(model(xb)) for xb, yb in loader)\n"
           "print(f'examples counted {count_examples(model, train_loader)}')")


def test_the_net_checks_stay_quiet_for_a_converted_loop_and_its_metric_counts_the_whole_set(tmp_path, notebook):
    script, result, out = run(tmp_path, notebook([IMPORTS, DATA, NET + "\nmodel = Net()\n"
                                                  "optimizer = torch.optim.SGD(model.parameters(), lr=0.01)",
                                                  loop("model", "optimizer"), COUNTED]))
    assert result.ok, (out[-3000:], result.failure)
    assert "nbddp: warning" not in out
    assert "examples counted 64" in out  # as in the kernel: not rank 0's share of 32


# ------------------------------------------------------------------------- 6. parameters DDP never sees used

LAYER_DROP = [
    IMPORTS,
    DATA,
    "class Skipping(nn.Module):\n"
    "    def __init__(self):\n"
    "        super().__init__()\n"
    "        self.fc1 = nn.Linear(4, 8)\n"
    "        self.extra = nn.Linear(8, 8)\n"
    "        self.fc2 = nn.Linear(8, 1)\n"
    "        self.calls = 0\n"
    "    def forward(self, x):\n"
    "        self.calls += 1\n"
    "        h = torch.relu(self.fc1(x))\n"
    "        if self.calls % 2 == 0:  # a layer skipped every other step, as LayerDrop does at random\n"
    "            h = self.extra(h)\n"
    "        return self.fc2(h)\n"
    "model = Skipping()\noptimizer = torch.optim.SGD(model.parameters(), lr=0.01)",
    loop("model", "optimizer"),
]


def test_a_plain_model_that_skips_a_layer_trains_in_sync(tmp_path, notebook):
    """nbddp's wrap of a plain model looks for parameters a step leaves out, as the Trainer does for a model
    that is not a PEFT adapter (an unused pooler stopped a public BERT notebook at its second step)."""
    script, result, out = run(tmp_path, notebook(LAYER_DROP[:-1] + [loop("model", "optimizer", dump("model", "skip"))]))
    assert result.ok, (out[-3000:], result.failure)
    assert same_on_both_ranks(tmp_path, "skip")
    assert out.count("DDP looks for parameters a training step leaves out") == 1


def test_a_model_that_skips_a_layer_where_ddp_is_told_it_does_not_fails_with_the_parameters_and_the_fix(tmp_path, notebook):
    script, result, out = run(tmp_path, notebook(LAYER_DROP), NBDDP_FIND_UNUSED_PARAMETERS="0")
    assert not result.ok and result.failure is not None
    message = result.failure.message
    assert "UnusedParameters" in message
    assert re.search(r"got no gradient in the last step \(rank [01]\): extra\.weight, extra\.bias\.", message)
    assert "ddp_find_unused_parameters=True" in message and "NBDDP_FIND_UNUSED_PARAMETERS=1" in message
    assert (result.failure.cell, result.failure.line) == (4, 3)


AUDIO_LAYER_DROP = [
    "import torch\nfrom datasets import Dataset\n"
    "from transformers import Trainer, TrainingArguments, Wav2Vec2Config, Wav2Vec2ForSequenceClassification",
    "config = Wav2Vec2Config(hidden_size=16, num_hidden_layers=4, num_attention_heads=2, intermediate_size=32,\n"
    "                        conv_dim=(8, 8), conv_stride=(5, 4), conv_kernel=(10, 8), num_conv_pos_embeddings=16,\n"
    "                        num_conv_pos_embedding_groups=2, layerdrop=0.5, mask_time_prob=0.0, num_labels=2)\n"
    "model = Wav2Vec2ForSequenceClassification(config)",
    "g = torch.Generator().manual_seed(0)\n"
    "data = Dataset.from_dict({'input_values': torch.randn(48, 400, generator=g).tolist(),\n"
    "                          'labels': [i % 2 for i in range(48)]})",
    "args = TrainingArguments(\n"
    "    output_dir='audio-out',\n"
    "    per_device_train_batch_size=4,\n"
    "    max_steps=10,\n"
    "    logging_steps=1,\n"
    "    save_strategy='no',\n"
    "    report_to='none',  # no trackers offline\n"
    ")\n"
    "trainer = Trainer(model=model, args=args, train_dataset=data)\n"
    "trainer.train()",
]


def test_a_full_fine_tune_with_layer_drop_trains_with_the_trainers_own_ddp_setting(tmp_path, notebook):
    """wav2vec2 skips layers at random (LayerDrop): the Trainer looks for unused parameters by itself."""
    script, result, out = run(tmp_path, notebook(AUDIO_LAYER_DROP))
    assert "ddp_find_unused_parameters" not in script.text
    assert "report_to='none',  # no trackers offline\n    log_on_each_node=False,\n" in script.text
    assert result.ok, (out[-3000:], result.failure and result.failure.message[-2000:])
    assert "'train_runtime'" in out or "train_runtime" in out


# ----------------------------------------------------------------- 2. loaders from one factory function

FACTORY_LOADERS = [
    IMPORTS,
    "train_ds = TensorDataset(torch.arange(64).float().unsqueeze(1), torch.arange(64).float().unsqueeze(1) * 3)\n"
    "test_ds = TensorDataset(torch.arange(32).float().unsqueeze(1), torch.arange(32).float().unsqueeze(1) * 3)\n"
    "def get_data_loader(ds, shuffle):\n"
    "    return DataLoader(ds, batch_size=8, shuffle=shuffle)\n"
    "train_dl = get_data_loader(train_ds, shuffle=True)\n"
    "test_dl = get_data_loader(test_ds, shuffle=False)",
    "model = nn.Linear(1, 1)\noptimizer = torch.optim.SGD(model.parameters(), lr=1e-4)",
    "seen = {}\n"
    "for epoch in range(2):\n"
    "    seen[epoch] = []\n"
    "    for xb, yb in train_dl:\n"
    "        seen[epoch] += xb.flatten().int().tolist()\n"
    "        loss = ((model(xb) - yb) ** 2).mean()\n"
    "        optimizer.zero_grad()\n"
    "        loss.backward()\n"
    "        optimizer.step()\n"
    "    with open(f\"seen-{os.environ['RANK']}.json\", 'w') as fh:\n"
    "        json.dump(seen, fh)",
    "count = sum(len(xb) for xb, yb in test_dl)\nprint(f'evaluated on {count} samples')",
]


#: The factory's own loader and the training function's parameter share a name (``data_loader``), as in
#: bentrevett/pytorch-sentiment-analysis: the factory's loader is not the one the training loop iterates.
FACTORY_SAME_NAME = [
    IMPORTS,
    "train_ds = TensorDataset(torch.arange(64).float().unsqueeze(1), torch.arange(64).float().unsqueeze(1) * 3)\n"
    "test_ds = TensorDataset(torch.arange(32).float().unsqueeze(1), torch.arange(32).float().unsqueeze(1) * 3)\n"
    "def get_data_loader(dataset, batch_size, shuffle=False):\n"
    "    data_loader = torch.utils.data.DataLoader(dataset=dataset, batch_size=batch_size, shuffle=shuffle)\n"
    "    return data_loader\n"
    "train_dl = get_data_loader(train_ds, 8, shuffle=True)\n"
    "test_dl = get_data_loader(test_ds, 8)",
    "model = nn.Linear(1, 1)\noptimizer = torch.optim.SGD(model.parameters(), lr=1e-4)",
    "def train(data_loader, model, optimizer):\n"
    "    for xb, yb in data_loader:\n"
    "        loss = ((model(xb) - yb) ** 2).mean()\n"
    "        optimizer.zero_grad()\n"
    "        loss.backward()\n"
    "        optimizer.step()\n"
    "def evaluate(data_loader, model):\n"
    "    return sum(len(xb) for xb, yb in data_loader)",
    "for epoch in range(2):\n"
    "    train(train_dl, model, optimizer)\n"
    "    print(f'epoch {epoch}: validated on {evaluate(test_dl, model)} samples')",
    "print(f'tested on {evaluate(test_dl, model)} samples')",
]


#: 3. loaders with a RandomSampler of their own
RANDOM_SAMPLER = [
    IMPORTS + "\nfrom torch.utils.data import RandomSampler, SequentialSampler",
    "train_ds = TensorDataset(torch.arange(64).float().unsqueeze(1), torch.arange(64).float().unsqueeze(1) * 3)\n"
    "test_ds = TensorDataset(torch.arange(32).float().unsqueeze(1), torch.arange(32).float().unsqueeze(1) * 3)\n"
    "train_loader = DataLoader(train_ds, batch_size=8, sampler=RandomSampler(train_ds))\n"
    "test_loader = DataLoader(test_ds, batch_size=8, sampler=SequentialSampler(test_ds))",
    FACTORY_LOADERS[2],
    FACTORY_LOADERS[3].replace("train_dl", "train_loader"),
    FACTORY_LOADERS[4].replace("test_dl", "test_loader"),
]


#: a training loader from an imported helper, sharded when it runs
HELPER_LOADER = [
    IMPORTS + "\nimport sys\nsys.path.insert(0, os.getcwd())\nfrom helpers import create_dataloader",
    FACTORY_LOADERS[1].split("\ndef ")[0] + "\ntrain_loader = create_dataloader(train_ds, batch_size=8)\n"
    "test_loader = create_dataloader(test_ds, batch_size=8, shuffle=False)",
    FACTORY_LOADERS[2],
    FACTORY_LOADERS[3].replace("train_dl", "train_loader"),
    FACTORY_LOADERS[4].replace("test_dl", "test_loader"),
]



#: training through an imported helper (pytorch_dl's engine)
ENGINE = (
    "import json, os\nimport torch\n\n"
    "def train(model, train_dataloader, test_dataloader, optimizer, loss_fn, epochs, device):\n"
    "    seen = {}\n"
    "    for epoch in range(epochs):\n"
    "        seen[epoch] = []\n"
    "        model.train()\n"
    "        for xb, yb in train_dataloader:\n"
    "            seen[epoch] += xb.squeeze(1).long().tolist()\n"
    "            loss = loss_fn(model(xb), yb)\n"
    "            optimizer.zero_grad()\n"
    "            loss.backward()\n"
    "            optimizer.step()\n"
    "        model.eval()\n"
    "        with torch.inference_mode():\n"
    "            tested = sum(len(xb) for xb, _ in test_dataloader)\n"
    "    rank = os.environ['RANK']\n"
    "    with open(f'seen-{rank}.json', 'w') as fh:\n"
    "        json.dump(seen, fh)\n"
    "    with open(f'weights-{rank}.json', 'w') as fh:\n"
    "        json.dump({k: v.tolist() for k, v in model.named_parameters() if v.requires_grad}, fh)\n"
    "    return {'tested': tested, 'loss': loss.item()}\n"
)
DATA_SETUP = (
    "import torch\nfrom torch.utils.data import DataLoader, TensorDataset\n\n"
    "def create_dataloaders(batch_size):\n"
    "    train = TensorDataset(torch.arange(64).float().unsqueeze(1), torch.arange(64).float().unsqueeze(1) * 3)\n"
    "    test = TensorDataset(torch.arange(32).float().unsqueeze(1), torch.arange(32).float().unsqueeze(1) * 3)\n"
    "    return DataLoader(train, batch_size, shuffle=True), DataLoader(test, batch_size), ['y']\n"
)
HELPER_TRAINING = [
    IMPORTS + "\nimport sys\nsys.path.insert(0, os.getcwd())\nfrom going_modular import data_setup, engine",
    "train_dataloader, test_dataloader, class_names = data_setup.create_dataloaders(batch_size=8)",
    "torch.manual_seed(0)\nmodel = nn.Sequential(nn.Linear(1, 8), nn.ReLU(), nn.Linear(8, 1))\n"
    "for param in model[0].parameters():\n    param.requires_grad = False\nmodel[2] = nn.Linear(8, 1)",
    "optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)",
    "results = engine.train(model=model, train_dataloader=train_dataloader, test_dataloader=test_dataloader,\n"
    "                       optimizer=optimizer, loss_fn=nn.MSELoss(), epochs=2, device='cpu')",
    "print(f\"tested on {results['tested']} samples\")\ntorch.save(model.state_dict(), 'model.pth')",
]


# ------------------------------------------------- the five loader scenarios above, in one job (one launch)

#: Each scenario's top-level names, suffixed in the shared job: the converter's facts about loaders and models are
#: by name, so apart names keep one scenario's loaders from being judged by another's (each scenario's rewrites
#: are those it gets alone). A wrong sharding does not stop a job, so each scenario's regression fails its own
#: test alone. One difference: a scenario's evaluation cells that other scenarios' training follows run on every
#: rank, not on rank 0 alone as after a job's last training; as telling, since a sharded test loader would give
#: rank 0 half the samples either way.
LOADER_SCENARIOS = {
    "factory": (FACTORY_LOADERS, ("train_ds", "test_ds", "get_data_loader", "train_dl", "test_dl", "model",
                                  "optimizer", "seen", "count")),
    "same_name": (FACTORY_SAME_NAME, ("train_ds", "test_ds", "get_data_loader", "train_dl", "test_dl", "model",
                                      "optimizer", "train", "evaluate")),
    "random": (RANDOM_SAMPLER, ("train_ds", "test_ds", "train_loader", "test_loader", "model", "optimizer", "seen",
                                "count")),
    "helper": (HELPER_LOADER, ("train_ds", "test_ds", "train_loader", "test_loader", "model", "optimizer", "seen",
                               "count")),
    # last, as alone: what follows its training runs on rank 0 alone (its files keep the engine's names)
    "engine": (HELPER_TRAINING, ("train_dataloader", "test_dataloader", "class_names", "model", "optimizer",
                                 "results")),
}
SAID = ("evaluated on", "validated on", "tested on")


def apart(cells: list[str], suffix: str, names: tuple[str, ...]) -> list[str]:
    """The scenario's cells with its names (and the files named after them) suffixed, its lines labelled."""
    def one(cell: str) -> str:
        for name in names:
            cell = re.sub(rf"\b{name}\b(?!=[^=])", f"{name}_{suffix}", cell)  # a keyword (name=…) stays
        for phrase in SAID:
            cell = cell.replace(phrase, f"{suffix} {phrase}")
        return cell

    return [one(cell) for cell in cells]


@pytest.fixture(scope="module")
def loaders(tmp_path_factory):
    folder = tmp_path_factory.mktemp("loaders")
    (folder / "helpers.py").write_text(
        "from torch.utils.data import DataLoader\n\n"
        "def create_dataloader(ds, batch_size, shuffle=True):\n"
        "    return DataLoader(ds, batch_size=batch_size, shuffle=shuffle)\n"
    )
    package = folder / "going_modular"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "engine.py").write_text(ENGINE)
    (package / "data_setup.py").write_text(DATA_SETUP)
    cells = [c for suffix, (scenario, names) in LOADER_SCENARIOS.items() for c in apart(scenario, suffix, names)]
    script, result, out = run(folder, write_notebook(folder / "nb.ipynb", cells))
    assert result.ok, (out[-3000:], result.failure)  # a failure here fails each of the five tests
    return folder, script, out


def seen_by_rank(folder, suffix):
    return [json.loads((folder / f"seen_{suffix}-{r}.json").read_text()) for r in (0, 1)]


def each_epoch_split_between_the_ranks(seen):
    for epoch in ("0", "1"):
        a, b = seen[0][epoch], seen[1][epoch]
        assert len(a) == len(b) == 32 and not set(a) & set(b) and set(a) | set(b) == set(range(64))


@SHARED_LOADERS
def test_loaders_from_a_factory_shard_the_training_data_only_and_reshuffle_each_epoch(loaders):
    folder, script, out = loaders
    assert "factory evaluated on 32 samples" in out  # the whole test set, not rank 0's half
    seen = seen_by_rank(folder, "factory")
    each_epoch_split_between_the_ranks(seen)
    assert seen[0]["0"] != seen[0]["1"]  # set_epoch reshuffled
    assert "_nbddp.set_epoch(train_dl_factory, epoch)" in script.text


@SHARED_LOADERS
def test_a_factory_loader_named_as_a_training_functions_parameter_stays_whole_for_evaluation(loaders):
    folder, script, out = loaders
    assert out.count("same_name validated on 32 samples") == 2 and "same_name tested on 32 samples" in out, \
        out[-2000:]  # not half
    assert "sampler=_nbddp.distributed_sampler(dataset, shuffle=shuffle) if shuffle else None" in script.text


@SHARED_LOADERS
def test_a_random_sampler_is_replaced_by_the_distributed_one(loaders):
    folder, script, out = loaders
    assert "random evaluated on 32 samples" in out
    seen = seen_by_rank(folder, "random")
    each_epoch_split_between_the_ranks(seen)
    assert seen[0]["0"] != seen[0]["1"]  # set_epoch reshuffled


@SHARED_LOADERS
def test_a_training_loader_from_an_imported_helper_is_sharded_when_it_runs(loaders):
    folder, script, out = loaders
    assert "helper evaluated on 32 samples" in out
    each_epoch_split_between_the_ranks(seen_by_rank(folder, "helper"))


@SHARED_LOADERS
def test_training_through_an_imported_helper_is_distributed(loaders):
    """pytorch_dl 06–09 train with ``engine.train(model=…, optimizer=…)`` from ``going_modular``: nbddp sees
    no loop, only what goes in. The model (features frozen, head replaced) is wrapped after those changes,
    the training loader is sharded as it goes in, and the rest runs on rank 0."""
    folder, script, out = loaders
    assert out.count("engine tested on 32 samples") == 1  # the whole test set, printed by rank 0
    each_epoch_split_between_the_ranks([json.loads((folder / f"seen-{r}.json").read_text()) for r in (0, 1)])
    assert same_on_both_ranks(folder, "weights")
    assert (folder / "model_engine.pth").exists() and "2.weight" in torch_keys(folder / "model_engine.pth")


# ----------------------------------------------------------------------- 5. a trainer built by a helper

HELPER_TRAINER = [
    "import os\nimport torch\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n"
    "from trl import SFTConfig, SFTTrainer\nfrom nbddp import demo",
    "name = demo.tiny_model()\ntokenizer = AutoTokenizer.from_pretrained(name)\n"
    "model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32)\ndata = demo.arithmetic_dataset(32)",
    "def create_trainer(model, out):\n"
    "    args = SFTConfig(output_dir=out, max_steps=2, per_device_train_batch_size=4, max_length=32,\n"
    "                     save_strategy='no', report_to='none', bf16=False)\n"
    "    return SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer)",
    "trainer_x = create_trainer(model, 'o1')\ntrainer_x.train()",
    "with open(f\"after-{os.environ['RANK']}.txt\", 'w') as fh:\n    fh.write('written once')\n"
    "trainer_x.save_model('final')",
]


def test_after_a_trainer_built_by_a_helper_trains_saving_runs_once(tmp_path, notebook):
    script, result, out = run(tmp_path, notebook(HELPER_TRAINER))
    assert result.ok, (out[-3000:], result.failure)
    assert (tmp_path / "after-0.txt").exists() and not (tmp_path / "after-1.txt").exists()
    assert (tmp_path / "final" / "model.safetensors").exists()


# ------------------------------------------------------------------------ 7. save, then load, before training

SAVE_THEN_LOAD = [
    "import os\nimport pandas as pd\nimport torch\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n"
    "from trl import SFTConfig, SFTTrainer\nfrom nbddp import demo",
    "name = demo.tiny_model()\ntokenizer = AutoTokenizer.from_pretrained(name)\n"
    "model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32)\n"
    "model.save_pretrained('base')",
    "model = AutoModelForCausalLM.from_pretrained('base', dtype=torch.float32)",
    "pd.DataFrame({'a': range(5000)}).to_csv('table.csv')",
    "assert len(pd.read_csv('table.csv')) == 5000",
    "args = SFTConfig(output_dir='o', max_steps=2, per_device_train_batch_size=4, max_length=32,\n"
    "                 save_strategy='no', report_to='none', bf16=False)\n"
    "trainer = SFTTrainer(model=model, args=args, train_dataset=demo.arithmetic_dataset(32), processing_class=tokenizer)\n"
    "trainer.train()",
]


def test_files_saved_before_training_are_complete_before_any_rank_reads_them(tmp_path, notebook):
    script, result, out = run(tmp_path, notebook(SAVE_THEN_LOAD))
    assert result.ok, (out[-3000:], result.failure and result.failure.message[-2000:])
    assert script.text.count("_nbddp.barrier()") == 2


# ------------------------------------------------- 4. a plain loop and an Accelerate loop in one notebook

PLAIN_THEN_ACCELERATE = [
    IMPORTS + "\nfrom accelerate import Accelerator, notebook_launcher",
    DATA,
    NET + "\nplain = Net()\nplain_optimizer = torch.optim.SGD(plain.parameters(), lr=0.01)",
    loop("plain", "plain_optimizer", dump("plain", "plain")),
    "def training_function(lr):\n"
    "    accelerator = Accelerator()\n"
    "    model = Net()\n"
    "    optimizer = torch.optim.SGD(model.parameters(), lr=lr)\n"
    "    loader = DataLoader(data, batch_size=8, shuffle=True)\n"
    "    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)\n"
    "    for epoch in range(2):\n"
    "        for xb, yb in loader:\n"
    "            loss = ((model(xb) - yb) ** 2).mean()\n"
    "            optimizer.zero_grad()\n"
    "            accelerator.backward(loss)\n"
    "            optimizer.step()\n"
    "    with open(f\"accel-{os.environ['RANK']}.json\", 'w') as fh:\n"
    "        json.dump({'processes': accelerator.num_processes, 'precision': accelerator.mixed_precision,\n"
    "                   'weights': {k: v.tolist() for k, v in accelerator.unwrap_model(model).named_parameters()}}, fh)",
    "notebook_launcher(training_function, (0.01,), num_processes=2, mixed_precision='bf16')",
]


def test_an_accelerate_loop_leaves_the_plain_loops_to_nbddp_and_notebook_launcher_runs_in_each_rank(tmp_path, notebook):
    script, result, out = run(tmp_path, notebook(PLAIN_THEN_ACCELERATE))
    assert result.ok, (out[-3000:], result.failure and result.failure.message[-2000:])
    assert same_on_both_ranks(tmp_path, "plain")  # the plain loop was wrapped in DDP
    accel = [json.loads((tmp_path / f"accel-{r}.json").read_text()) for r in (0, 1)]
    assert accel[0] == accel[1] and accel[0]["processes"] == 2  # one job of 2, not a nested one per rank
    assert accel[0]["precision"] == "bf16"  # the launcher's mixed_precision= reaches the Accelerator
    assert "model = _nbddp.ddp(model)" not in script.text  # Accelerate's own model is left to it


def torch_keys(path):
    import torch

    return set(torch.load(path))


# ------------------------------------------------------------------- a loop slicing tensors by index

INDEX_SLICE = [
    "import json, os\nimport torch\nfrom torch import nn",
    "torch.manual_seed(0)\nX = torch.randn(60, 4)\ny = X.sum(1, keepdim=True)\nbs = 8",
    "model = nn.Linear(4, 1)\noptimizer = torch.optim.SGD(model.parameters(), lr=0.01)",
    "for epoch in range(2):\n"
    "    perm = torch.randperm(len(X))\n"
    "    seen = []\n"
    "    for i in range(0, len(X), bs):\n"
    "        idx = perm[i:i + bs]\n"
    "        seen.append(idx.tolist())\n"
    "        loss = ((model(X[idx]) - y[idx]) ** 2).mean()\n"
    "        optimizer.zero_grad()\n"
    "        loss.backward()\n"
    "        optimizer.step()\n"
    "    with open(f\"seen-{epoch}-{os.environ['RANK']}.json\", 'w') as fh:\n"
    "        json.dump(seen, fh)",
]


def test_a_loop_slicing_tensors_by_index_gives_each_rank_its_own_rows(tmp_path, notebook):
    """60 rows in batches of 8: 8 batch positions, 4 a rank (the last batch is short), every row once."""
    script, result, out = run(tmp_path, notebook(INDEX_SLICE))
    assert result.ok, (out[-3000:], result.failure)
    assert "_nbddp.shard_range(range(0, len(X), bs))" in script.text
    for epoch in range(2):
        a, b = (json.loads((tmp_path / f"seen-{epoch}-{r}.json").read_text()) for r in (0, 1))
        assert len(a) == len(b) == 4  # as many steps on each rank
        rows_a, rows_b = [r for batch in a for r in batch], [r for batch in b for r in batch]
        assert not set(rows_a) & set(rows_b) and sorted(rows_a + rows_b) == list(range(60))
