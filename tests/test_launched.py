"""A notebook whose training is a command it launches runs as its kernel would: its cells once, in one
process, and the launched training on every rank, under nbddp's supervision (``nbddp.launched``).

The notebook is the Kaggle 2×T4 DDP recipe (``%%writefile train.py`` + ``!torchrun --nproc_per_node=… train.py``)
with a data-prep cell before it and a post cell after. Each is run once with ``nbddp run --nproc 2`` and a
small ``NBDDP_TIMEOUT``: before launched mode, rank 1 waited in a barrier on the shell line (torn down at the
timeout), the prep and post cells ran on both ranks, and the inner torchrun inherited nbddp's torchelastic
variables.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nbddp.agent import forked_ranks
from nbddp.cells import cells_from_sources
from nbddp.convert.script import convert_cells
from nbddp.errors import NbddpError
from nbddp.job import check_trains, decide_mode
from nbddp.launched import clean_env, fit_nproc, torchrun_argv

ROOT = Path(__file__).resolve().parent.parent

PREP = """\
import json, os
with open("prep_runs.txt", "a") as fh:
    fh.write(f"{os.getpid()}\\n")
json.dump([[float(i), float(2 * i)] for i in range(32)], open("train_dataset.json", "w"))
"""

TRAIN = """\
%%writefile train.py
import json, os
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
rank, world = dist.get_rank(), int(os.environ["WORLD_SIZE"])
with open(f"seen-{rank}.txt", "a") as fh:
    started = b"nbddp.agent" in open("/proc/self/cmdline", "rb").read()  # forked from nbddp's agent
    fh.write(json.dumps({"world": world, "pid": os.getpid(), "forked": started}) + "\\n")
data = torch.tensor(json.load(open("train_dataset.json")))
model = DDP(torch.nn.Linear(1, 1))
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
for x, y in data[rank::world]:
    loss = (model(x.view(1, 1)) - y) ** 2
    opt.zero_grad(); loss.sum().backward(); opt.step()
if os.environ.get("FAIL_AT_RANK") == str(rank):
    raise RuntimeError("launched training failed on purpose")
if rank == 0:
    torch.save(model.module.state_dict(), "model.pt")
    print("trained on", world, "ranks", flush=True)
dist.destroy_process_group()
"""

LAUNCH = "!torchrun --nproc_per_node=4 train.py"

POST = """\
import os
with open("post_runs.txt", "a") as fh:
    fh.write(f"{os.getpid()} {os.path.exists('model.pt')}\\n")
