"""A kept job's ``%%ddp`` cell calling ``trainer.predict``/``evaluate`` over rows that do not fill the ranks' last
batches computes what the kernel's one process computes (``runtime/trainer_rows.py``, installed at the kept job's
start), while the kernel's Stop is looked at on every rank at the same steps (``serve``): the rank whose block has a
batch fewer takes the look its missing step would have taken. An evaluation inside ``train()`` stays the
Trainer's own."""

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from nbddp.launch import launch, new_run_dir, plan
from nbddp.options import RunOptions
from nbddp.runtime import trainer_rows

JOB = Path(__file__).resolve().parent / "jobs" / "kept_trainer_rows.py"


@pytest.mark.e2e
def test_a_kept_cells_trainer_prediction_over_uneven_rows_is_one_processs_and_its_stop_looks_agree(tmp_path):
    one, ranks = tmp_path / "one", tmp_path / "ranks"
    one.mkdir()
    ranks.mkdir()
    subprocess.run([sys.executable, str(JOB), "one"], cwd=one, check=True, capture_output=True, timeout=180)
    chunks = []
    res = launch(plan(JOB, new_run_dir(tmp_path / "runs", "kept_trainer_rows"), RunOptions(timeout_s=180), nproc=2,
                      cwd=ranks, env={}), sink=lambda stream, text: chunks.append(text))
    out = "".join(chunks)
    assert res.ok, out[-3000:]
    for name in ("submission.csv", "metrics.json"):
        assert (ranks / name).read_bytes() == (one / name).read_bytes(), name
    assert json.loads((ranks / "metrics.json").read_text())["test_rows"] == 19
    # blocks of 2 and 3 batches; each rank's Stop callback looked at 3 steps of the evaluate call, the last one
    # on rank 0 after its block (a look at every step: without it rank 1's look would meet rank 0's gather)
    assert json.loads(out.split("RESULT ", 1)[1].splitlines()[0]) == {"steps": [[3], [3]]}, out[-3000:]
    assert "each rank computes its own block of whole batches" in out


def test_an_evaluation_inside_training_is_the_trainers_own(monkeypatch):
    from nbddp.runtime import dist

    monkeypatch.setattr(dist, "rank_info", lambda: SimpleNamespace(world_size=2))
    args = SimpleNamespace(per_device_eval_batch_size=4, batch_eval_metrics=False, include_for_metrics=[])
    calls = []

    def evaluation_loop(self, dataloader, description="", metric_key_prefix="eval"):
        calls.append(dataloader)
        return "the Trainer's"

    def evaluate(self, eval_dataset=None):
        return "the Trainer's"

    loop = trainer_rows._in_blocks(evaluation_loop)
    checked = trainer_rows._make_checked("evaluate", "eval_dataset")(evaluate)
    training = SimpleNamespace(args=args, is_in_train=True)
    rows = SimpleNamespace(dataset=list(range(10)))  # 10 rows in steps of 8: padded
    assert loop(training, rows) == "the Trainer's" and calls == [rows]
    assert checked(training, iter(range(10))) == "the Trainer's"  # no length: refused outside a training only
    with pytest.raises(RuntimeError, match="no length"):
        checked(SimpleNamespace(args=args, is_in_train=False), iter(range(10)))


def test_rows_that_pad_a_sharded_models_last_step_are_refused(monkeypatch):
    from nbddp.runtime import dist

    monkeypatch.setattr(dist, "rank_info", lambda: SimpleNamespace(world_size=2))
    trainer = SimpleNamespace(args=SimpleNamespace(per_device_eval_batch_size=4, batch_eval_metrics=False,
                                                   include_for_metrics=[]))
    monkeypatch.setenv("NBDDP_STRATEGY", "fsdp")
    assert "sharded over the ranks (fsdp)" in trainer_rows.unsplittable(trainer, list(range(10)))
    assert trainer_rows.unsplittable(trainer, list(range(16))) is None  # the Trainer's own split pads nothing
    monkeypatch.setenv("NBDDP_STRATEGY", "ddp")
    assert trainer_rows.unsplittable(trainer, list(range(10))) is None
