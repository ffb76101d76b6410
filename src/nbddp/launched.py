"""Launched mode: a notebook whose training is a command it launches (``!torchrun --nproc_per_node=2 train.py``).

Such a notebook runs as its kernel would run it: its cells once, in one process (nbddp's job with one rank,
so no barrier ever waits on a shell line), and the command it launches on every GPU. nbddp puts stand-in
launchers first on that process's PATH (``write_stand_ins``): ``torchrun``, ``accelerate``, ``deepspeed`` and
``python`` are small shell scripts running ``python -m nbddp.launched TOOL ARGS…`` (``main``), which

- runs a command that starts N processes as written, its process count fitted to the job's (``--nproc``,
  one per GPU by default), with a note where it asked for another, on a free port (``--standalone``), every
  rank's output kept under the run directory and rank 0's shown; without nbddp's own torchelastic and rank
  variables in its environment (``clean_env``), so the inner agent writes its own records, not the job's;
  under nbddp's agent (torchrun's own ``main``, its ranks started as nbddp's are: ``agent/``), so a rank that
  finished its work ends as nbddp's do: on CPU machines a forked rank never meets Python's finalization, where
  gloo's worker threads can abort a fresh one (torch's race: 3 of 80 plain torchrun launches of a DDP script
  on 2 busy cores ended in "terminate called without an active exception" after training);
- runs ``python train.py`` of a training script (one the converter finds a training call in) on every GPU
  the way nbddp runs a notebook: converted, under torchrun, shims applied;
- runs anything else (``python prepare.py``, a launcher inside the launched job) as the real tool.

A failed launched rank is said at the ``%%writefile`` cell and line that wrote its script, where one did
(``NBDDP_WRITTEN``), and the command's exit code is the notebook's ``_exit_code`` as in the kernel: the
notebook's later cells still run, but the failure is recorded (``record_failure``) and the job's result says
it failed (``failure_of``, read by ``job.py``: ``nbddp run`` exits 1, ``%%ddp_train`` ends with it). The
inner processes are children of the job's rank, so the stop button and ``--timeout`` end them with it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from .launched_failures import (  # noqa: F401 - the job reads them here
    FAILURES, failure_of, record_failure, with_launched_failure,
)
from .launched_failures import _say_failure

#: The tools a notebook's shell line may start its training with.
TOOLS = ("torchrun", "accelerate", "deepspeed", "python", "python3")
#: Set in the launched command's processes: a launcher there is the real one.
INNER = "NBDDP_LAUNCHED_INNER"
#: Environment variables of nbddp's own job that the launched command must not inherit.
_JOB_VARIABLES = re.compile(
    r"^(TORCHELASTIC_\w+|RANK|LOCAL_RANK|WORLD_SIZE|LOCAL_WORLD_SIZE|GROUP_RANK|GROUP_WORLD_SIZE|ROLE_RANK|"
    r"ROLE_WORLD_SIZE|ROLE_NAME|MASTER_ADDR|MASTER_PORT|TORCH_NCCL_ASYNC_ERROR_HANDLING|OMP_NUM_THREADS|"
    r"NBDDP_RUN_DIR|NBDDP_METRICS\w*|NBDDP_FAILURES|NBDDP_LAUNCHER_PID|PYTHONFAULTHANDLER)$"
)
#: torchrun's options that say how many processes, where and with what logs: fitted or left to nbddp.
_NPROC = ("--nproc_per_node", "--nproc-per-node")
_RDZV = ("--standalone", "--rdzv_endpoint", "--rdzv-endpoint", "--master_port", "--master-port",
         "--master_addr", "--master-addr", "--rdzv_backend", "--rdzv-backend")


def write_stand_ins(folder: Path) -> Path:
    """The stand-in launchers, as executable shell scripts in ``folder`` (put first on PATH)."""
    folder.mkdir(parents=True, exist_ok=True)
    for tool in TOOLS:
        path = folder / tool
        path.write_text(f'#!/bin/sh\nexec "$NBDDP_PYTHON" -m nbddp.launched {tool} "$@"\n')
        path.chmod(0o755)
    return folder


def launched_env(env: dict[str, str], run_dir: Path, nproc: int, written: dict[str, tuple[int, int]]) -> dict:
    """The job's environment for launched mode: stand-ins first on PATH, the process count to fit to, and
    the ``%%writefile`` cells that wrote scripts (``{file name: (cell, line of the script's line 1)}``)."""
    bin_dir = write_stand_ins(run_dir / "launched-bin")
    path = env.get("PATH", os.environ.get("PATH", ""))
    return {
        **env,
        "PATH": f"{bin_dir}{os.pathsep}{path}",
        "NBDDP_PYTHON": sys.executable,
        "NBDDP_LAUNCHED_NPROC": str(nproc),
        "NBDDP_LAUNCHED_DIR": str(run_dir / "launched"),
        "NBDDP_WRITTEN": json.dumps(written),
    }


def clean_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """``environ`` less nbddp's job variables, marked as inside the launched command."""
    environ = dict(os.environ if environ is None else environ)
    return {k: v for k, v in environ.items() if not _JOB_VARIABLES.match(k)} | {INNER: "1"}


def real_tool(tool: str) -> str | None:
    """``tool`` as the shell would find it without the stand-ins."""
    path = [p for p in os.environ.get("PATH", "").split(os.pathsep) if not p.endswith("launched-bin")]
    return shutil.which(tool, path=os.pathsep.join(path))


def fit_nproc(args: list[str], option: str, aliases: tuple[str, ...], nproc: int) -> tuple[list[str], str | None]:
    """``args`` with its process count (``option``/``aliases``, as ``--x N`` or ``--x=N``) set to ``nproc``
    (added where absent), and a note where it asked for another count."""
    out, asked, i = [], None, 0
    while i < len(args):
        arg = args[i]
        name, eq, value = arg.partition("=")
        if name in aliases:
            if not eq and i + 1 < len(args):
                value, i = args[i + 1], i + 1
            asked = value
            i += 1
            continue
        out.append(arg)
        i += 1
    note = None
    if asked is not None and asked != str(nproc):
        note = (f"nbddp: the command asks for {option} {asked}; it runs with {nproc} processes, one per GPU of "
                "this job (nbddp --nproc sets it)")
    return [f"{option}={nproc}", *out], note


def _first_script(args: list[str]) -> int | None:
    """Where the script (a ``.py`` file, or ``-m module``) starts among a launcher's arguments."""
    i = 0
    while i < len(args):
        if args[i] == "-m" or args[i].endswith(".py") or args[i] == "--no-python":
            return i
        i += 1
    return None


def torchrun_argv(args: list[str], nproc: int, log_dir: Path) -> tuple[list[str], str | None]:
    """torchrun's command for ``torchrun ARGS``, fitted to the job: torchrun's own ``main`` in nbddp's agent."""
    start = _first_script(args)
    opts, rest = (args[:start], args[start:]) if start is not None else (args, [])
    opts, note = fit_nproc(opts, "--nproc-per-node", _NPROC, nproc)
    names = {o.partition("=")[0] for o in opts}
    if not names & set(_RDZV):
        opts.append("--standalone")  # a free port: never the job's own, nor another job's 29500
    if not names & {"--log-dir", "--log_dir"}:
        opts += [f"--log-dir={log_dir}", "--redirects=3", "--tee=3", "--local-ranks-filter=0"]
    return [os.environ.get("NBDDP_PYTHON", sys.executable), "-m", "nbddp.agent", *opts, *rest], note


def _next_log_dir() -> Path:
    base = Path(os.environ.get("NBDDP_LAUNCHED_DIR", "nbddp_launched"))
    base.mkdir(parents=True, exist_ok=True)
    n = len(list(base.glob("launch-*"))) + 1
    return base / f"launch-{n}"


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def run(argv: list[str], training: bool = True) -> int:
    """Run ``argv`` without the job's variables; a failed training launch said at the cell that wrote its
    script and recorded for the job's result (``record_failure``)."""
    proc = subprocess.Popen(argv, env=clean_env())
    try:
        code = proc.wait()
    except BaseException:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        raise
    if code and training:
        _say_failure(argv, code)
    return code


def _python(args: list[str], nproc: int) -> int:
    """``python ARGS``: torch's launcher as ``torchrun``; a training script on every GPU, converted; else
    the real python."""
    real = real_tool("python") or sys.executable
    if args[:2] in (["-m", "torch.distributed.run"], ["-m", "torch.distributed.launch"]):
        return _torchrun(args[2:], nproc)
    flags = 0
    while flags < len(args) and args[flags] in ("-u", "-B", "-O", "-OO", "-E", "-s", "-I"):
        flags += 1  # flags that take no value: `python -u train.py` is still the script's run
    script = args[flags] if flags < len(args) and args[flags].endswith(".py") else None
    converted = _training_script(Path(script)) if script and Path(script).is_file() else None
    if converted is not None:
        return _run_converted(Path(script), converted, args[flags + 1:], nproc)
    return run([real, *args], training=False)


def _training_script(path: Path):
    """The script converted, where the converter finds it trains (else None: it runs as written). Converted
    once: the same ``Script`` is written and run."""
    from .cells import script_cells
    from .convert.script import convert_cells

    try:
        script = convert_cells(script_cells(path))
    except Exception:  # a script the converter cannot read runs as written
        return None
    return script if script.trains else None


def _run_converted(path: Path, script, args: list[str], nproc: int) -> int:
    """A plain training script run the way nbddp runs a notebook: converted, on every GPU."""
    log_dir = _next_log_dir()
    log_dir.mkdir(parents=True, exist_ok=True)
    converted = script.write(log_dir / f"converted-{path.name}")
    _say(f"nbddp: {path} trains: it runs converted on {nproc} processes ({converted})")
    argv, _ = torchrun_argv([str(converted), *args], nproc, log_dir / "logs")
    return run(argv)


def _torchrun(args: list[str], nproc: int) -> int:
    argv, note = torchrun_argv(args, nproc, _next_log_dir() / "logs")
    if note:
        _say(note)
    return run(argv)


def main(argv: list[str] | None = None) -> int:
    tool, *args = sys.argv[1:] if argv is None else argv
    real = real_tool(tool)
    if os.environ.get(INNER) or "NBDDP_LAUNCHED_NPROC" not in os.environ:
        if real is None:
            _say(f"{tool}: command not found")
            return 127
        os.execv(real, [real, *args])
    nproc = int(os.environ["NBDDP_LAUNCHED_NPROC"])
    if tool == "torchrun":
        return _torchrun(args, nproc)
    if tool in ("python", "python3"):
        return _python(args, nproc)
    if tool == "accelerate" and args[:1] == ["launch"]:
        fitted, note = fit_nproc(args[1:], "--num_processes", ("--num_processes", "--num-processes"), nproc)
        if note:
            _say(note)
        return run([real or "accelerate", "launch", *fitted])
    if tool == "deepspeed":
        start = _first_script(args)
        opts, rest = (args[:start], args[start:]) if start is not None else (args, [])
        fitted, note = fit_nproc(opts, "--num_gpus", ("--num_gpus", "--num-gpus"), nproc)
        if note:
            _say(note)
        return run([real or "deepspeed", *fitted, *rest])
    return run([real or tool, *args], training=False)


if __name__ == "__main__":
    sys.exit(main())