"""


def _notebook(tmp_path: Path) -> Path:
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(s) for s in (PREP, TRAIN, LAUNCH, POST)]
    path = tmp_path / "kaggle_ddp.ipynb"
    nbformat.write(nb, path)
    return path


# ------------------------------------------------------------------------------------ decisions (no process)


def test_a_shell_launch_is_launched_mode_and_names_its_writefile_cell():
    script = convert_cells(cells_from_sources([PREP, TRAIN, LAUNCH, POST]))
    assert not script.trains and decide_mode(script) == "launched"
    launch = script.launches[0]
    assert (launch.cell, launch.line, launch.written_by, launch.script, launch.first_line) == (3, 1, 2, "train.py", 2)


@pytest.mark.parametrize("line", ["!python scripts/run_sft.py --config recipes/a.yaml",
                                  "%%bash\ncd x\ntorchrun --nproc_per_node=1 train.py",
                                  "!deepspeed llava/train/train_mem.py --deepspeed zero3.json",
                                  "!accelerate launch --num_processes 2 run.py",
                                  "!python -m torch.distributed.run --nproc_per_node 4 train.py",
                                  "!{sys.executable} -m torch.distributed.run --nproc_per_node 2 train.py",
                                  "!python -m axolotl.cli.train cfg.yml",
                                  "!accelerate launch -m axolotl.cli.train cfg.yml",
                                  "!axolotl train cfg.yml"])
def test_each_launch_pattern_is_found(line):
    script = convert_cells(cells_from_sources(["import os", line]))
    assert decide_mode(script) == "launched" and script.launches[0].cell == 2


@pytest.mark.parametrize("line", ["!sleep 20  # then python scripts/run_sft.py",
                                  "!echo '# not a comment' # torchrun train.py",
                                  "!ls -la # see train.py"])
def test_a_shell_comment_naming_a_command_is_no_launch(line):
    script = convert_cells(cells_from_sources(["import os", line]))
    assert script.launches == ()


def test_no_training_call_is_refused_naming_what_was_looked_for_and_the_option():
    script = convert_cells(cells_from_sources(["import keras_like as k", "model = k.Model()\nmodel.fit(x, y)"]))
    with pytest.raises(NbddpError) as err:
        decide_mode(script)
    message = str(err.value)
    assert "no training call found" in message and "loss.backward()" in message
    assert "cell 2, line 2: model.fit(x, y)" in message and "--every-rank" not in message  # it would train alone
    assert decide_mode(script, every_rank=True) == "every-rank"
    check_trains(script, every_rank=True)


def test_the_process_count_is_fitted_with_a_note_and_a_free_port(tmp_path):
    argv, note = torchrun_argv(["--nproc_per_node", "4", "train.py", "--lr", "1"], 2, tmp_path)
    assert "--nproc-per-node=2" in argv and "4" not in argv[:-3] and argv[-3:] == ["train.py", "--lr", "1"]
    assert "--standalone" in argv and "asks for --nproc-per-node 4" in note
    assert argv[1:3] == ["-m", "nbddp.agent"]  # torchrun's main, its ranks started as nbddp's are
    assert fit_nproc(["--num_processes=2", "x.py"], "--num_processes", ("--num_processes",), 2) == (
        ["--num_processes=2", "x.py"], None)


def test_the_launched_command_gets_none_of_the_jobs_variables():
    env = clean_env({"TORCHELASTIC_ERROR_FILE": "/r/error.json", "RANK": "0", "WORLD_SIZE": "1",
                     "MASTER_PORT": "29500", "PATH": "/bin", "HF_HOME": "/h",
                     "NBDDP_FAILURES": "/r/failures.json", "NBDDP_LAUNCHER_PID": "7"})  # the job's agent's
    assert env == {"PATH": "/bin", "HF_HOME": "/h", "NBDDP_LAUNCHED_INNER": "1"}


def test_export_refuses_a_launched_notebook_before_writing(tmp_path):
    from nbddp.export import export_kaggle

    nb = _notebook(tmp_path)
    with pytest.raises(NbddpError) as err:
        export_kaggle(nb, tmp_path / "out", kernel_id="me/launched")
    message = str(err.value)
    assert "cell 3, line 1" in message and "!torchrun --nproc_per_node=4 train.py" in message, message
    assert "nbddp run" in message and not (tmp_path / "out").exists()


def test_export_refuses_no_training_call_as_run_does_unless_every_rank(tmp_path):
    import nbformat

    from nbddp.export import export_kaggle

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(s) for s in ("import keras_like as k", "model = k.Model()\nmodel.fit(x, y)")]
    nbformat.write(nb, tmp_path / "fit.ipynb")
    with pytest.raises(NbddpError) as err:
        export_kaggle(tmp_path / "fit.ipynb", tmp_path / "out", kernel_id="me/fit-run")
    assert "no training call found" in str(err.value) and "never synchronised" in str(err.value)
    assert not (tmp_path / "out").exists()
    result = export_kaggle(tmp_path / "fit.ipynb", tmp_path / "out", kernel_id="me/fit-run", every_rank=True)
    assert "model.fit(x, y)" in result.script.read_text()


def test_export_takes_every_rank_from_its_command_line():
    import argparse

    from nbddp.export.options import OPTIONS, export_options

    parser = argparse.ArgumentParser()
    for flags, kwargs in OPTIONS:
        parser.add_argument(*flags, **kwargs)
    args = parser.parse_args(["--kaggle", "out", "--id", "me/x", "--every-rank"])
    assert export_options(args)["every_rank"] is True
    assert export_options(parser.parse_args(["--kaggle", "out", "--id", "me/x"]))["every_rank"] is False


# ------------------------------------------------------------------------------------------- the runs


def _run(tmp_path: Path, nb: Path, *more: str, **env) -> subprocess.CompletedProcess:
    environ = {**os.environ, "NBDDP_TIMEOUT": "8", "NBDDP_RUNS": str(tmp_path / "runs"), **env}
    environ.pop("RANK", None)
    return subprocess.run([sys.executable, "-m", "nbddp.cli", "run", str(nb), "--nproc", "2", *more],
                          cwd=tmp_path, env=environ, capture_output=True, text=True, timeout=300)


@pytest.mark.e2e
def test_kaggle_writefile_torchrun_runs_once_and_trains_on_every_rank(tmp_path):
    nb = _notebook(tmp_path)
    proc = _run(tmp_path, nb)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    # the launched script's ranks each saw WORLD_SIZE 2, exactly once
    for rank in (0, 1):
        seen = [json.loads(ln) for ln in (tmp_path / f"seen-{rank}.txt").read_text().splitlines()]
        assert [s["world"] for s in seen] == [2]
        # started as nbddp's ranks are: forked where that is possible, so no rank meets Python's finalization,
        # where gloo's worker threads can abort it after its work is done (``nbddp.launched``)
        assert [s["forked"] for s in seen] == [forked_ranks.possible_here()]
    assert not (tmp_path / "seen-2.txt").exists()
    # prep and post cells ran once, in one process; the model was written before the post cell
    assert len((tmp_path / "prep_runs.txt").read_text().splitlines()) == 1
    assert (tmp_path / "post_runs.txt").read_text().split()[1:] == ["True"]
    # rank 0 streamed, the note on the process count, every rank's log kept
    assert "trained on 2 ranks" in out and "asks for --nproc-per-node 4" in out
    run_dir = next((tmp_path / "runs").iterdir())
    logs = {p.parent.name for p in (run_dir / "launched").rglob("stdout.log")}
    assert logs == {"0", "1"}
    # no barrier waited on the shell line: nothing timed out
    assert "Timed out" not in out


#: A notebook's own process group, as a course's data-parallel practice starts one before its `%%writefile` +
#: `!torchrun` cells (``tests/corpus/public/efficient_dl/practice.ipynb``, cells 4 and 6): forked children
#: meeting at an env:// rendezvous of their own, on a port of their own. Before the fix, the notebook's
#: process kept torchelastic's ``TORCHELASTIC_USE_AGENT_STORE``: every child was a client of a store nobody
#: served, and the cell hung until the job's --timeout.
OWN_GROUP = """\
import os, socket
import torch
import torch.distributed as dist
from torch.multiprocessing import Process

