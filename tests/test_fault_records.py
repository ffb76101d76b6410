"""Failure records, stacks, ports, atomic saves and resume, without launching a job."""

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from nbddp.agent import failure_record
from nbddp.convert.script import SourceMap, map_path
from nbddp.errors import LaunchError
from nbddp.launch import new_run_dir, plan, read_failure, read_stacks
from nbddp.options import RunOptions, node_args
from nbddp.preflight import port_is_free
from nbddp.runtime.lifecycle import write_error_file
from nbddp.runtime.resume import last_complete_checkpoint
from nbddp.runtime.saves import atomic_writer


@pytest.fixture
def job(tmp_path):
    """A script with a source map: script lines 10-12 are cell 2, lines 1-3; a log dir as torchrun lays it out."""
    script = tmp_path / "script.py"
    script.write_text("\n".join(f"line{n}" for n in range(1, 21)) + "\n")
    map_path(script).write_text(SourceMap("nb.ipynb", {10: (2, 1), 11: (2, 2), 12: (2, 3)}).to_json())
    logs = tmp_path / "logs"
    for rank in (0, 1):
        (logs / "run" / "attempt_0" / str(rank)).mkdir(parents=True)
    return script, logs


def rank_dir(logs, rank):
    return logs / "run" / "attempt_0" / str(rank)


def error_from(script, rank_folder, line, message, env_rank):
    """Write an error.json as the runtime's excepthook does, for an exception raised at a script line."""
    code = compile("\n" * (line - 1) + f"raise RuntimeError({message!r})", str(script), "exec")
    try:
        exec(code, {})
    except RuntimeError as exc:
        old = os.environ.get("RANK")
        os.environ["RANK"] = str(env_rank)
        try:
            write_error_file(str(rank_folder / "error.json"), type(exc), exc, exc.__traceback__)
        finally:
            os.environ.pop("RANK") if old is None else os.environ.__setitem__("RANK", old)


def record(tmp_path, *failures):
    path = tmp_path / "failures.json"
    path.write_text(json.dumps({"root_rank": failures[0]["rank"], "failures": list(failures)}))
    return path


def test_a_rank_killed_by_a_signal_is_the_root_cause_over_the_errors_it_caused(job, tmp_path):
    script, logs = job
    # rank 0's collective failed because rank 1 vanished: same second as torch elastic noticed the kill
    error_from(script, rank_dir(logs, 0), 11, "Connection reset by peer", 0)
    noticed = int(time.time())
    failures = record(tmp_path, {"rank": 1, "local_rank": 1, "pid": 7, "exitcode": -9, "signal": "SIGKILL",
                                 "error_file": None, "timestamp": noticed})
    f = read_failure(logs, script, failures=failures)
    assert (f.rank, f.signal, f.exitcode, f.cell) == (1, 9, -9, None)
    assert str(f).startswith("rank 1 was killed (signal 9): SIGKILL: killed outright, most often by the system")


def test_an_exception_well_before_a_death_by_signal_is_the_root_cause(job, tmp_path):
    script, logs = job
    error_from(script, rank_dir(logs, 0), 12, "boom", 0)
    failures = record(tmp_path, {"rank": 1, "local_rank": 1, "pid": 7, "exitcode": -11, "signal": "SIGSEGV",
                                 "error_file": None, "timestamp": int(time.time()) + 5})
    f = read_failure(logs, script, failures=failures)
    assert (f.rank, f.cell, f.line, f.signal) == (0, 2, 3, None)
    assert f.message == "RuntimeError: boom" and f.source == "line12"


def test_an_error_file_names_the_global_rank_not_the_folder(job):
    script, logs = job
    error_from(script, rank_dir(logs, 1), 10, "on the second node", 3)  # local rank 1 of node 1: rank 3
    assert read_failure(logs, script).rank == 3


def test_an_exit_without_traceback_says_so(job, tmp_path):
    script, logs = job
    failures = record(tmp_path, {"rank": 1, "local_rank": 1, "pid": 7, "exitcode": 3, "signal": None,
                                 "error_file": None, "timestamp": int(time.time())})
    f = read_failure(logs, script, failures=failures)
    assert str(f) == "rank 1 failed: exited with code 3 without a Python traceback (sys.exit or os._exit?)"


