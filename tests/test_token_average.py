"""The Trainer's loss × processes for a model that takes **kwargs but ignores ``num_items_in_batch``
(shim token_average): on two gloo ranks a BertForSequenceClassification logs the kernel's training loss and
``eval_loss`` and takes the kernel's gradient steps, not twice them."""

import json
import sys
from pathlib import Path

import pytest

from nbddp.launch import launch, new_run_dir, plan
from nbddp.options import RunOptions

JOBS = Path(__file__).resolve().parent / "jobs"


def one_process(tmp_path) -> dict:
    sys.path.insert(0, str(JOBS))
    try:
        from tiny_bert_trainer import train_and_evaluate
    finally:
        sys.path.remove(str(JOBS))
    return train_and_evaluate(tmp_path / "one")


def two_ranks(tmp_path, env: dict) -> tuple[dict, str]:
    chunks = []
    res = launch(plan(JOBS / "token_average.py", new_run_dir(tmp_path / "runs", "token_average"),
                      RunOptions(timeout_s=300), nproc=2, cwd=tmp_path, env=env),
                 sink=lambda stream, text: chunks.append(text))
    out = "".join(chunks)
    assert res.ok, out[-3000:]
    return json.loads(out.split("RESULT ", 1)[1].splitlines()[0]), out


@pytest.mark.e2e
def test_a_classifier_trained_on_two_ranks_logs_the_kernels_losses_and_steps(tmp_path):
    kernel = one_process(tmp_path)
    ranks, out = two_ranks(tmp_path, {})
    # the second step's loss and eval_loss follow the first step's gradient: doubled gradients show there too
    assert ranks["losses"] == pytest.approx(kernel["losses"], rel=1e-4), out[-2000:]
    assert ranks["eval_loss"] == pytest.approx(kernel["eval_loss"], rel=1e-4), out[-2000:]
    assert out.count("computes its own mean loss") == 1, out[-2000:]
