"""A job's run options, in one table for ``nbddp run`` and ``%%ddp_train``, and the one checked record of them,
``RunOptions``, that ``run_job`` and ``launch.plan`` take.

Kept light (no converter, no launcher, no IPython), like ``export/options.py``, so building either parser
costs nothing. Each front end adds only its own options (the magic's ``--dry-run``/``--out``/``--source``, the
notebook argument) to ``RUN_OPTIONS``. Each option's ``dest`` is a field of ``RunOptions``, so a new option
is its row in the table and its field (a test holds the two to each other); what a field becomes for the
ranks or torchrun is said once, in ``RunOptions.rank_env`` and ``RunOptions.torchrun_argv``.
"""

from __future__ import annotations

import argparse
import math
import os
import pkgutil
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from . import preflight
from .errors import NbddpError
from .gpus import Machine, read_machine


def shim_names() -> tuple[str, ...]:
    """The names ``--shim``/``--no-shim`` take, in alphabetical order: the module names of ``runtime/shims``,
    read from its folder (each shim's ``NAME`` is its module's name, a test checks; importing the modules
    would import torch, too slow for a help text)."""
    folder = Path(__file__).resolve().parent / "runtime" / "shims"
    return tuple(sorted(m.name for m in pkgutil.iter_modules([str(folder)]) if not m.name.startswith("_")))


SHIM_NAMES = shim_names()


def processes(text: str) -> int | None:
    """``--nproc``: ``auto`` (None: one per GPU, 2 without GPUs) or a whole number, which
    ``RunOptions`` then checks (so a 0 gets the same message everywhere)."""
    if text == "auto":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes a number of processes or auto, not {text!r}") from None


def check_nproc(nproc) -> None:
    """``--nproc`` as given (None: one per GPU): refused (``NbddpError``) below 1 or not a whole number."""
    if nproc is not None and (isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1):
        raise NbddpError(f"--nproc takes a whole number of processes of at least 1, not {nproc}")


