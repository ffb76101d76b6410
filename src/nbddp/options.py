"""A job's run options, in one table for ``nbddp run`` and ``%%ddp_train``, and what they become for ``run_job``.

Kept light (no converter, no launcher, no IPython), like ``export/options.py``, so building either parser
costs nothing. Each front end adds only its own options (the magic's ``--dry-run``/``--out``/``--source``, the
notebook argument) to ``RUN_OPTIONS``. An option whose ``dest`` is a ``run_job`` keyword reaches it as it
is, so a new one is one line of the table; the rest are translated in ``run_options``.
"""

from __future__ import annotations

import argparse
import pkgutil
import sys
from pathlib import Path
from typing import Iterable

from . import preflight
from .errors import NbddpError


def shim_names() -> tuple[str, ...]:
    """The names ``--shim``/``--no-shim`` take, in alphabetical order: the module names of ``runtime/shims``,
    read from its folder (each shim's ``NAME`` is its module's name, a test checks; importing the modules
    would import torch, too slow for a help text)."""
    folder = Path(__file__).resolve().parent / "runtime" / "shims"
    return tuple(sorted(m.name for m in pkgutil.iter_modules([str(folder)]) if not m.name.startswith("_")))


SHIM_NAMES = shim_names()


def processes(text: str) -> int | None:
    """``--nproc``: ``auto`` (None: one per GPU, 2 without GPUs) or a whole number, which
    ``check_job_options`` then checks (so a 0 gets the same message everywhere)."""
    if text == "auto":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes a number of processes or auto, not {text!r}") from None


