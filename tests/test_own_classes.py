"""A training loop in a method of the notebook's own class (a Kaggle ``class Trainer:`` with ``train()``, a
``Fitter``): refused before launch at the call that runs it, where it was launched as transformers' Trainer (no
DDP, no sharding: every rank trained on every sample) or refused as having no training call at all.

The cells are the shape of a public Kaggle notebook (riow1983/Kaggle-chaii,
``notebooks/chaii-qa-5-fold-xlmroberta-torch-fit.ipynb`` at 3305c235f856151694fa9bb6aa5780ab86774506: its
``class Trainer`` with ``train()``, built and called in ``run(fold)`` for each fold), cut to a tiny model."""

import pytest

from nbddp.cells import Cell
from nbddp.convert.script import convert_cells
from nbddp.errors import CellError

DATA = """import torch, torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset, RandomSampler
X, Y = torch.randn(64, 8), torch.randint(0, 2, (64,))
def make_loader():
    ds = TensorDataset(X, Y)
    return DataLoader(ds, batch_size=8, sampler=RandomSampler(ds))"""

OWN_TRAINER = """class Trainer:
    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer
    def train(self, loader):
        self.model.train()
        for x, y in loader:
            loss = nn.functional.cross_entropy(self.model(x), y)
            loss.backward()
            self.optimizer.step(); self.optimizer.zero_grad()"""

RUN = """def run(fold):
    model = nn.Linear(8, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = Trainer(model, optimizer)
    for epoch in range(2):
        trainer.train(make_loader())
    torch.save(model.state_dict(), f"model_{fold}.pt")
for fold in range(2):
    run(fold)"""

FITTER = """class Fitter:
    def __init__(self, model):
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters())
    def one_epoch(self, loader):
        for x, y in loader:
            nn.functional.cross_entropy(self.model(x), y).backward()
            self.optimizer.step(); self.optimizer.zero_grad()
    def fit(self, loader, epochs):
        for _ in range(epochs):
            self.one_epoch(loader)"""


def convert(*sources: str):
    return convert_cells([Cell(k, src) for k, src in enumerate(sources, start=1)], origin="nb.ipynb")


def refusal(*sources: str) -> CellError:
    with pytest.raises(CellError) as caught:
        convert(*sources)
    return caught.value


def test_a_notebooks_own_trainer_class_is_refused_at_the_call_in_a_function_not_taken_for_transformers():
    # before: Trainer(...) was taken for transformers' Trainer and the job launched with no DDP and no sharding
    error = refusal(DATA, OWN_TRAINER, RUN)
    assert (error.cell, error.line) == (3, 6) and "trainer.train(make_loader())" in error.source
    assert "Trainer.train() trains in a method of the notebook's own class Trainer" in str(error)
    assert "every rank would train on every sample" in str(error) and "in its kernel" in str(error)


def test_a_class_of_another_name_training_through_self_is_refused_at_its_call():
    # before: refused as having no training call at all, though a loop calling backward() is there
    error = refusal(DATA, FITTER, "Fitter(nn.Linear(8, 2)).fit(make_loader(), 3)")
    assert (error.cell, error.line) == (3, 1) and "Fitter.fit() trains in a method" in str(error)


def test_a_subclass_of_the_notebooks_training_class_trains_as_its_base():
    error = refusal(DATA, OWN_TRAINER, "class FoldTrainer(Trainer):\n    pass",
                    "t = FoldTrainer(nn.Linear(8, 2), None)\nt.train(make_loader())")
    assert (error.cell, error.line) == (4, 2) and "own class FoldTrainer" in str(error)


def test_a_subclass_of_transformers_trainer_is_still_transformers_trainer():
    script = convert("from transformers import Trainer, TrainingArguments\n"
                     "class WeightedTrainer(Trainer):\n"
                     "    def compute_loss(self, model, inputs, return_outputs=False, **kwargs):\n"
                     "        return model(**inputs).loss",
                     "trainer = WeightedTrainer(model=model, args=TrainingArguments('out'), train_dataset=ds)\n"
                     "trainer.train()")
    assert script.trains


def test_classes_that_do_not_train_leave_a_plain_loop_to_be_distributed():
    script = convert(DATA, "class AverageMeter:\n    def __init__(self):\n        self.sum = 0\n"
                           "    def update(self, v):\n        self.sum += v",
                     "model = nn.Linear(8, 2)\noptimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"
                     "meter = AverageMeter()\nfor x, y in make_loader():\n"
                     "    loss = nn.functional.cross_entropy(model(x), y)\n    loss.backward()\n"
                     "    optimizer.step(); meter.update(loss.item())")
    assert script.trains and "_nbddp.ddp(" in script.text


def test_a_class_of_the_notebooks_wrapping_transformers_trainer_without_a_loop_of_its_own_is_still_a_trainer():
    script = convert("from transformers import Trainer as HFTrainer, TrainingArguments\n"
                     "class Trainer:\n    def __init__(self, model, ds):\n"
                     "        self.inner = HFTrainer(model=model, args=TrainingArguments('out'), train_dataset=ds)\n"
                     "    def train(self):\n        return self.inner.train()",
                     "trainer = Trainer(model, ds)\ntrainer.train()")
    assert script.trains
