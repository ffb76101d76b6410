"""A kept job in a real kernel (nbclient, 2 gloo ranks): train with --keep, then %%ddp cells on the ranks that
stayed up, values pulled back, %ddp_stop; and a kept job ends with its kernel (restart, kill)."""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import nbformat
import psutil
import pytest
from jupyter_core.utils import run_sync
from nbclient import NotebookClient

from kernel import FrontEnd, errors, kernel_env, stream

from nbddp.agent import forked_ranks

pytestmark = pytest.mark.e2e

SETUP = '''%%ddp_setup
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import SFTConfig, SFTTrainer
from nbddp import demo

tokenizer = AutoTokenizer.from_pretrained(demo.tiny_model())
model = AutoModelForCausalLM.from_pretrained(demo.tiny_model(), dtype=torch.float32)
model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, task_type="CAUSAL_LM",
                                         target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
args = SFTConfig(output_dir="outputs", per_device_train_batch_size=16, max_steps=30, learning_rate=5e-3,
                 warmup_steps=3, logging_steps=3, max_length=32, save_strategy="no", report_to="none", seed=3407)
trainer = SFTTrainer(model=model, args=args, train_dataset=demo.arithmetic_dataset(1024), processing_class=tokenizer)
'''
TRAIN = "%%ddp_train --keep --nproc 2\ntrainer.train()\n"
FIRST = "first = [h['loss'] for h in _ddp.log_history if 'loss' in h]"
AGAIN = "%%ddp\ntrainer.train()\n"
SECOND = "second = [h['loss'] for h in _ddp.log_history if 'loss' in h]\nprint('losses', first[0], second[0])"
GENERATE = '''%%ddp
inputs = tokenizer(["Q: 12+7=? A:"], return_tensors="pt")
out = model.generate(**inputs, max_new_tokens=3, do_sample=False)
print("generated:", tokenizer.decode(out[0], skip_special_tokens=True))
'''
HISTORY = "%%ddp\nhistory = trainer.state.log_history\n"
PULL = "%ddp_pull history\nprint('pulled', len([h for h in history if 'loss' in h]), 'losses')"
FAILING = "%%ddp\nx = 1\nraise ValueError('boom in a kept cell')\n"
STILL = "%%ddp\nprint('still kept, world', torch.distributed.get_world_size())\n"
STATUS = "%ddp_status"
LONG = "%%ddp\ntrainer.args.max_steps = 100000\ntrainer.train()\n"
STOP = "%ddp_stop"


def _kernel_family(client) -> list[psutil.Process]:
    """The kernel and every process under it (a short-lived child vanishing meanwhile is left out)."""
    kernel = psutil.Process(client.km.provisioner.process.pid)
    for _ in range(5):
        try:
            return [kernel, *kernel.children(recursive=True)]
        except psutil.NoSuchProcess:
            time.sleep(0.1)
    return [kernel, *kernel.children(recursive=True)]


def _job_processes(client) -> list[psutil.Process]:
    """The processes under the kernel that belong to its jobs: not the warm process the kernel's launches fork
    their agents from (``launch/warm_start.py``), which lives as long as the kernel does."""
    return [p for p in _kernel_family(client)[1:] if "nbddp.agent.warm" not in _cmdline(p)]


def _cmdline(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())[-200:]
    except psutil.Error:
        return "(gone)"