@pytest.mark.e2e
def test_a_crashed_rank_is_located_by_its_stack_dump(job, tmp_path):
    """A real faulthandler dump: a process running the script's line 11 is stopped with SIGTERM."""
    script, logs = job
    lines = ["import faulthandler, signal, sys, time"] + [""] * 8 + [
        f"f = open({str(rank_dir(logs, 1) / 'stacks.txt')!r}, 'w'); f.write('nbddp: stacks of rank 1 (pid 1)\\n'); f.flush()",
        "faulthandler.register(signal.SIGTERM, file=f, all_threads=True, chain=True); print('ready', flush=True); time.sleep(60)",
    ]
    script.write_text("\n".join(lines) + "\n")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "ready\n"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == -signal.SIGTERM
    (stack,) = read_stacks(logs, script, SourceMap.from_json(map_path(script).read_text()))
    assert (stack.rank, stack.cell, stack.line) == (1, 2, 2)
    assert 'File "nb.ipynb", cell 2, line 2 in <module>' in stack.stack
    assert str(stack).startswith("rank 1 was at cell 2, line 2: faulthandler.register(")
    failures = record(tmp_path, {"rank": 1, "local_rank": 1, "pid": proc.pid, "exitcode": -6, "signal": "SIGABRT",
                                 "error_file": None, "timestamp": int(time.time())})
    f = read_failure(logs, script, failures=failures)
    assert str(f).startswith("rank 1 was killed (signal 6) in cell 2, line 2: SIGABRT: aborted by native code")


def test_the_agent_records_torch_elastics_failures_as_data(tmp_path):
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    err = tmp_path / "error.json"
    err.write_text(json.dumps({"message": {"message": "x", "extraInfo": {"py_callstack": "", "timestamp": "5"}}}))
    exc = ChildFailedError("script.py", {
        0: ProcessFailure(local_rank=0, pid=11, exitcode=1, error_file=str(err)),
        1: ProcessFailure(local_rank=1, pid=12, exitcode=-9, error_file=str(tmp_path / "none.json")),
    })
    data = failure_record(exc)
    assert data["root_rank"] == 0  # torch's choice: the earliest stamp (5, from the error file)
    assert data["failures"][0] == {"rank": 0, "local_rank": 0, "pid": 11, "exitcode": 1, "signal": None,
                                   "error_file": str(err), "timestamp": 5}
    assert data["failures"][1]["signal"] == "SIGKILL" and data["failures"][1]["error_file"] is None


def test_a_busy_master_port_is_refused_before_launch(tmp_path):
    with socket.socket() as held:
        held.bind(("", 0))
        held.listen()
        port = held.getsockname()[1]
        assert not port_is_free(port)
        with pytest.raises(LaunchError, match=f"port {port} .* already in use"):
            plan(tmp_path / "s.py", tmp_path, RunOptions(torchrun_args=[f"--master-port={port}"]), nproc=1)
        with pytest.raises(LaunchError):
            plan(tmp_path / "s.py", tmp_path, RunOptions(torchrun_args=["--master_port", str(port)]), nproc=1)
        # across nodes the port lives on the master's host: not this machine's to judge
        plan(tmp_path / "s.py", tmp_path, RunOptions(torchrun_args=["--nnodes=2", f"--master-port={port}"]), nproc=1)
    assert port_is_free(port)
    plan(tmp_path / "s.py", tmp_path, RunOptions(torchrun_args=[f"--master-port={port}"]), nproc=1)


