"""Ranks forked from torchrun's process (``nbddp.forked_ranks``) see what a fresh ``python -u script`` sees.

One script, run by ``nbddp.agent`` on two gloo ranks with forking on and off, reports from each rank what the
script can observe of its start (argv, path, session, signals, threads, environment, ``__main__``, the test
``sitecustomize`` run with the rank's environment) and ends as Python ends (a file it left open flushed, an exit
handler run, an uncaught error on rank 1 said in its log and its exit code; ``sys.exit(3)``:
``tests/test_agent_exit.py``). Both runs must report
the same, and only the forked one may have the agent's command line. So must the same job twice more with its
agent forked from a warm process (``launch/warm_start.py``), the one process both agents come from.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from conftest import NEEDS_FORKED_RANKS
from nbddp.agent import forked_ranks, preload
from nbddp.launch import LaunchPlan, warm_start

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = r'''
import atexit, json, os, signal, sys, threading, time
import torch
import torch.distributed as dist

rank = int(os.environ["RANK"])
out = os.environ["REPORT_DIR"]
dist.init_process_group("gloo")
t = torch.tensor([rank + 1.0])
dist.all_reduce(t)
cmdline = open("/proc/self/cmdline", "rb").read()  # what ps shows
report = {
    "argv": sys.argv, "path0": sys.path[0], "name": __name__, "main_is_me": sys.modules["__main__"].__dict__ is globals(),
    "session_leader": os.getsid(0) == os.getpid(), "group_leader": os.getpgid(0) == os.getpid(),
    "sigterm": str(signal.getsignal(signal.SIGTERM)), "sigint": str(signal.getsignal(signal.SIGINT)),
    "threads": torch.get_num_threads(), "world": os.environ["WORLD_SIZE"], "sum": t.item(),
    "customized_as": os.environ.get("CUSTOMIZED_AS"), "python_threads": threading.active_count(),
    "stdout_write_through": getattr(sys.stdout, "write_through", None),
    "numpy_draw": __import__("numpy").random.randint(1 << 30),  # fresh processes draw apart, forked ones too
    "ancestors": [p.pid for p in __import__("psutil").Process().parents()[:3]],
    "parent_threads": len(os.listdir(f"/proc/{os.getppid()}/task")),  # at the fork: its only thread forked
}
dist.destroy_process_group()
json.dump({"forked": b"nbddp.agent" in cmdline, **report}, open(os.path.join(out, f"report{rank}.json"), "w"))
left_open = open(os.path.join(out, f"left-open{rank}.txt"), "w")
left_open.write("written, never closed")
atexit.register(lambda: open(os.path.join(out, f"atexit{rank}.txt"), "w").write("ran"))
print(f"rank {rank} says hello")
if rank == 1:  # fails once rank 0 has ended well (a failure first would have torchrun stop the other rank)
    while not os.path.exists(os.path.join(out, "atexit0.txt")):
        time.sleep(0.05)
    time.sleep(0.5)
    raise RuntimeError("rank 1 fails on purpose")
'''

#: A sitecustomize as tests and users have them: it acts on what the environment says at start-up.
SITECUSTOMIZE = 'import os\nif os.environ.get("RANK"):\n    os.environ["CUSTOMIZED_AS"] = "rank " + os.environ["RANK"]\n'


def run(tmp_path: Path, how: str) -> tuple[int, Path, dict, dict]:
    """The script on two ranks: ranks started ``fresh`` or ``forked`` by an agent this process starts, or forked
    by an agent a warm process forked (``warm``, ``warm again``); torchrun's exit code and what the ranks said."""
    work = tmp_path / how.replace(" ", "-")
    (work / "site").mkdir(parents=True)
    (work / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    script = work / "rank_script.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "REPORT_DIR": str(work), forked_ranks.SWITCH: "0" if how == "fresh" else "1",
           "NBDDP_FAILURES": str(work / "failures.json"),
           "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    shutil.copytree(work / "site", tmp_path / "site", dirs_exist_ok=True)  # one PYTHONPATH: one warm process
    argv = (sys.executable, "-m", "nbddp.agent", "--standalone", "--nproc_per_node=2", f"--log-dir={work / 'logs'}",
            "--redirects=3", "--max-restarts=0", str(script), "an-arg")
    if how.startswith("warm"):
        plan = LaunchPlan(argv=argv, env=env, cwd=tmp_path, run_dir=work, script=script, nproc=2)
        agent = warm_start.start_agent(plan, work / "torchrun.log")
        assert agent is not None
        code = agent.wait(timeout=240)
    else:
        code = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240).returncode
    reports = {r: json.loads((work / f"report{r}.json").read_text()) for r in (0, 1)}
    failures = json.loads((work / "failures.json").read_text())
    return code, work, reports, failures