def _gone(procs: list[psutil.Process], within_s: float = 30) -> list[psutil.Process]:
    """Those still running after ``within_s``: an exited child its parent has not reaped yet (a zombie, as
    torchrun is until the kernel next looks at it) holds nothing and counts as gone."""
    deadline = time.monotonic() + within_s
    while True:
        alive = [p for p in procs if _running(p)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def _running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _run(client, nb, sources):
    start = len(nb.cells)
    nb.cells += [nbformat.v4.new_code_cell(s) for s in sources]
    for i in range(start, len(nb.cells)):
        client.execute_cell(nb.cells[i], i)
    return nb.cells[start:]


def _client(tmp_path):
    nb = nbformat.v4.new_notebook()
    client = NotebookClient(nb, kernel_name="python3", timeout=600, allow_errors=True,
                            resources={"metadata": {"path": str(tmp_path)}})
    return nb, client


def test_kept_job_trains_again_generates_pulls_and_stops(tmp_path):
    nb, client = _client(tmp_path)
    env = kernel_env(NBDDP_CACHE=str(tmp_path / "cache"))
    with client.setup_kernel(env=env):
        cells = _run(client, nb, ["%load_ext nbddp", SETUP, TRAIN, FIRST])
        assert not any(errors(c) for c in cells), [errors(c) for c in cells]
        assert "stay up" in stream(cells[2], "stdout")
        ranks = _job_processes(client)
        assert len(ranks) >= 3  # torchrun and its 2 ranks, still up

        again, second, generate, history, pull, failing, still, status = _run(
            client, nb, [AGAIN, SECOND, GENERATE, HISTORY, PULL, FAILING, STILL, STATUS])
        assert not any(errors(c) for c in (again, second, generate, history, pull, still, status))
        first_loss, second_loss = map(float, re.search(r"losses (\S+) (\S+)", stream(second, "stdout")).groups())
        assert second_loss < first_loss  # trained on from the first training's weights, not from the base model
        assert stream(generate, "stdout").count("generated: Q: 12+7=? A:") == 1  # rank 0 alone prints it
        assert "pulled 10 losses" in stream(pull, "stdout")
        # a failing cell: the rank's error at the cell's line, and the job kept (every rank failed alike)
        (error,) = errors(failing)
        assert error.ename == "JobFailed" and "ValueError: boom in a kept cell" in "\n".join(error.traceback)
        assert "line 3" in "\n".join(error.traceback)
        assert "still kept, world 2" in stream(still, "stdout")
        assert re.search(r"rank 1: pid \d+, cpu", stream(status, "stdout"))

        # the stop button during a long training: the ranks stop together at a step and stay up
        timer = threading.Timer(8, os.kill, (_kernel_family(client)[0].pid, signal.SIGINT))
        timer.start()
        (long,) = _run(client, nb, [LONG])
        timer.join()
        (stopped,) = errors(long)
        assert stopped.ename == "JobInterrupted", stopped  # an interrupt, not a failure
        assert "the training stopped together at a step boundary, the ranks are kept" in "\n".join(stopped.traceback)
        (still,) = _run(client, nb, [STILL])
        assert "still kept, world 2" in stream(still, "stdout"), still.outputs

        # values both ways: one pushed to every rank, one that does not pickle refused with the rank kept; tensors
        # both ways (torch's pickler for multiprocessing sent them as shared memory the other side cannot open)
        push, pushed, unpicklable, pull_bad, still = _run(client, nb, [
            "shared = {'scale': 21}\n%ddp_push shared", "%%ddp\nprint('pushed', shared['scale'] * 2)",
            "%%ddp\nunpicklable = lambda: 1", "%ddp_pull unpicklable", STILL])
        assert not errors(push) and "pushed 42" in stream(pushed, "stdout")
        tensors = _run(client, nb, [
            "import torch\nscale_t = torch.tensor([2.0, 3.0])\n%ddp_push scale_t", "%%ddp\nprint('pushed t', float(scale_t.sum()))",
            "%%ddp\nheld = torch.arange(4.0) * scale_t[0]", "%ddp_pull held\nprint('pulled t', held.tolist())"])
        assert not any(errors(c) for c in tensors), [errors(c) for c in tensors]
        assert "pushed t 5.0" in stream(tensors[1], "stdout")
        assert "pulled t [0.0, 2.0, 4.0, 6.0]" in stream(tensors[3], "stdout")
        assert "cannot be sent to the kernel" in "\n".join(errors(pull_bad)[0].traceback)
        assert "still kept, world 2" in stream(still, "stdout")

        # a %%ddp_setup cell changed under the kept job: refused, the ranks kept for %ddp_stop
        _, refused = _run(client, nb, ["%%ddp_setup\nlearning_rate = 1e-3", STILL])
        assert "%%ddp_setup cells changed" in "\n".join(errors(refused)[0].traceback)

        (stop,) = _run(client, nb, [STOP])
        assert "every rank has exited" in stream(stop, "stdout")
        assert not _gone(ranks, within_s=15)
        (after,) = _run(client, nb, [STILL])
        assert "no kept job" in "\n".join(errors(after)[0].traceback) or "has ended" in "\n".join(errors(after)[0].traceback)


RANK1_FAILS = """%%ddp
if torch.distributed.get_rank() == 1:
    raise ValueError("rank 1 fails alone")
torch.distributed.all_reduce(torch.zeros(1))
"""


#: What the kept jobs that only need to be up train: a plain loop, torch alone in the ranks (how a kept job
#: ends does not depend on what it trained; the Trainer's kept job is the test above).
SMALL_SETUP = ("%%ddp_setup\nimport torch\nmodel = torch.nn.Linear(4, 1)\n"
               "optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n")
SMALL_TRAIN = ("%%ddp_train --keep --nproc 2\nfor _ in range(3):\n"
               "    loss = model(torch.randn(8, 4)[torch.distributed.get_rank()::2]).pow(2).mean()\n"
               "    optimizer.zero_grad()\n    loss.backward()\n    optimizer.step()\n")


@pytest.mark.parametrize("how", ["restart", "kill", "one rank fails", "idle limit"])
def test_kept_job_ends_with_its_kernel(tmp_path, how):
    nb, client = _client(tmp_path)
    env = kernel_env(NBDDP_CACHE=str(tmp_path / "cache"))
    with client.setup_kernel(env=env):
        train = SMALL_TRAIN.replace("--keep", "--keep --idle-limit 0.2") if how == "idle limit" else SMALL_TRAIN
        cells = _run(client, nb, ["%load_ext nbddp", SMALL_SETUP, train])
        assert not any(errors(c) for c in cells), [errors(c) for c in cells]
        family = _kernel_family(client)  # the kernel, the warm process, the job's torchrun and ranks
        job = _job_processes(client)
        assert len(job) >= 3
        if how == "one rank fails":  # rank 0 waits in the all-reduce: the job is ended, rank 1 named
            (failed,) = _run(client, nb, [RANK1_FAILS])
            text = "\n".join(errors(failed)[0].traceback)
            assert "rank 1 failed" in text and "rank 1 fails alone" in text and "kept job was ended" in text, text
            alive = _gone(job, within_s=30)
            assert family[0].is_running()
        elif how == "idle limit":  # 12 s without a request: the ranks end themselves, the kernel stays
            alive = _gone(job, within_s=40)
            (after,) = _run(client, nb, [STILL])
            assert "the idle limit ended it: no request for 0.2 min" in "\n".join(errors(after)[0].traceback)
        else:  # the kernel gone: its warm process too (where there is one), and the job with it
            warm = [p for p in family if "nbddp.agent.warm" in _cmdline(p)]
            assert len(warm) == (1 if forked_ranks.possible_here() else 0), [_cmdline(p) for p in family]
            if how == "restart":
                run_sync(client.km.restart_kernel)(now=False)
            else:
                os.kill(family[0].pid, signal.SIGKILL)
            alive = _gone(family, within_s=30)
        assert not alive, [(p.pid, _cmdline(p)) for p in alive]


def test_a_cell_the_kept_job_ran_changed_and_run_again_is_refused(tmp_path):
    """The person edits the loading cell and runs it again in the kernel (as JupyterLab sends it: the same cell
    id, new code): the ranks still hold what its old code made, so a %%ddp cell is refused naming the cell and
    the fix; run again unchanged it is not; %ddp_stop still ends the ranks."""
    front = FrontEnd(tmp_path, NBDDP_CACHE=str(tmp_path / "cache"))
    try:
        front.run("%load_ext nbddp", cell_id="c-load")
        front.run("import torch\nweights = torch.ones(2)", cell_id="c-loader")
        keep = front.run("%%ddp_train --keep --nproc 2\nprint('ready')", cell_id="c-keep")
        assert keep.error is None and "stay up" in keep.shown, keep.shown
        check = "%%ddp\nprint('holding', weights.sum().item())"
        assert "holding 2.0" in front.run(check, cell_id="c-check").shown
        front.run("import torch\nweights = torch.ones(2)", cell_id="c-loader")  # run again as it is
        same = front.run(check, cell_id="c-check")
        assert same.error is None and "holding 2.0" in same.shown

        front.run("import torch\nweights = torch.zeros(2)", cell_id="c-loader")  # edited, run again
        refused = front.run(check, cell_id="c-check")
        assert refused.error and "ran as In [2] was changed and run again here (In [7])" in refused.error, refused.error
        assert "%ddp_stop, then %%ddp_train --keep" in refused.error and "holding" not in refused.shown
        assert "every rank has exited" in front.run(STOP, cell_id="c-stop").shown
    finally:
        front.close()