def test_plan_passes_node_options_timeouts_and_resume(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_secret_value")
    args = node_args(2, 1, "127.0.0.1:29400")
    assert args == ["--nnodes=2", "--node-rank=1", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:29400"]
    p = plan(tmp_path / "s.py", tmp_path, RunOptions(torchrun_args=args, collective_timeout_s=5.4, resume=True),
             nproc=1)
    assert "--standalone" not in p.argv and "--rdzv-endpoint=127.0.0.1:29400" in p.argv
    assert p.env["NBDDP_TIMEOUT"] == "5" and p.env["NBDDP_RESUME"] == "1"
    assert p.env["NBDDP_FAILURES"] == str(tmp_path.resolve() / "failures.json")
    # secrets reach the ranks through the environment, never the command line
    assert p.env["HF_TOKEN"] == "hf_secret_value" and not any("hf_secret_value" in a for a in p.argv)
    assert "NBDDP_RESUME" not in plan(tmp_path / "s.py", tmp_path, nproc=1).env


def test_run_directories_are_private(tmp_path):
    a, b = new_run_dir(tmp_path, "job"), new_run_dir(tmp_path, "job")
    assert a != b
    assert (a.stat().st_mode & 0o777) == 0o700 and (b.stat().st_mode & 0o777) == 0o700


def test_an_atomic_save_cut_short_leaves_the_previous_file_whole(tmp_path):
    target = tmp_path / "weights.bin"

    def write(obj, path):
        with open(path, "wb") as fh:
            fh.write(obj)
            if obj == b"new-but-cut":
                raise KeyboardInterrupt  # the process is stopped halfway through the write

    save = atomic_writer(write)
    save(b"old-complete", str(target))
    with pytest.raises(KeyboardInterrupt):
        save(b"new-but-cut", target)
    assert target.read_bytes() == b"old-complete"
    assert [p.name for p in tmp_path.iterdir()] == ["weights.bin"]  # the temporary file went too
    assert oct(target.stat().st_mode & 0o777) == oct(0o666 & ~_umask())  # as a plain open() would make it


def _umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_an_atomic_save_to_an_open_file_passes_through(tmp_path):
    import io

    import torch

    save = atomic_writer(torch.save)
    buf = io.BytesIO()
    save({"a": torch.ones(2)}, buf)
    buf.seek(0)
    assert torch.equal(torch.load(buf)["a"], torch.ones(2))
    save({"a": torch.zeros(2)}, tmp_path / "x.pt")
    assert torch.equal(torch.load(tmp_path / "x.pt")["a"], torch.zeros(2))
    with pytest.raises(FileNotFoundError):  # no folder is made that torch.save would not make
        save({"a": 1}, tmp_path / "missing" / "x.pt")


def test_the_last_complete_checkpoint_is_chosen(tmp_path):
    assert last_complete_checkpoint(tmp_path / "nothing") is None
    for step, complete in ((2, True), (10, True), (12, False), (3, True)):
        d = tmp_path / f"checkpoint-{step}"
        d.mkdir()
        if complete:
            (d / "trainer_state.json").write_text("{}")
    (tmp_path / "checkpoint-final").mkdir()
    assert last_complete_checkpoint(tmp_path) == str(tmp_path / "checkpoint-10")


RESUME = textwrap.dedent('''
    import json, os, sys
    from nbddp.runtime import resume, saves
    saves.install()
    assert resume.attach()
    from transformers import Trainer, TrainerCallback, TrainingArguments
    from nbddp import demo

    tok = demo.build_tokenizer()
    model = demo.build_model(tok)
    rows = []
    for r in demo.arithmetic_dataset(64):
        ids = tok(r["text"])["input_ids"]
        rows.append({"input_ids": ids, "labels": ids})
    steps = []  # the steps trained by this process

    class Steps(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            steps.append(state.global_step)
    args = TrainingArguments(output_dir=sys.argv[1], max_steps=int(sys.argv[2]), per_device_train_batch_size=1,
                             save_steps=2, save_strategy="steps", logging_steps=1, report_to="none",
                             use_cpu=True, learning_rate=1e-3)
    trainer = Trainer(model=model, args=args, train_dataset=rows, callbacks=[Steps()])
    trainer.train()
    print(json.dumps(steps))
''')


@pytest.mark.e2e
def test_resume_continues_from_the_last_checkpoint(tmp_path):
    out = tmp_path / "outputs"
    env = {**os.environ, "NBDDP_RESUME": "1"}

    def train(steps):
        proc = subprocess.run([sys.executable, "-c", RESUME, str(out), str(steps)], capture_output=True,
                              text=True, env=env, timeout=400)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout

    first = train(4)
    assert "no complete checkpoint" in first and json.loads(first.splitlines()[-1]) == [1, 2, 3, 4]
    (out / "checkpoint-4" / "trainer_state.json").unlink()  # a checkpoint the failed run did not finish
    second = train(6)
    assert f"nbddp: resuming from {out / 'checkpoint-2'}" in second
    assert json.loads(second.splitlines()[-1]) == [3, 4, 5, 6]  # steps 1-2 were not trained again


def nbddp(*args, cwd):
    return subprocess.run([sys.executable, "-m", "nbddp.cli", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent / "src")})


@pytest.mark.e2e
@pytest.mark.parametrize("content, says", [
    ('{"nbformat": 4, "nbformat_minor": 5, "metadata": {}, "cells": [{"cell_type": "code", "source": "x"}]}',
     "not a notebook"),  # schema-invalid
    ('{"nbformat": 4, "cells": [', "not valid JSON (line 1"),  # corrupt: cut short
    ('{"nbformat": 4, "nbformat_minor": 5, "metadata": {}, "cells": [{"cell_type": "code", "source": "x = (",'
     ' "metadata": {}, "outputs": [], "execution_count": null, "id": "a"}]}', "cell 1, line 1: not valid Python"),
])
def test_a_bad_notebook_is_one_clear_error_and_nothing_runs(tmp_path, content, says):
    nb = tmp_path / "bad.ipynb"
    nb.write_text(content)
    proc = nbddp("run", "--every-rank", nb, "--runs-dir", tmp_path / "runs", cwd=tmp_path)
    assert proc.returncode == 2
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("nbddp: error:")]
    assert len(errors) == 1 and says in errors[0] and "Traceback" not in proc.stderr
    assert not (tmp_path / "runs").exists()  # nothing was launched