def folder(text: str) -> Path:
    """A folder option (``--runs-dir``): not empty (``Path("")`` would quietly be the current folder)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"takes a folder, not {text!r}")
    return Path(text)


Option = tuple[tuple[str, ...], dict]

#: The run options of ``nbddp run`` and ``%%ddp_train`` as (flags, argparse keywords), in their order in the
#: help; both parsers are built from this.
RUN_OPTIONS: tuple[Option, ...] = (
    (("--nproc",), dict(type=processes, default=None, metavar="N|auto",
                        help="processes: one per GPU by default, 2 without GPUs")),
    (("--timeout",), dict(dest="timeout_s", type=float, metavar="SECONDS", help="stop every rank after this many seconds")),
    (("--collective-timeout",), dict(dest="collective_timeout_s", type=float, metavar="SECONDS",
                                     help="fail a collective (all-reduce, barrier) that waits longer than this (default 1800)")),
    (("--resume",), dict(action="store_true", help="trainer.train() continues from the last checkpoint")),
    (("--shim",), dict(action="append", default=[], metavar="NAME",
                       help="force a compatibility shim on; NAME is one of " + ", ".join(SHIM_NAMES))),
    (("--no-shim",), dict(action="append", default=[], metavar="NAME",
                          help="force a compatibility shim off; NAME is one of " + ", ".join(SHIM_NAMES))),
    (("--no-checkpointing",), dict(action="store_true", help="run every gradient checkpoint as a plain call "
                                   "(more memory; NBDDP_DISABLE_CHECKPOINTING=1)")),
    (("--allow-divergence",), dict(action="store_true", help="let ranks train apart on purpose: no check that "
                                   "replicas stay in sync (NBDDP_ALLOW_DIVERGENCE=1)")),
    (("--strategy",), dict(default="auto", choices=("auto", "ddp", "fsdp", "split", "deepspeed"),
                           help="how the model is spread over the GPUs: auto (ddp where a replica fits the smallest "
                                "GPU, else fsdp, else split; the estimate is printed), ddp, fsdp, split or deepspeed")),
    (("--every-rank",), dict(action="store_true", help="run every cell on every rank even where nbddp finds no "
                             "training call (otherwise refused before launch)")),
    (("--env",), dict(action="append", default=[], metavar="K=V", help="an environment variable for the ranks (repeatable)")),
    (("--skip-installs",), dict(action="store_true", help="do not run the notebook's pip installs before launch")),
    (("--skip-bad-cells",), dict(action="store_true", help="leave out cells that do not parse, with a warning")),
    (("--runs-dir",), dict(type=folder, metavar="DIR", help="where run directories go (default: ./nbddp_runs)")),
    (("--nnodes",), dict(metavar="N", help="machines in the job (multi-node; with --rdzv-endpoint)")),
    (("--node-rank",), dict(type=int, metavar="RANK", help="this machine's rank among them (static rendezvous)")),
    (("--rdzv-endpoint",), dict(metavar="HOST:PORT", help="c10d rendezvous endpoint, the same on every machine")),
)

#: What a front end says about arguments after ``--``.
TORCHRUN_EPILOG = "Arguments after -- go to torchrun as they are, e.g. -- --nnodes=2 --node-rank=0"

#: Dests ``run_options`` turns into ``env`` or torchrun's arguments; every other dest is a ``run_job`` keyword.
_TRANSLATED = ("shim", "no_shim", "no_checkpointing", "allow_divergence", "env", "nnodes", "node_rank", "rdzv_endpoint")


def dest(option: Option) -> str:
    """The attribute argparse stores an option under."""
    flags, keywords = option
    return keywords.get("dest") or flags[0].lstrip("-").replace("-", "_")


def run_options(args: argparse.Namespace, torchrun_args: Iterable[str] = ()) -> dict:
    """``run_job``'s keywords from arguments parsed with ``RUN_OPTIONS`` (and torchrun's, after ``--``),
    checked before anything starts: the nodes and the runs folder (``preflight``), the numbers
    (``check_job_options``); more CPU processes than cores is said as a warning."""
    from .job import check_job_options
    from .launch import node_args

    keywords = {dest(o): getattr(args, dest(o)) for o in RUN_OPTIONS if dest(o) not in _TRANSLATED}
    keywords["env"] = {**parse_env(args.env), **shim_env(on=args.shim, off=args.no_shim, no_checkpointing=args.no_checkpointing,
                                                        allow_divergence=args.allow_divergence)}
    keywords["torchrun_args"] = node_args(args.nnodes, args.node_rank, args.rdzv_endpoint) + list(torchrun_args)
    preflight.check_nodes(args.nnodes, args.node_rank, args.rdzv_endpoint)
    preflight.check_folder(args.runs_dir, "--runs-dir")
    check_job_options(nproc=keywords["nproc"], timeout_s=keywords["timeout_s"],
                      collective_timeout_s=keywords["collective_timeout_s"], torchrun_args=keywords["torchrun_args"])
    for warning in preflight.check_processes(keywords["nproc"]):  # refused above where it cannot run
        print(f"nbddp: warning: {warning}", file=sys.stderr)
    return keywords


def split_torchrun_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """``[ours…, "--", torchrun's…]`` → ``(ours, torchrun's)``: after ``--`` everything goes to torchrun."""
    if "--" not in argv:
        return list(argv), []
    at = argv.index("--")
    return argv[:at], argv[at + 1 :]


def shim_env(on: Iterable[str] = (), off: Iterable[str] = (), no_checkpointing: bool = False,
             allow_divergence: bool = False) -> dict[str, str]:
    """``--shim NAME`` / ``--no-shim NAME`` as the ``NBDDP_SHIM_<NAME>`` variables the ranks read;
    ``--no-checkpointing`` as ``NBDDP_DISABLE_CHECKPOINTING=1``; ``--allow-divergence`` (ranks meant to train
    apart: the safety net of ``runtime/divergence.py`` off) as ``NBDDP_ALLOW_DIVERGENCE=1``."""
    env = {f"NBDDP_SHIM_{n.upper()}": "1" for n in on}
    env.update({f"NBDDP_SHIM_{n.upper()}": "0" for n in off})
    if no_checkpointing:
        env["NBDDP_DISABLE_CHECKPOINTING"] = "1"
    if allow_divergence:
        env["NBDDP_ALLOW_DIVERGENCE"] = "1"
    return env


def parse_env(pairs: Iterable[str]) -> dict[str, str]:
    """``["K=V", …]`` as a dict; raises ``NbddpError`` for an item without ``=`` or a name."""
    env = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise NbddpError(f"--env expects NAME=VALUE, got {pair!r}")
        env[key.strip()] = value
    return env