def folder(text: str) -> Path:
    """A folder option (``--runs-dir``): not empty (``Path("")`` would quietly be the current folder)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"takes a folder, not {text!r}")
    return Path(text)


Option = tuple[tuple[str, ...], dict]

#: What ``--strategy`` takes (``choose_strategy.decide`` reads the same): ``auto`` and the strategies a rank runs,
#: ``runtime/apply_strategy.STRATEGIES``. Written out here, not imported: a parser built in a kernel that may
#: never train loads no runtime module (tests/test_help_doctor.py); tests/test_export.py holds the two equal.
STRATEGIES = ("auto", "ddp", "fsdp", "split", "deepspeed")

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
    (("--strategy",), dict(default="auto", choices=STRATEGIES,
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

#: What both front ends that train (``nbddp run``, ``%%ddp_train``) can show instead of or before training: the
#: job's plan (``job_plan.JobPlan.describe``), the script. Not run options: nothing of the run changes.
SHOW_OPTIONS: tuple[Option, ...] = (
    (("--dry-run",), dict(action="store_true", help="show the job's plan (mode, processes, strategy and why, the "
                          "ranks' environment, the cells) and start nothing; refused as the run would be")),
    (("--show-script",), dict(action="store_true", help="show the generated script (before training, or with --dry-run)")),
)

#: What a front end says about arguments after ``--``.
TORCHRUN_EPILOG = "Arguments after -- go to torchrun as they are, e.g. -- --nnodes=2 --node-rank=0"

def dest(option: Option) -> str:
    """The attribute argparse stores an option under, and the ``RunOptions`` field it fills."""
    flags, keywords = option
    return keywords.get("dest") or flags[0].lstrip("-").replace("-", "_")


@dataclass(frozen=True)
class RunOptions:
    """A job's run options, checked once, when made: a field per row of ``RUN_OPTIONS`` (its ``dest``), as a
    person gave it, and ``torchrun_args``, what followed ``--``. ``run_job`` and ``launch.plan`` take it.

    Making one refuses, before anything converts or a run directory exists (``NbddpError``, the words
    naming the option): ``--nproc`` below 1 or above the GPUs torch sees (``preflight.check_processes``), a
    timeout that is not a finite number above 0, a strategy not in ``STRATEGIES``, an ``--env`` item that is
    not NAME=VALUE, nodes torchrun would refuse (``preflight.check_nodes``, ``check_torchrun_args``) and a
    ``--master-port`` that is no port or is busy here. ``warnings`` keeps what is only slow (more CPU processes
    than cores). A front end makes it with ``parse``; the API with keywords (``env`` may be a mapping too).
    ``machine`` is the reading of the GPUs an explicit ``--nproc`` was checked against (``gpus.read_machine``,
    the count, and the free memory where ``nvidia-smi`` gave it), which the job's plan then decides with
    instead of asking again (None without ``--nproc``).
    """

    nproc: int | None = None
    timeout_s: float | None = None
    collective_timeout_s: float | None = None
    resume: bool = False
    shim: tuple[str, ...] = ()
    no_shim: tuple[str, ...] = ()
    no_checkpointing: bool = False
    allow_divergence: bool = False
    strategy: str = "auto"
    every_rank: bool = False
    env: tuple[str, ...] = ()
    skip_installs: bool = False
    skip_bad_cells: bool = False
    runs_dir: str | os.PathLike | None = None
    nnodes: str | int | None = None
    node_rank: int | None = None
    rdzv_endpoint: str | None = None
    torchrun_args: tuple[str, ...] = ()
    warnings: tuple[str, ...] = field(default=(), init=False, repr=False, compare=False)
    machine: Machine | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        env = [f"{k}={v}" for k, v in self.env.items()] if isinstance(self.env, Mapping) else self.env or ()
        for name, items in (("shim", self.shim), ("no_shim", self.no_shim), ("env", env),
                            ("torchrun_args", self.torchrun_args)):
            object.__setattr__(self, name, tuple(items))  # frozen all through: lists from argparse become tuples
        object.__setattr__(self, "warnings", tuple(self._check()))

    @classmethod
    def parse(cls, args: argparse.Namespace, torchrun_args: Iterable[str] = ()) -> "RunOptions":
        """The run options of arguments parsed with ``RUN_OPTIONS`` (and torchrun's, after ``--``), checked;
        the ``--runs-dir`` a person typed is tried too (``preflight.check_folder``), and the warnings said
        on stderr."""
        options = cls(**{dest(o): getattr(args, dest(o)) for o in RUN_OPTIONS}, torchrun_args=tuple(torchrun_args))
        preflight.check_folder(options.runs_dir, "--runs-dir")
        for warning in options.warnings:
            print(f"nbddp: warning: {warning}", file=sys.stderr)
        return options

    def _check(self) -> list[str]:
        """Refuse what no job can run with (``NbddpError``); return what is only slow."""
        nproc = self.nproc
        check_nproc(nproc)
        if nproc is not None:  # the job's one reading of the machine (its plan takes it: ``plan_job``)
            object.__setattr__(self, "machine", read_machine(memory=False))
        gpus = self.machine.gpus if self.machine else 0
        warnings = preflight.check_processes(nproc, gpus=gpus)  # no more than the GPUs torch sees
        if nproc is not None and not gpus:
            warnings += preflight.check_cpu_memory(nproc)  # CPU ranks: no more than the memory holds
        for flag, seconds in (("--timeout", self.timeout_s), ("--collective-timeout", self.collective_timeout_s)):
            if seconds is not None and not (math.isfinite(seconds) and seconds > 0):
                raise NbddpError(f"{flag} takes a number of seconds above 0, not {seconds:g}")
        if self.strategy not in STRATEGIES:
            raise NbddpError(f"--strategy takes one of {', '.join(STRATEGIES)}, not {self.strategy!r}")
        parse_env(self.env)
        if self.shim or self.no_shim:
            preflight.check_shims("--shim", self.shim, switchable())
            preflight.check_shims("--no-shim", self.no_shim, switchable())
        preflight.check_nodes(self.nnodes, self.node_rank, self.rdzv_endpoint)
        preflight.check_master_port(list(self.torchrun_argv))
        preflight.check_torchrun_args(list(self.torchrun_argv))  # -- --nnodes=0 and the like
        return warnings

    @property
    def rank_env(self) -> dict[str, str]:
        """The ranks' variables these options set: ``--env``'s, then the switches (``shim_env``)."""
        switches = shim_env(on=self.shim, off=self.no_shim, no_checkpointing=self.no_checkpointing,
                            allow_divergence=self.allow_divergence)
        return {**parse_env(self.env), **switches}

    @property
    def job_env(self) -> dict[str, str]:
        """What these options tell every rank of the job beside ``rank_env``: the collective timeout
        (``NBDDP_TIMEOUT``, whole seconds, at least 1) and ``--resume`` (``NBDDP_RESUME``); the launcher
        (``launch.plan``) and the Kaggle export (``export/kaggle.kernel_env``) both write these."""
        env = {}
        if self.collective_timeout_s:
            env["NBDDP_TIMEOUT"] = str(max(1, round(self.collective_timeout_s)))
        if self.resume:
            env["NBDDP_RESUME"] = "1"
        return env

    @property
    def torchrun_argv(self) -> tuple[str, ...]:
        """torchrun's arguments: the nodes' (``node_args``), then those after ``--``."""
        return (*node_args(self.nnodes, self.node_rank, self.rdzv_endpoint), *self.torchrun_args)


def switchable() -> tuple[str, ...]:
    """What ``--shim``/``--no-shim`` take: the shims (``SHIM_NAMES``) and the features ``setup()`` installs under
    an ``NBDDP_SHIM_<NAME>`` switch of their own (``runtime.lifecycle.INSTALLS``: saves, notices …), read
    only when a name is given (importing the runtime's list costs a few hundredths of a second)."""
    from .runtime.lifecycle import INSTALLS

    own = (i.switch.removeprefix("NBDDP_SHIM_").lower() for i in INSTALLS if i.switch.startswith("NBDDP_SHIM_"))
    return tuple(sorted({*SHIM_NAMES, *(n for n in own if "<" not in n)}))


def node_args(nnodes: int | str | None = None, node_rank: int | None = None,
              rdzv_endpoint: str | None = None) -> list[str]:
    """torchrun's multi-node arguments: ``--nnodes``, ``--node-rank``, and a c10d rendezvous at an endpoint.

    Every node runs the same job with the same ``nnodes`` and ``rdzv_endpoint`` (``host:port`` of one of
    them); the c10d rendezvous assigns ranks, ``node_rank`` only orders nodes under the static backend.
    """
    args = []
    if nnodes is not None:
        args.append(f"--nnodes={nnodes}")
    if node_rank is not None:
        args.append(f"--node-rank={node_rank}")
    if rdzv_endpoint:
        args += ["--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}"]
    return args


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