def test_ranks_torchrun_stopped_with_sigterm_are_not_the_cause(job, tmp_path):
    script, logs = job
    now = int(time.time())
    failures = record(
        tmp_path,
        {"rank": 0, "local_rank": 0, "pid": 6, "exitcode": -15, "signal": "SIGTERM", "error_file": None, "timestamp": now},
        {"rank": 1, "local_rank": 1, "pid": 7, "exitcode": -9, "signal": "SIGKILL", "error_file": None, "timestamp": now},
    )
    assert read_failure(logs, script, failures=failures).rank == 1


@pytest.mark.e2e
def test_the_agent_ends_itself_when_its_launcher_is_already_gone():
    def agent_start(launcher_pid: int, then_sleep: int) -> int:
        code = f"from nbddp.agent import die_with_parent\nimport time\ndie_with_parent({launcher_pid})\ntime.sleep({then_sleep})"
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent / "src")}
        return subprocess.run([sys.executable, "-c", code], env=env, timeout=60).returncode

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert agent_start(gone.pid, then_sleep=30) == -signal.SIGTERM
    assert agent_start(os.getpid(), then_sleep=0) == 0


def test_where_ranks_were_names_notebook_lines_and_the_last_trainer_step(tmp_path):
    from nbddp.display import failure_report, summary
    from nbddp.job import JobResult
    from nbddp.launch import RankFailure, RankStack, RunResult, where_ranks_were

    stacks = (RankStack(0, None, None, "", "Garbage-collecting"),  # not in notebook code: left out
              RankStack(1, 4, 2, "    dist.all_reduce(t)", "…"))
    history = ({"event": "begin", "step": 0, "max_steps": 100}, {"event": "step", "step": 12, "max_steps": 100})
    result = RunResult(returncode=1, run_dir=tmp_path, script=tmp_path / "s.py", duration_s=3.0,
                       log_history=history, timed_out=True, stacks=stacks)
    assert not result.ok and result.last_step == (12, 100)
    assert where_ranks_were(result) == ["rank 1 was at cell 4, line 2: dist.all_reduce(t)", "last Trainer step: 12 of 100"]
    assert summary(JobResult.from_run(result, tmp_path)).startswith("nbddp: timed out in 3.0 s")
    report = failure_report(RankFailure(rank=2, message="SIGKILL: …", traceback="", signal=9), others=where_ranks_were(result))
    assert report == ("nbddp: rank 2 was killed (signal 9): SIGKILL: …\n"
                      "nbddp: when the job stopped:\n"
                      "nbddp:   rank 1 was at cell 4, line 2: dist.all_reduce(t)\n"
                      "nbddp:   last Trainer step: 12 of 100\n")


@pytest.mark.e2e
def test_saves_reach_the_names_transformers_and_peft_bind_at_import():
    code = textwrap.dedent('''
        from nbddp.runtime import saves
        assert saves.install() == ["torch.save", "safetensors.torch.save_file"]
        import torch, transformers.modeling_utils as mu, peft.peft_model as pm
        print(all(getattr(f, "_nbddp_atomic", False) for f in (torch.save, mu.safe_save_file, pm.safe_save_file)))
    ''')
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent / "src")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "True"


