"""A training script that launches itself, for places that run one file with plain ``python`` (Kaggle Scripts).

The exported script calls ``main(__file__, installs)`` before any training code. Run plainly, ``main`` runs
the notebook's installs once, starts ``torchrun`` on the same file with one process per GPU (two gloo
processes on a machine without GPUs) and exits with torchrun's exit code. Under torchrun it returns at once,
and the rest of the file trains. Every rank's output goes to ``nbddp_logs/`` under the working directory;
rank 0's is also shown on the console. torchrun options for several machines come after the file name
(``python kernel.py --nnodes=2 --rdzv-endpoint=HOST:PORT``) or, where no command line can be given, in
``NBDDP_TORCHRUN_ARGS``.

Only the standard library (and torch, to count GPUs) is used: this module runs before anything is installed.
It does not go through ``nbddp.job.run_job`` as the other front ends do: the export carries only
``runtime/`` (a rank never needs the converter or the launcher), the script is converted already, and
``run_job``'s launcher and its views (live panel, terminal table, run directories) need the notebook side.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from typing import Iterable, Sequence

#: Where torchrun writes every rank's stdout/stderr (relative to the working directory; ``NBDDP_LOG_DIR``).
LOG_DIR = "nbddp_logs"


def under_torchrun() -> bool:
    """True inside a process that torchrun (torch elastic) started."""
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ


def process_count() -> int:
    """``NBDDP_NPROC`` when set, else one process per visible GPU, else two (CPU, gloo)."""
    if os.environ.get("NBDDP_NPROC"):
        return int(os.environ["NBDDP_NPROC"])
    import torch

    return torch.cuda.device_count() or 2


def install_argv(argv: Sequence[str]) -> list[str]:
    """``pip …`` runs as ``<this python> -m pip …`` so packages land in the interpreter that trains."""
    argv = list(argv)
    if argv and re.fullmatch(r"pip[0-9.]*", argv[0]):
        return [sys.executable, "-m", "pip", *argv[1:]]
    return argv


def run_installs(installs: Iterable[Sequence[str]]) -> None:
    """Run each install once, in order; a failing install stops the launch with its exit code."""
    for argv in installs:
        argv = install_argv(argv)
        print(f"nbddp: installing: {' '.join(argv)}", flush=True)
        code = subprocess.run(argv).returncode
        if code:
            raise SystemExit(f"nbddp: install failed (exit {code}): {' '.join(argv)}")


def rendezvous(extra: Sequence[str]) -> list[str]:
    """``--standalone`` (a free local port) unless ``extra`` sets up a rendezvous of several machines."""
    return [] if any(a.startswith(("--nnodes", "--rdzv", "--master")) for a in extra) else ["--standalone"]


def torchrun_options(argv: Sequence[str] | None = None) -> list[str]:
    """torchrun options given to the plain run: ``NBDDP_TORCHRUN_ARGS``, then the script's own arguments."""
    return shlex.split(os.environ.get("NBDDP_TORCHRUN_ARGS", "")) + list(sys.argv[1:] if argv is None else argv)


def torchrun_argv(script: str, nproc: int, log_dir: str, extra: Sequence[str] = ()) -> list[str]:
    """torchrun on ``script``: every rank logged to files, rank 0 teed to the console, ``extra`` options."""
    return [
        sys.executable, "-m", "torch.distributed.run",
        *rendezvous(extra), f"--nproc_per_node={nproc}",
        f"--log-dir={log_dir}", "--redirects=3", "--tee=3", "--local-ranks-filter=0",
        *extra,
        script,
    ]


def launch_self(script: str, installs: Iterable[Sequence[str]] = ()) -> int:
    """Run the installs, then torchrun on ``script``; torchrun's exit code."""
    run_installs(installs)
    nproc = process_count()
    log_dir = os.path.abspath(os.environ.get("NBDDP_LOG_DIR") or LOG_DIR)
    print(f"nbddp: starting {nproc} processes with torchrun; every rank's log goes to {log_dir}", flush=True)
    argv = torchrun_argv(os.path.abspath(script), nproc, log_dir, torchrun_options())
    return subprocess.run(argv).returncode


def main(script: str, installs: Iterable[Sequence[str]] = ()) -> None:
    """Return under torchrun; otherwise launch the script on every GPU and exit with torchrun's code."""
    if under_torchrun():
        return
    sys.exit(launch_self(script, installs))