def init_process(rank, size, port):
    os.environ['MASTER_ADDR'] = '127.0.0.1'
    os.environ['MASTER_PORT'] = str(port)
    dist.init_process_group('gloo', rank=rank, world_size=size)
    tensor = torch.ones(1)
    dist.all_reduce(tensor)
    with open(f"group-{rank}.txt", "w") as fh:
        fh.write(str(int(tensor.item())))

with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
processes = [Process(target=init_process, args=(rank, 2, port)) for rank in range(2)]
for p in processes:
    p.start()
for p in processes:
    p.join()
"""


@pytest.mark.e2e
def test_a_notebooks_own_process_group_runs_as_in_a_kernel(tmp_path):
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(s) for s in (OWN_GROUP, PREP, TRAIN, LAUNCH)]
    path = tmp_path / "own_group.ipynb"
    nbformat.write(nb, path)
    proc = _run(tmp_path, path, "--timeout", "40")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert [(tmp_path / f"group-{r}.txt").read_text() for r in (0, 1)] == ["2", "2"]


@pytest.mark.e2e
def test_a_failed_launched_rank_is_said_at_its_writefile_cell_and_line(tmp_path):
    nb = _notebook(tmp_path)
    proc = _run(tmp_path, nb, "--env", "FAIL_AT_RANK=1")
    out = proc.stdout + proc.stderr
    line = TRAIN.splitlines().index('    raise RuntimeError("launched training failed on purpose")') + 1
    assert f"launched rank 1 failed in cell 2, line {line} (train.py, line {line - 1})" in out, out[-4000:]
    assert "launched training failed on purpose" in out
    # the later cells still ran, as in the kernel, but the job's result says it failed
    assert len((tmp_path / "post_runs.txt").read_text().splitlines()) == 1
    assert proc.returncode == 1, out[-4000:]
    report = proc.stderr[proc.stderr.rindex("nbddp: launched rank 1 failed"):]
    assert report.startswith(f"nbddp: launched rank 1 failed in cell 2, line {line}: RuntimeError: launched "
                             "training failed on purpose\n    raise RuntimeError"), report
    # torchrun's report and the frames of nbddp's agent that started the rank are not the person's to read:
    # the rank's own traceback (in its log, and in the report) starts at the script, its frames at their cell
    assert "ChildFailedError" not in out and "nbddp/agent" not in out and "runpy" not in out, out[-4000:]
    assert f'File "train.py", line {line - 1} (cell 2, line {line}), in <module>' in report, report
    log = next((tmp_path / "runs").rglob("launched/launch-1/logs/*/attempt_0/1/stderr.log")).read_text()
    assert "forked_ranks" not in log and 'File "train.py", line' in log, log


def test_a_launched_failure_is_the_cells_error_naming_its_rank_cell_and_line(tmp_path):
    from nbddp.display.text import outcome_error
    from nbddp.job import JobResult
    from nbddp.launch.postmortem import RunResult
    from nbddp.launched import failure_of, record_failure

    (tmp_path / "launched").mkdir()
    record_failure(tmp_path / "launched", rank=1, message="RuntimeError: boom", traceback="Traceback …\nRuntimeError: boom",
                   cell=2, line=19, source='raise RuntimeError("boom")')
    failure = failure_of(tmp_path / "launched")
    run = RunResult(returncode=1, run_dir=tmp_path, script=tmp_path / "script.py", duration_s=1.0, failure=failure)
    error = outcome_error(JobResult(run, tmp_path))
    assert str(error).startswith("launched rank 1 failed in cell 2, line 19: RuntimeError: boom"), str(error)
    assert failure_of(tmp_path / "nothing") is None


PLAIN = """\
%%writefile scripts/train_plain.py
import argparse, json, os
import torch

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=1)
args = parser.parse_args()
with open(f"plain-seen-{os.environ.get('RANK', 'single')}.txt", "a") as fh:
    fh.write(json.dumps({"world": int(os.environ.get("WORLD_SIZE", 1))}) + "\\n")
