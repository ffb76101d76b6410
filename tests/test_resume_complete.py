"""``--resume`` takes a checkpoint only when every rank's files are in it: a run killed while rank 1 wrote
its RNG state leaves ``trainer_state.json`` (rank 0's) beside a temporary file, not ``rng_state_1.pth``."""

import json
import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

from nbddp.runtime.resume import finished_steps, last_complete_checkpoint


def checkpoint(root, step, *files):
    d = root / f"checkpoint-{step}"
    d.mkdir()
    for name in ("trainer_state.json", "model.safetensors", *files):
        (d / name).write_text("x")
    return d


def test_a_checkpoint_missing_a_ranks_rng_state_is_passed_over(tmp_path):
    checkpoint(tmp_path, 5, "rng_state_0.pth", "rng_state_1.pth")
    checkpoint(tmp_path, 10, "rng_state_0.pth", ".rng_state_1.pth.k2j4x8")  # rank 1 killed mid-write
    assert last_complete_checkpoint(tmp_path) == str(tmp_path / "checkpoint-5")


def test_a_gap_in_the_ranks_is_incomplete(tmp_path):
    checkpoint(tmp_path, 5, "rng_state_0.pth", "rng_state_1.pth", "rng_state_2.pth")
    checkpoint(tmp_path, 10, "rng_state_0.pth", "rng_state_2.pth")
    checkpoint(tmp_path, 15, "rng_state_0.pth")  # per-rank names mean two ranks at least
    assert last_complete_checkpoint(tmp_path) == str(tmp_path / "checkpoint-5")


def test_any_file_cut_short_makes_it_incomplete(tmp_path):
    checkpoint(tmp_path, 5, "rng_state_0.pth", "rng_state_1.pth")
    checkpoint(tmp_path, 10, "rng_state_0.pth", "rng_state_1.pth", ".optimizer.pt.a8d7f1")
    assert last_complete_checkpoint(tmp_path) == str(tmp_path / "checkpoint-5")


def test_single_process_and_model_only_checkpoints_stay_complete(tmp_path):
    checkpoint(tmp_path, 5, "rng_state.pth")
    assert last_complete_checkpoint(tmp_path) == str(tmp_path / "checkpoint-5")
    checkpoint(tmp_path, 10)  # save_only_model: no RNG state at all
    assert last_complete_checkpoint(tmp_path) == str(tmp_path / "checkpoint-10")
    checkpoint(tmp_path, 15, "rng_state_0.pth", "rng_state_1.pth", ".gitignore")  # a dotfile that is no temp file
    assert last_complete_checkpoint(tmp_path) == str(tmp_path / "checkpoint-15")


# ------------------------------------------------------------------ a training that already finished

def state(root, step, max_steps, epochs=1):
    d = checkpoint(root, step, "rng_state_0.pth", "rng_state_1.pth")
    (d / "trainer_state.json").write_text(json.dumps({"global_step": step, "max_steps": max_steps,
                                                      "num_train_epochs": epochs}))
    return str(d)


def test_a_checkpoint_at_the_last_step_is_a_finished_training(tmp_path):
    done = state(tmp_path, 60, 60)
    assert finished_steps(done, SimpleNamespace(max_steps=60)) == (60, 60)
    assert finished_steps(done, SimpleNamespace(max_steps=100)) is None  # more steps asked now: training goes on
    assert finished_steps(state(tmp_path, 40, 60), SimpleNamespace(max_steps=60)) is None  # halfway: resumed


def test_a_training_in_epochs_is_finished_at_its_own_last_step_for_as_many_epochs(tmp_path):
    done = state(tmp_path, 30, 30, epochs=3)
    assert finished_steps(done, SimpleNamespace(max_steps=-1, num_train_epochs=3.0)) == (30, 30)
    assert finished_steps(done, SimpleNamespace(max_steps=-1, num_train_epochs=5.0)) is None


def test_a_state_that_cannot_be_read_is_no_finished_training(tmp_path):
    d = checkpoint(tmp_path, 60)  # trainer_state.json holds "x"
    assert finished_steps(str(d), SimpleNamespace(max_steps=60)) is None


FINISHED = textwrap.dedent('''
    import json, sys
    import torch
    from safetensors.torch import load_file
    from nbddp.runtime import resume, saves
    saves.install()
    assert resume.attach()
    from transformers import Trainer, TrainerCallback, TrainingArguments
    from nbddp import demo

    tok = demo.build_tokenizer()
    rows = [{"input_ids": tok(r["text"])["input_ids"], "labels": tok(r["text"])["input_ids"]}
            for r in demo.arithmetic_dataset(64)]
    steps = []

    class Steps(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            steps.append(state.global_step)

    def train():
        torch.manual_seed(0)
        args = TrainingArguments(output_dir=sys.argv[1], max_steps=4, per_device_train_batch_size=1, save_steps=4,
                                 report_to="none", use_cpu=True, learning_rate=1e-2)
        trainer = Trainer(model=demo.build_model(tok), args=args, train_dataset=rows, callbacks=[Steps()])
        return trainer, trainer.train()

    train()
    trained = list(steps)
    steps.clear()
    trainer, output = train()  # the same run again with --resume: its checkpoint is its last step
    saved = load_file(sys.argv[1] + "/checkpoint-4/model.safetensors")
    weights = dict(trainer.model.named_parameters())
    same = all(torch.equal(weights[name].detach(), value) for name, value in saved.items() if name in weights)
    print(json.dumps({"trained": trained, "again": steps, "global_step": output.global_step, "same": same}))
''')


@pytest.mark.e2e
def test_resuming_a_finished_training_trains_nothing_and_keeps_its_weights(tmp_path):
    """The Trainer would train step 5 of 4 and save checkpoint-5 over the result."""
    out = tmp_path / "outputs"
    proc = subprocess.run([sys.executable, "-c", FINISHED, str(out)], capture_output=True, text=True, timeout=400,
                          env={**os.environ, "NBDDP_RESUME": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (f"nbddp: --resume: {out / 'checkpoint-4'} is step 4 of 4: this training already finished; its weights "
            "are loaded and it is not trained again") in proc.stdout
    assert json.loads(proc.stdout.splitlines()[-1]) == {"trained": [1, 2, 3, 4], "again": [], "global_step": 4,
                                                        "same": True}
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-4"]  # no checkpoint-5 saved over the result
