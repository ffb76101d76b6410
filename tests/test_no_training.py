"""A notebook with no training call nbddp recognises and no shell line launching one is refused before launch,
naming what was looked for and where the training seems to be, unless ``--every-rank`` asks for every cell on
every rank; one whose training is a shell line's command runs launched (``job.decide_mode``), found at that
line (public notebooks of each pattern too, issue 28); a Python script is read as a notebook
(``nbddp run train.py``). No process is started here."""

from __future__ import annotations

import argparse
import textwrap
from pathlib import Path

import pytest

from nbddp import cli, job
from nbddp.cells import Cell, load_notebook
from nbddp.convert import convert_notebook
from nbddp.convert.launches import find_launches, leading_launch
from nbddp.convert.script import convert_cells
from nbddp.errors import NbddpError
from nbddp.options import RUN_OPTIONS, RunOptions, dest

PUBLIC = Path(__file__).resolve().parent / "corpus" / "public"


def cells(*sources):
    return [Cell(i, textwrap.dedent(s)) for i, s in enumerate(sources, start=1)]


KAGGLE = cells(
    "import pandas as pd\ndf = pd.DataFrame({'x': [1, 2]})\ndf.to_json('train_dataset.json')\n",
    "%%writefile train.py\nimport torch\nfor step in range(3):\n    loss = model(x)\n    print('python other.py')\n",
    "!torchrun --nproc_per_node=2 train.py --epochs 1\n",
    "print('done')\n",
)


def test_a_shell_launch_is_found_with_the_cell_that_wrote_its_script():
    [launch] = find_launches(KAGGLE)
    assert (launch.cell, launch.line, launch.written_by) == (3, 1, 2)
    assert "cell 3, line 1: !torchrun --nproc_per_node=2 train.py" in str(launch)


def test_the_launch_named_is_one_that_starts_processes_where_the_notebook_has_one():
    # a course's practice notebook runs demo scripts with `!python` (cells 17, 25) before its two
    # `!torchrun --nproc_per_node 2` trainings (cells 28, 31): the message names the first of those
    script = convert_notebook(PUBLIC / "efficient_dl" / "practice.ipynb")
    assert [launch.cell for launch in script.launches] == [17, 25, 28, 31]
    assert str(leading_launch(script.launches)).startswith("cell 28, line 1: !torchrun --nproc_per_node 2 ")
    assert any("launches (cell 28, line 1: !torchrun" in w for w in script.warnings), script.warnings
    # with none that starts processes, the first
    assert leading_launch(find_launches(cells("!python prep.py\n", "!python train.py\n"))).cell == 1


@pytest.mark.parametrize("source, line", [
    ("%%bash\ncd /workspace\ntorchrun --nproc_per_node=1 megatron_gpt_pretraining.py trainer.devices=1\n", 3),
    ("x = 1\n!accelerate launch --num_processes 2 train.py\n", 2),
    ("!deepspeed --num_gpus=8 scripts/run_seq2seq_deepspeed.py --deepspeed ds.json\n", 1),
    ("!python -m torch.distributed.run --nproc_per_node 2 train.py\n", 1),
    ("import os\nos.system('python3 scripts/run_sft.py --config r.yaml')\n", 2),
])
def test_each_launch_pattern_is_found(source, line):
    [launch] = find_launches(cells(source))
    assert (launch.cell, launch.line) == (1, line)


@pytest.mark.parametrize("source", [
    "!pip install torch\n", '!pip install "deepspeed==0.8.0" ninja --upgrade\n', "# !torchrun train.py\n",
    "print('run torchrun train.py')\n", "!python --version\n",
])
def test_what_launches_no_training_is_not_a_launch(source):
    assert find_launches(cells(source)) == ()


def test_no_training_call_and_no_launch_is_refused_naming_what_was_looked_for(tmp_path):
    script = convert_cells(cells("import pandas as pd\n", "df = pd.read_csv('x.csv')\nmodel.fit(df)\n"),
                           origin="fit.ipynb")
    assert not script.trains and script.launches == ()
    with pytest.raises(NbddpError) as info:
        job.run_job(job.Job(script, tmp_path, "fit"), RunOptions(runs_dir=tmp_path / "runs", nproc=1))
    message = str(info.value)
    assert "no training call found" in message and "loss.backward()" in message and ".train()" in message
    assert "cell 2, line 2: model.fit(df)" in message
    # every rank would run that fit alone: --every-rank is not the fix here
    assert "--every-rank" not in message and "never synchronised" in message
    assert not (tmp_path / "runs").exists()  # refused before a run directory or a process