data = torch.tensor(json.load(open("train_dataset.json")))
loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)
model = torch.nn.Linear(1, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
for epoch in range(args.epochs):
    for batch in loader:
        loss = ((model(batch[:, :1]) - batch[:, 1:]) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
torch.save(model.state_dict(), "plain.pt")
print("plain training done", flush=True)
"""


@pytest.mark.e2e
def test_python_of_a_plain_training_script_runs_converted_on_every_rank(tmp_path):
    import nbformat

    (tmp_path / "scripts").mkdir()
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(s) for s in (PREP, PLAIN, "!python scripts/train_plain.py --epochs 2", POST)]
    nbformat.write(nb, tmp_path / "tutorial.ipynb")
    proc = _run(tmp_path, tmp_path / "tutorial.ipynb")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "runs converted on 2 processes" in out and "plain training done" in out
    for rank in (0, 1):
        assert (tmp_path / f"plain-seen-{rank}.txt").read_text().splitlines() == ['{"world": 2}']
    assert not (tmp_path / "plain-seen-single.txt").exists()
    assert len((tmp_path / "prep_runs.txt").read_text().splitlines()) == 1
    assert len((tmp_path / "post_runs.txt").read_text().splitlines()) == 1
    assert "Timed out" not in out


@pytest.mark.e2e
def test_the_timeout_ends_the_launched_ranks_too(tmp_path):
    import time

    import nbformat
    from conftest import no_rank_processes

    name = f"slow_train_{os.getpid()}.py"
    slow = (f"%%writefile {name}\nimport time, torch.distributed as dist\ndist.init_process_group('gloo')\n"
            "open(f'started-{dist.get_rank()}', 'w').close()\ntime.sleep(600)\n")
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(s) for s in (slow, f"!torchrun --nproc_per_node=2 {name}", POST)]
    nbformat.write(nb, tmp_path / "slow.ipynb")
    started = time.monotonic()
    # the inner ranks are up within ~15 s on a loaded machine: the rest of the 45 s is an idle wait
    proc = _run(tmp_path, tmp_path / "slow.ipynb", "--timeout", "45")
    assert proc.returncode != 0 and time.monotonic() - started < 200, proc.stderr[-3000:]
    assert (tmp_path / "started-0").exists() and (tmp_path / "started-1").exists(), proc.stderr[-3000:]
    deadline = time.monotonic() + 15
    while not no_rank_processes(name) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert no_rank_processes(name)
    assert not (tmp_path / "post_runs.txt").exists()


@pytest.mark.e2e
def test_nbddp_run_takes_a_python_script_as_a_notebook(tmp_path):
    (tmp_path / "prep.py").write_text(PREP)
    subprocess.run([sys.executable, "prep.py"], cwd=tmp_path, check=True)
    script = tmp_path / "train_plain.py"
    script.write_text(PLAIN.split("\n", 1)[1])
    proc = _run(tmp_path, script)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "plain training done" in proc.stdout
    for rank in (0, 1):
        assert (tmp_path / f"plain-seen-{rank}.txt").read_text().splitlines() == ['{"world": 2}']


@pytest.mark.e2e
def test_a_bash_cell_running_torchrun_for_one_process_runs_on_every_rank(tmp_path):
    """NeMo's pattern: ``%%bash`` + ``torchrun --nproc_per_node=1 …``, fitted to the job's two processes."""
    import nbformat

    nb = nbformat.v4.new_notebook()
    bash = "%%bash\nset -e\ntorchrun --nproc_per_node=1 train.py\necho bash cell done"
    nb.cells = [nbformat.v4.new_code_cell(s) for s in (PREP, TRAIN, bash, POST)]
    nbformat.write(nb, tmp_path / "nemo_like.ipynb")
    proc = _run(tmp_path, tmp_path / "nemo_like.ipynb")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "asks for --nproc-per-node 1" in out and "bash cell done" in out
    for rank in (0, 1):
        assert [json.loads(ln)["world"] for ln in (tmp_path / f"seen-{rank}.txt").read_text().splitlines()] == [2]
    assert len((tmp_path / "prep_runs.txt").read_text().splitlines()) == 1
    assert len((tmp_path / "post_runs.txt").read_text().splitlines()) == 1