@pytest.mark.e2e
@NEEDS_FORKED_RANKS
def test_a_forked_rank_starts_and_ends_as_a_fresh_interpreter_does(tmp_path):
    runs = {how: run(tmp_path, how) for how in ("fresh", "forked", "warm", "warm again")}
    for how, (code, work, reports, failures) in runs.items():
        assert code != 0  # the ranks failed on purpose
        for rank in (0, 1):
            report = reports[rank]
            assert report.pop("forked") is (how != "fresh")
            assert report["argv"] == [str(work / "rank_script.py"), "an-arg"]
            assert report["path0"] == str(work) and report["name"] == "__main__" and report["main_is_me"]
            assert report["session_leader"] and report["group_leader"]  # torchrun stops ranks by process group
            assert report["threads"] == 1 and report["sum"] == 3.0 and report["world"] == "2"
            assert report["customized_as"] == f"rank {rank}"
            assert (work / f"left-open{rank}.txt").read_text() == "written, never closed"
            assert (work / f"atexit{rank}.txt").read_text() == "ran"
            stdout = next((work / "logs").glob(f"*/attempt_0/{rank}/stdout.log")).read_text()
            assert stdout == f"rank {rank} says hello\n"
        stderr1 = next((work / "logs").glob("*/attempt_0/1/stderr.log")).read_text()
        assert "RuntimeError: rank 1 fails on purpose" in stderr1 and "Traceback" in stderr1
        exits = {f["rank"]: f["exitcode"] for f in failures["failures"]}
        assert exits == {1: 1}, failures
    # a forked rank's parent is the agent's forker, which has one thread (torchrun's process has several: a lock
    # one of them held at a fork would stay held in the rank); a fresh rank's parent is torchrun's process
    for how, (_, _, reports, _) in runs.items():
        for report in reports.values():
            agent = report["ancestors"][0 if how == "fresh" else 1]
            assert report["parent_threads"] > 1 if how == "fresh" else report["parent_threads"] == 1, (how, report)
            report["agent_parent"] = report["ancestors"][report["ancestors"].index(agent) + 1]
    # torchrun's process: started by this one, or forked by one warm process for both warm runs
    parents = {how: {r["agent_parent"] for r in reports.values()} for how, (_, _, reports, _) in runs.items()}
    assert parents["fresh"] == parents["forked"] == {os.getpid()}
    assert parents["warm"] == parents["warm again"] and parents["warm"] != {os.getpid()}
    (warm,) = parents["warm"]
    assert "nbddp.agent.warm" in " ".join(psutil.Process(warm).cmdline())

    def alike(reports):  # less "forked" (popped) and the paths (each run's own folder, checked above)
        return {r: {k: v for k, v in report.items() if k not in ("argv", "path0", "agent_parent", "ancestors", "parent_threads")}
                for r, report in reports.items()}

    for _, _, reports, _ in runs.values():
        assert reports[0].pop("numpy_draw") != reports[1].pop("numpy_draw")
    assert alike(runs["fresh"][2]) == alike(runs["forked"][2]) == alike(runs["warm"][2]) == alike(runs["warm again"][2])


def test_only_a_python_script_command_is_forked():
    python = sys.executable
    assert forked_ranks._script_args((python, "-u", "train.py", "--lr", "1")) == ["train.py", "--lr", "1"]
    assert forked_ranks._script_args((python, "-u", "-m", "pkg.train")) is None  # torchrun --module
    assert forked_ranks._script_args(("bash", "run.sh")) is None  # torchrun --no-python
    assert forked_ranks._script_args(("/other/python", "-u", "train.py")) is None


@pytest.mark.parametrize("code, preloaded", [
    ("import torch\nfrom transformers import Trainer\n", ("torch._dynamo", "torch._inductor.compile_fx")),
    ("import torch\nmodel = torch.nn.Linear(2, 2)\n", ("torch._dynamo",)),  # no bitsandbytes to pull inductor in
    ("import os\nos.environ['WANDB_DISABLED'] = 'true'\nimport peft\n", ("torch._dynamo", "torch._inductor.compile_fx")),
    # a TORCH* setting a later import of torch's parts reads, in whatever spelling: nothing of LATER
    ("import os\nos.environ['TORCH_COMPILE_DISABLE'] = '1'\nimport peft\n", ()),
    ("import os\nos.environ.update(TORCHDYNAMO_DISABLE='1')\n", ()),
    ("import os\nos.environ.update({'A': '1'}, TORCH_LOGS='+dynamo')\n", ()),
    ("import os\nos.environ.update({'WANDB_MODE': 'disabled'})\nimport trl\n", ("torch._dynamo", "torch._inductor.compile_fx")),
    ("import os\nos.environ.setdefault('TORCHINDUCTOR_CACHE_DIR', '/tmp/x')\n", ()),
    ("import os\nos.putenv('PYTORCH_X', '1')\n", ()),
    ("import os\nos.environ |= {'A': '1'}\n", ()),  # keys not written out count as possibly TORCH*
    ("import os\nkey = 'A'\nos.environ[key] = '1'\n", ()),
    ("def broken(:\n", ()),
])
def test_only_torch_parts_whose_settings_the_script_leaves_alone_are_preloaded(tmp_path, code, preloaded):
    script = tmp_path / "script.py"
    script.write_text(code)
    assert preload.preload_for(str(script), gpus=False) == preloaded
    assert preload.preload_for(str(tmp_path / "missing.py"), gpus=False) == ()


def test_on_a_machine_with_gpus_the_agent_imports_nothing_that_initializes_cuda(tmp_path, monkeypatch):
    """``torch._inductor`` initializes CUDA's driver as it is imported where there are GPUs; a rank forked after
    that could not use its GPU, so there each rank imports it itself."""
    script = tmp_path / "script.py"
    script.write_text("import torch\nfrom transformers import Trainer\n")
    assert preload.preload_for(str(script), gpus=True) == ("torch._dynamo",)
    device = tmp_path / "nvidiactl"
    monkeypatch.setattr("nbddp.gpus.GPU_DEVICE_FILES", (str(device),))
    assert "torch._inductor.compile_fx" in preload.preload_for(str(script))
    device.touch()  # the machine's own device files say which it is
    assert preload.preload_for(str(script)) == ("torch._dynamo",)


def test_the_agent_finds_the_script_as_torchrun_parses_its_command_line():
    argv = ["--standalone", "--nproc_per_node=2", "--log-dir=/runs/logs", "--redirects=3", "/work/script.py", "--lr", "1"]
    assert preload.training_script(argv) == "/work/script.py"
