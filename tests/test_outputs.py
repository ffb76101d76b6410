"""Output folders seen before launch: read from the code, checked writable, claimed against another live job;
and a full disk named with its folder."""

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import ROOT
from nbddp.cells import cells_from_sources
from nbddp.convert import convert_cells
from nbddp.errors import LaunchError
from nbddp.launch import RankFailure
from nbddp.outputs import OutputFolder, check_writable, claimed, explain_no_space, output_folders


def folders(sources, cwd):
    return [(str(f.path.relative_to(cwd)), f.cell, f.line) for f in output_folders(convert_cells(cells_from_sources(sources)), cwd)]


def test_the_folders_the_code_names_are_read_with_cell_and_line(tmp_path):
    found = folders([
        'import os, torch\nfrom pathlib import Path\nfrom transformers import TrainingArguments, Trainer\nOUT = "runs/exp1"',
        'args = TrainingArguments(\n    output_dir=OUT + "/ckpt",\n    max_steps=3)\ntrainer = Trainer(model=None, args=args)\n'
        'trainer.train()',
        'model.save_pretrained(f"{OUT}/adapter")\ntorch.save(model.state_dict(), os.path.join("weights", "m.pt"))\n'
        'tokenizer.save_pretrained(Path("tok") / "v1")\ntrainer.save_model("final")',
    ], tmp_path)
    assert found == [("runs/exp1/ckpt", 2, 2), ("runs/exp1/adapter", 3, 1), ("weights", 3, 2), ("tok/v1", 3, 3),
                     ("final", 3, 4)]


def test_what_only_runtime_knows_is_left_alone(tmp_path):
    found = folders([
        'import torch, time\nout = "a"\nout = "b"\nfor i in range(3):\n    torch.save({}, f"ckpt_{i}/m.pt")\n'
        'model.save_pretrained(out)\ntorch.save({}, make_path())\nconfig = SFTConfig(output_dir=args.out)\n'
        'torch.save({}, "model.pt")',
    ], tmp_path)
    assert found == [(".", 1, 9)]  # only the plain file in the ranks' folder


@pytest.mark.parametrize("make", ["file", "proc"])
def test_an_unwritable_folder_is_refused_at_its_cell_and_line(tmp_path, make):
    if make == "file":
        (tmp_path / "outputs").write_text("a file where the folder should be")
        path = tmp_path / "outputs" / "ckpt"
    else:
        path = Path("/proc/nbddp-no-such/outputs")  # a mount where nobody, root included, makes folders
    with pytest.raises(LaunchError, match=r"^cell 4, line 2: SFTConfig\(output_dir=…\) writes to .*(cannot be made|not writable)"):
        check_writable([OutputFolder(path, 4, 2, "SFTConfig(output_dir=…)")])


def test_a_writable_or_makeable_folder_passes_and_nothing_is_made(tmp_path):
    check_writable([OutputFolder(tmp_path, 1, 1, "x"), OutputFolder(tmp_path / "new" / "deeper", 1, 2, "y")])
    assert list(tmp_path.iterdir()) == []


CLAIMER = textwrap.dedent('''
    import sys, time
    from pathlib import Path
    from nbddp.outputs import OutputFolder, claimed
    with claimed([OutputFolder(Path(sys.argv[1]), 1, 1, "x")], Path("/runs/other")) as warnings:
        print("claimed", warnings, flush=True)
        time.sleep(600)
''')


@pytest.mark.e2e
def test_a_folder_another_live_job_writes_is_warned_about_until_it_ends(tmp_path):
    out = tmp_path / "out"
    other = subprocess.Popen([sys.executable, "-c", CLAIMER, str(out)], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    try:
        assert other.stdout.readline().strip() == "claimed []"
        with claimed([OutputFolder(out, 2, 3, "torch.save(…)")], tmp_path / "run") as warnings:
            (warning,) = warnings
            assert f"another job (pid {other.pid}, run directory /runs/other) is writing to {out}" in warning
            assert "(cell 2, line 3)" in warning
    finally:
        other.kill()
        other.wait()
    with claimed([OutputFolder(out, 2, 3, "torch.save(…)")], tmp_path / "run") as warnings:
        assert warnings == []  # a dead job's claim is taken over
        with claimed([OutputFolder(out, 2, 3, "torch.save(…)")], tmp_path / "run2") as again:
            assert again == []  # the same process running a job again is no other job


def failure(message, traceback=""):
    return RankFailure(rank=1, message=message, traceback=traceback, cell=2, line=3)


def test_a_full_disk_is_named_from_the_errno_path_or_the_trainer_folder(tmp_path):
    f = explain_no_space(failure("OSError: [Errno 28] No space left on device: 'ckpt/x.pt'"), tmp_path)
    assert f.message.startswith(f"No space left on device: writing to {tmp_path / 'ckpt'} (")
    assert f.message.endswith("free); OSError: [Errno 28] No space left on device: 'ckpt/x.pt'")
    records = [{"event": "begin", "output_dir": str(tmp_path / "trainer_out")}]
    f = explain_no_space(failure("RuntimeError: PytorchStreamWriter failed writing file data/0: file write failed"),
                         tmp_path, records)
    assert f.message.startswith(f"No space left on device: writing to {tmp_path / 'trainer_out'} (")
    other = failure("ValueError: nothing to do with disks")
    assert explain_no_space(other, tmp_path) is other and explain_no_space(None, tmp_path) is None


def test_a_notebook_shows_the_warning_rather_than_fold_it_with_the_start_up_lines():
    from nbddp.display import RankLog

    log = RankLog()
    log.feed("stdout", "nbddp: 2 process(es), backend gloo\nnbddp: warning: another job (pid 7) is writing to out\n")
    assert log.startup == ["nbddp: 2 process(es), backend gloo"]
    assert log.lines() == ["nbddp: warning: another job (pid 7) is writing to out"]
