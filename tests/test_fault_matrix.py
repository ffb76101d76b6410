"""The rest of the fault matrix on real runs (torchrun, gloo, 2 CPU ranks): a full disk, a stopped launcher,
the last step reported; each named, no process left behind."""

import os
import re
import shutil
import signal
import time

import pytest

from conftest import no_rank_processes
from nbddp.display.view import QuietView
from nbddp.job import run_job
from nbddp.options import RunOptions
from test_faults import IMPORTS, nbddp_cli, processes_with, rank_log_says, reaper, wait_for  # noqa: F401
from views import Said

pytestmark = pytest.mark.e2e

#: What torch's own writer raises when the disk fills mid-save (torch/csrc/.../inline_container.cc).
TORCH_DISK_FULL = "[enforce fail at inline_container.cc:672] . unexpected pos 8768 vs 8656"


def test_a_save_that_fills_the_disk_is_named_with_its_folder_and_free_space(tmp_path, notebook, reaper):
    out = tmp_path / "out"
    nb = notebook([
        IMPORTS + "\nimport torch.serialization",
        f"weights = {{'w': torch.ones(10)}}\ndist.barrier()\nos.makedirs({str(out)!r}, exist_ok=True)",
        # torch's zip writer fails the way it does on a full disk; everything above it is the real torch.save
        f"def full_disk(*args, **kwargs):\n    raise RuntimeError({TORCH_DISK_FULL!r})\n"
        f"torch.serialization._save = full_disk\n"
        f"if dist.get_rank() == 0:\n    torch.save(weights, {str(out / 'model.pt')!r})\n"
        f"else:\n    time.sleep(600)",
    ])
    result = run_job(nb, RunOptions(every_rank=True, nproc=2, runs_dir=tmp_path / "runs"), QuietView()).run
    f = result.failure
    assert (f.rank, f.cell) == (0, 3)
    assert f.message.startswith(f"No space left on device: writing to {out} (")
    number, unit = re.search(r"\(([\d.]+) (bytes|kB|MB|GB|TB) free", f.message).groups()
    said = float(number) * {"bytes": 1, "kB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12}[unit]
    assert abs(said - shutil.disk_usage(out).free) <= max(0.1 * said, 1e6)
    assert TORCH_DISK_FULL in f.message  # torch's own words are kept
    assert not list(out.iterdir())  # no half-written file, no temporary file
    assert no_rank_processes(str(result.run_dir))


def test_an_unwritable_output_folder_is_refused_before_launch(tmp_path, notebook):
    (tmp_path / "outputs").write_text("a file where the Trainer's folder should be")
    nb = notebook(["from transformers import TrainingArguments",
                   "args = TrainingArguments(\n    output_dir='outputs/run1',\n    max_steps=60)\nprint('trained')"])
    proc = nbddp_cli("run", "--every-rank", nb, "--nproc", "2", "--runs-dir", tmp_path / "runs", cwd=tmp_path)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 2, err
    assert (f"nbddp: error: cell 2, line 2: TrainingArguments(output_dir=…) writes to {tmp_path / 'outputs' / 'run1'}, "
            f"which cannot be made: {tmp_path / 'outputs'} is a file") in err
    assert "trained" not in out and not (tmp_path / "runs").exists()  # refused before anything ran


SAVING = IMPORTS + "\nt = torch.ones(1)\nos.makedirs('out', exist_ok=True)"


def test_a_second_job_writing_the_same_output_folder_is_warned_and_so_is_the_first(tmp_path, notebook, reaper):
    first = notebook([SAVING, "for i in range(100000):\n    dist.all_reduce(t)\n    torch.save(t, 'out/a.pt')\n"
                              "    print('step', i, flush=True)\n    time.sleep(0.05)"], name="first.ipynb")
    second = notebook([SAVING, "dist.all_reduce(t)\ntorch.save(t, 'out/b.pt')"], name="second.ipynb")
    runs = tmp_path / "runs"
    proc = nbddp_cli("run", "--every-rank", first, "--nproc", "2", "--runs-dir", runs, cwd=tmp_path)
    try:
        wait_for(lambda: rank_log_says(runs, 1, "step 3"), 300, "the first job stepping")
        (first_run,) = runs.iterdir()
        said = []
        result = run_job(second, RunOptions(every_rank=True, nproc=2, runs_dir=tmp_path / "runs2"), Said(said)).run
        assert result.ok
        warning = f"nbddp: warning: another job (pid {proc.pid}, run directory {first_run}) is writing to {tmp_path / 'out'} too"
        assert warning in "".join(said)
        second_run = result.run_dir
    finally:
        proc.send_signal(signal.SIGINT)
        _, first_said = proc.communicate(timeout=60)
    # both are warned: the first job, already running, heard of the second in its stream
    assert (f"nbddp: warning: another job (pid {os.getpid()}, run directory {second_run}) started writing to "
            f"{tmp_path / 'out'} too: their checkpoints and saves will overwrite each other") in first_said
    said.clear()
    result = run_job(second, RunOptions(every_rank=True, nproc=2, runs_dir=tmp_path / "runs2"), Said(said)).run
    assert result.ok and "another job" not in "".join(said)  # the first job's claim ended with it
    assert no_rank_processes(str(tmp_path))


LOOP = "t = torch.ones(1)\nfor i in range(100000):\n    dist.all_reduce(t)\n    print('step', i, flush=True)\n    time.sleep(0.05)"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_stop_signal_to_the_cli_stops_every_rank_and_says_where_they_were(tmp_path, notebook, reaper, sig):
    nb = notebook([IMPORTS, LOOP])
    runs = tmp_path / "runs"
    proc = nbddp_cli("run", "--every-rank", nb, "--nproc", "2", "--runs-dir", runs, cwd=tmp_path)
    try:
        wait_for(lambda: rank_log_says(runs, 1, "step 3"), 300, "both ranks stepping")
        (run_dir,) = runs.iterdir()
        proc.send_signal(sig)
        wait_for(lambda: not processes_with(str(run_dir)), 5, "every rank to end")
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 128 + sig, err[-2000:]
    assert f"nbddp: stopped by {signal.Signals(sig).name}; every rank has been stopped." in err
    assert "rank 1 was at cell 2, line " in err  # where each rank was
    assert f"run directory: {run_dir}" in err and err.count(str(run_dir)) == 1, err  # said once


API_JOB = """
import sys
from nbddp.job import run_job
from nbddp.options import RunOptions
run_job(sys.argv[1], RunOptions(every_rank=True, nproc=2, runs_dir=sys.argv[2]))
print("launch returned", flush=True)
"""


def test_a_stop_signal_to_a_process_using_the_api_ends_it_after_the_ranks(tmp_path, notebook, reaper):
    import subprocess
    import sys

    from conftest import ROOT

    nb = notebook([IMPORTS, LOOP])
    runs = tmp_path / "runs"
    proc = subprocess.Popen([sys.executable, "-c", API_JOB, str(nb), str(runs)], cwd=tmp_path, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**__import__("os").environ, "PYTHONPATH": str(ROOT / "src")})
    try:
        wait_for(lambda: rank_log_says(runs, 1, "step 3"), 300, "both ranks stepping")
        (run_dir,) = runs.iterdir()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGTERM  # ended by the signal, as it would have been without a job
    assert "launch returned" not in out
    assert "nbddp: stopped by SIGTERM; every rank has been stopped." in err
    assert no_rank_processes(str(run_dir))