def test_a_shell_launch_is_not_refused_but_launched():
    script = convert_cells(KAGGLE, origin="kaggle_ddp.ipynb")
    assert not script.trains and job.decide_mode(script) == "launched"
    job.check_trains(script)
    assert job.decide_mode(script, every_rank=True) == "every-rank"  # asked for: today's conversion


def test_no_training_and_no_launch_still_names_the_option():
    script = convert_cells(cells("print('hello')\n"))
    with pytest.raises(NbddpError, match="cannot tell where it trains.*--every-rank"):
        job.check_trains(script)
    job.check_trains(script, every_rank=True)  # asked for: runs as before


def test_a_kept_job_that_only_loads_its_model_is_not_refused():
    # %%ddp_train --keep of cells that load a model and build a Trainer: later %%ddp cells train it
    script = convert_cells(cells("from transformers import AutoModel\nmodel = AutoModel.from_pretrained('m')\n"))
    with pytest.raises(NbddpError):
        job.decide_mode(script)
    assert job.decide_mode(script, keep=True) == "every-rank"


def test_a_notebook_that_trains_is_not_refused():
    script = convert_cells(cells(
        "optimizer = torch.optim.AdamW(model.parameters())\nfor b in train_loader:\n    model(b).backward()\n"))
    assert script.trains and script.launches == ()
    job.check_trains(script)


def test_every_rank_is_one_run_option_of_the_cli_and_the_magic():
    option = next(o for o in RUN_OPTIONS if o[0] == ("--every-rank",))
    assert dest(option) == "every_rank"
    parser = argparse.ArgumentParser()
    for flags, keywords in RUN_OPTIONS:
        parser.add_argument(*flags, **keywords)
    assert RunOptions.parse(parser.parse_args(["--every-rank", "--nproc", "1"])).every_rank is True
    assert RunOptions.parse(parser.parse_args(["--nproc", "1"])).every_rank is False


def test_the_cli_refuses_with_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    notebook = tmp_path / "nb.py"
    notebook.write_text("print('no training here')\n")
    monkeypatch.chdir(tmp_path)
    assert cli.main(["run", str(notebook), "--nproc", "1"]) == 2
    err = capsys.readouterr().err
    assert "no training call found" in err and "--every-rank" in err and "Traceback" not in err
    assert not (tmp_path / "nbddp_runs").exists()


# ----------------------------------------------------------------------------------- a script as a notebook


def test_a_script_is_one_cell_or_its_percent_cells(tmp_path):
    plain = tmp_path / "train.py"
    plain.write_text("import torch\nx = 1\n")
    assert [(c.index, c.source) for c in load_notebook(plain)[0]] == [(1, "import torch\nx = 1\n")]
    percent = tmp_path / "cells.py"
    percent.write_text("import os\n# %%\na = 1\n# %% [markdown]\n# text\n# %%\nb = 2\n")
    assert [(c.index, c.source) for c in load_notebook(percent)[0]] == [(1, "import os"), (2, "a = 1"), (4, "b = 2")]


def test_a_training_script_converts_as_a_notebook(tmp_path):
    path = tmp_path / "train.py"
    path.write_text("import torch\nmodel = torch.nn.Linear(2, 1)\noptimizer = torch.optim.SGD(model.parameters())\n"
                    "for b in train_loader:\n    model(b).sum().backward()\n    optimizer.step()\n")
    script = convert_notebook(path)
    assert script.trains and "_nbddp.ddp(model)" in script.text
    assert job.prepare_job(path).name == "train"


# ------------------------------------------------------------------------ public notebooks of each pattern

LAUNCHED = {
    "philschmid/fine-tune-llms-in-2025.ipynb": "!python scripts/run_sft.py --config receipes/llama-3-1-8b-qlora.yaml",
    "philschmid/rl-with-llms-in-2025-dpo.ipynb": "!python scripts/dpo/run_dpo.py",
    "philschmid/fsdp-qlora-distributed-llama3.ipynb": "torchrun --nproc_per_node=4 ./scripts/run_fsdp_qlora.py",
    "philschmid/deepseed-flan-t5-summarization.ipynb": "!deepspeed --num_gpus=8 scripts/run_seq2seq_deepspeed.py",
    "nemo/llama3-lora-nemofw.ipynb": "torchrun --nproc_per_node=1 \\",
}


@pytest.mark.parametrize("key", sorted(LAUNCHED))
def test_a_public_notebook_training_from_a_shell_line_runs_launched_from_that_line(key):
    script = convert_notebook(PUBLIC / key)
    assert not script.trains and job.decide_mode(script) == "launched"
    assert any(LAUNCHED[key] in launch.text for launch in script.launches), script.launches