@pytest.mark.e2e
def test_a_busy_master_port_through_the_cli_is_one_line_and_exit_2(tmp_path, notebook):
    nb = notebook(["print('never runs')"])
    with socket.socket() as held:
        held.bind(("", 0))
        held.listen()
        port = held.getsockname()[1]
        proc = nbddp("run", "--every-rank", nb, "--runs-dir", tmp_path / "runs", "--", f"--master-port={port}", cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        f"nbddp: error: port {port} (--master-port) is already in use on this machine; "
        "leave --master-port out and torchrun picks a free port")
    assert not list((tmp_path / "runs").rglob("torchrun.log"))  # nothing was started


def test_an_nccl_watchdog_abort_is_located_in_the_waiting_rank(job, tmp_path):
    """The records an NCCL collective timeout left on 2 H200s (torch 2.11): the waiting rank aborted by the
    watchdog, its main thread's dump written by faulthandler; the sleeping rank stopped by torchrun."""
    script, logs = job
    (rank_dir(logs, 0) / "stacks.txt").write_text(textwrap.dedent(f"""\
        nbddp: stacks of rank 0 (pid 41)
        Fatal Python error: Aborted

        Thread 0x00007fe1e43df140 (most recent call first):
          File "/opt/torch/.venv/lib/python3.12/site-packages/torch/cuda/__init__.py", line 1162 in synchronize
          File "{script}", line 12 in <module>

        Extension modules: numpy._core._multiarray_umath, torch._C, torch._C._nn (total: 22)
        """))
    (rank_dir(logs, 1) / "stacks.txt").write_text(textwrap.dedent(f"""\
        nbddp: stacks of rank 1 (pid 42)
        Current thread 0x00007f36a448b140 (most recent call first):
          File "{script}", line 10 in <module>
        """))
    now = int(time.time())
    failures = record(
        tmp_path,
        {"rank": 0, "local_rank": 0, "pid": 41, "exitcode": -6, "signal": "SIGABRT", "error_file": None, "timestamp": now},
        {"rank": 1, "local_rank": 1, "pid": 42, "exitcode": -15, "signal": "SIGTERM", "error_file": None, "timestamp": now},
    )
    f = read_failure(logs, script, failures=failures)
    assert str(f).startswith("rank 0 was killed (signal 6) in cell 2, line 3: SIGABRT: aborted by native code")
    assert "NCCL's watchdog" in f.message
    stacks = read_stacks(logs, script, SourceMap.from_json(map_path(script).read_text()))
    assert [str(st) for st in stacks] == ["rank 0 was at cell 2, line 3: line12", "rank 1 was at cell 2, line 1: line10"]


@pytest.mark.e2e
def test_the_stacks_header_a_rank_writes_is_the_one_the_launcher_reads(tmp_path):
    """Writer (the rank's lifecycle) and reader (the launcher) share one format: ``runtime.records``."""
    from nbddp.runtime import records

    code = "from nbddp.runtime import lifecycle; lifecycle._record_stacks_on_termination(); import os; print(os.getpid())"
    env = {**os.environ, "TORCHELASTIC_ERROR_FILE": str(tmp_path / records.ERROR_FILE), "RANK": "3"}
    pid = int(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout)
    header, dumps = records.read_stacks_file(tmp_path / records.STACKS_FILE)
    assert header == records.StacksHeader(rank=3, pid=pid) and dumps == ""


def test_stacks_files_that_cannot_be_read_are_passed_over(tmp_path):
    """The launcher reads every rank's ``stacks.txt`` while ranks come and go: a file it cannot read is skipped."""
    from nbddp.runtime import records

    written = tmp_path / "0" / records.STACKS_FILE
    written.parent.mkdir()
    written.write_text(records.stacks_header(rank=1, pid=77) + "Thread 0x1 (most recent call first):\n")
    unreadable = tmp_path / "1" / records.STACKS_FILE
    unreadable.mkdir(parents=True)  # a folder: reading it raises an OSError
    gone = tmp_path / "2" / records.STACKS_FILE
    found = list(records.read_stacks_files([unreadable, written, gone]))
    assert found == [records.StacksFile(written, records.StacksHeader(rank=1, pid=77),
                                        "Thread 0x1 (most recent call first):\n")]