TRAINER = '''import torch
from nbddp import demo
from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainerCallback, TrainingArguments
from transformers import DataCollatorForLanguageModeling
path = demo.tiny_model()
tokenizer = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
data = demo.arithmetic_dataset(256).map(
    lambda row: tokenizer(row["text"], padding="max_length", max_length=8, truncation=True), remove_columns=["text"])'''

STOP_AT_37 = '''class StopAt37(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 37:
            raise RuntimeError("stopped at step 37")
args = TrainingArguments(output_dir="out", max_steps=200, per_device_train_batch_size=1, save_strategy="no",
                         report_to="none", use_cpu=True, logging_steps=1000)
trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[StopAt37()],
                  data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False))
trainer.train()'''


def test_the_last_trainer_step_said_is_the_last_completed_one(tmp_path, notebook, reaper):
    from nbddp.launch import where_ranks_were

    nb = notebook([TRAINER, STOP_AT_37])
    result = run_job(nb, RunOptions(nproc=2, runs_dir=tmp_path / "runs"), QuietView()).run
    assert result.failure and "stopped at step 37" in result.failure.message
    assert result.last_step == (37, 200)
    assert "last Trainer step: 37 of 200" in where_ranks_were(result)
    assert no_rank_processes(str(result.run_dir))


FILL_THE_RUNS_DISK = '''import os
class FillTheDisk(TrainerCallback):
    """At step 3, rank 0 fills the disk the run directory is on, as another program would."""
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 3 and state.is_world_process_zero:
            fd = os.open(os.path.join(os.environ["NBDDP_RUN_DIR"], "..", "ballast"), os.O_WRONLY | os.O_CREAT)
            try:
                while True:
                    os.write(fd, b"x" * 4096)
            except OSError:
                os.close(fd)
args = TrainingArguments(output_dir="out", max_steps=40, per_device_train_batch_size=1, save_strategy="no",
                         report_to="none", use_cpu=True, logging_steps=1)
trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[FillTheDisk()],
                  data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False))
trainer.train()
trainer.save_model("final")'''


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB tmpfs, where this machine lets the tests mount one (root, with mount rights: not in most
    containers), else the test is skipped: ``test_full_disk.py`` simulates the disk's refusal in the fast lane."""
    import subprocess

    folder = tmp_path / "small_disk"
    folder.mkdir()
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(folder)], capture_output=True,
                           text=True)
    if mount.returncode != 0:
        pytest.skip(f"a small tmpfs cannot be mounted here ({mount.stderr.strip() or mount.returncode}); "
                    "test_full_disk.py simulates the full disk")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], capture_output=True)


def test_a_full_runs_disk_drops_nbddps_records_and_the_training_finishes(tmp_path, notebook, reaper, small_disk):
    """Rank 0 died printing its log at 60/60 before it saved the adapter; said as "torchrun exited with 1"."""
    said = []
    nb = notebook([TRAINER, FILL_THE_RUNS_DISK])
    result = run_job(nb, RunOptions(nproc=2, runs_dir=small_disk), Said(said)).run
    assert result.ok, "".join(map(str, said))[-3000:]
    assert (tmp_path / "final" / "model.safetensors").is_file()  # what the training made is saved
    assert (f"nbddp: warning: the disk of the run directory {result.run_dir} is full (" in "".join(said))
    assert no_rank_processes(str(result.run_dir))
