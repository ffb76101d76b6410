"""IPython magics: ``%%ddp_train``, ``%%ddp_setup``, ``%ddp_doctor``, ``%ddp_export``. ``%load_ext nbddp``
registers them.

Thin on purpose: parse the arguments, call the API (``cells``, ``convert``, ``job``, ``doctor``), render with
``display``. ``%ddp_train?`` shows every option.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import MagicHelpFormatter, argument, kwds, magic_arguments, parse_argstring
from IPython.utils.process import arg_split

from . import doctor, executions
from .kernel_cells import select_cells
from .selection import SOURCES, Registry, find_notebook
from .display import LivePanel, cell_label, outcome_error
from .errors import NbddpError
from .export import OPTIONS as EXPORT_OPTIONS
from .export import export_options
from .guard import guard
from .job import plan_job, prepare_job, run_job
from .kept.changed import cells_ran_here
from .kept.channel import Channel
from .kept.controller import KeptJob
from .kept.magics import DEFAULT_IDLE_MIN, KeptMagics
from .options import RUN_OPTIONS, SHOW_OPTIONS, RunOptions, split_torchrun_args
from .preflight import check_output_file


# argparse fills in %(prog)s here, so "%%" is one "%"; the heading adds the first line's other "%"
TRAIN_USAGE = """%%ddp_train [options] [-- TORCHRUN_ARGS]                  a cell: the cells above it, then this one
  %%ddp_train NOTEBOOK.ipynb [options] [-- TORCHRUN_ARGS]    a whole notebook file (or a script.py)"""


#: ``%%ddp_train``'s own options, before the run options it shares with ``nbddp run`` (``options.RUN_OPTIONS``).
TRAIN_OPTIONS = (
    *SHOW_OPTIONS,  # --dry-run (the plan, the cells taken and the script; nothing started), --show-script
    (("--diff",), dict(action="store_true", help="show a unified diff from the cells' code to the script")),
    (("--save",), dict(metavar="PATH", help="also write the script (and PATH.map.json) to PATH")),
    (("--keep",), dict(action="store_true", help="keep the ranks up after training, holding the model, trainer and data, "
                      "for %%%%ddp cells, %%ddp_pull, %%ddp_push, %%ddp_status; %%ddp_stop ends them")),
    (("--idle-limit",), dict(type=float, default=DEFAULT_IDLE_MIN, metavar="MIN",
                             help="with --keep: end the kept ranks after MIN minutes without a request (default: "
                                  f"{DEFAULT_IDLE_MIN:g}, so an abandoned session stops spending GPU quota; 0: never)")),
    (("--out",), dict(default="_ddp", metavar="VAR", help="the variable that gets the result (default: _ddp)")),
    (("--source",), dict(default="auto", choices=("auto", *SOURCES),
                         help="where the job's cells come from: %%%%ddp_setup cells, the notebook file above this "
                              "cell, or the kernel's history (auto: the first of these that has them)")),
)


class _HelpFormatter(MagicHelpFormatter):
    """IPython's magic help with a plain ``usage:`` heading instead of a reStructuredText block."""

    def add_usage(self, usage, actions, groups, prefix="usage:\n  %"):
        super(MagicHelpFormatter, self).add_usage(usage, actions, groups, prefix)

    # argparse's own option forms (--nproc N|auto), not IPython's reStructuredText-safe <N|auto>
    _format_action_invocation = argparse.HelpFormatter._format_action_invocation


def _arguments(options):
    """``@argument`` for each (flags, keywords) of ``options``, in their order in the help."""

    def decorate(func):
        for flags, keywords in reversed(options):
            func = argument(*flags, **keywords)(func)
        return func

    return decorate


@magics_class
class NbddpMagics(Magics):
    """nbddp's magics, with the cells ``%%ddp_setup`` registered in this kernel."""

    def __init__(self, shell):
        super().__init__(shell)
        self.registry = Registry()
        self.record = executions.follow(shell)  # what the kernel ran, for %%ddp_train and a re-run %%ddp_setup
        self.kept = KeptMagics(shell, lambda: self.registry.cells, self.record)  # the kept job's magics (%%ddp, …), registered beside these

    def _execution_count(self) -> int:
        """The running cell's ``[N]``: its history entry is stored before it runs (in every IPython version,
        while ``shell.execution_count`` moves before or after the cell depending on the version)."""
        return len(self.shell.history_manager.input_hist_raw) - 1

    def unregister(self) -> None:
        executions.unfollow(self.shell)

    @magic_arguments()
    @kwds(usage=TRAIN_USAGE, formatter_class=_HelpFormatter)
    @argument("notebook", nargs="?", help="as a line magic: a notebook file to train whole")
    @_arguments(TRAIN_OPTIONS)
    @_arguments(RUN_OPTIONS)
    @line_cell_magic
    @guard("running %%ddp_train", passthrough=(UsageError,))
    def ddp_train(self, line: str, cell: str | None = None):
        """Train on every GPU: the cells before this one plus this cell, as a DDP script run by torchrun.

        The cell shows a live panel (progress, speed, ETA, loss curve, the Trainer's logged metrics) and
        the last lines of rank 0's output, both updated in place, then a summary. The result lands in _ddp
        (or --out VAR): metrics, log_history, output_dir, adapters, script_path, log_dir. A failing rank's
        traceback is shown at its notebook cell and line; interrupting the kernel stops every rank. As a
        line magic, %ddp_train path/to/notebook.ipynb trains a whole notebook (or a script.py). Arguments after -- go to
        torchrun, e.g. %%ddp_train -- --nnodes=2 --node-rank=0 --rdzv-endpoint=HOST:29500
        """
        ours, torchrun_args = split_torchrun_args(arg_split(line, posix=True))
        args = self.ddp_train.parser.parse_args(ours)
        if (cell is None) == (args.notebook is None):
            raise UsageError("%ddp_train NOTEBOOK.ipynb trains a notebook file; %%ddp_train (a cell) trains the cells above it")
        if not args.out.isidentifier():
            raise UsageError(f"--out takes a variable name, not {args.out!r}")
        options = RunOptions.parse(args, torchrun_args)
        check_output_file(args.save, "--save")
        selection = kernel = None
        if cell is None:
            prepared, label = prepare_job(args.notebook, skip_bad_cells=args.skip_bad_cells, keep=args.keep,
                                          every_rank=options.every_rank), None
        else:
            kernel = self.record.snapshot(self._execution_count(), f"%%ddp_train {line}\n{cell}")
            selection = select_cells(
                line, cell, source=args.source, registered=self.registry.cells, kernel=kernel,
                notebook=find_notebook(self.shell.user_ns, os.environ, Path.cwd()),
            )
            print(selection.report())  # with --dry-run the plan says where each cell's code came from
            prepared = prepare_job(selection, skip_bad_cells=args.skip_bad_cells, keep=args.keep,
                                   every_rank=options.every_rank)
            label = cell_label(selection.cells, selection.numbering)
        self._show_script(prepared.script, args)
        self._check_idle_limit(args)
        if args.dry_run:  # the plan the run would follow, refused as the run would be; nothing stopped or started
            print(plan_job(prepared, options, keep=args.keep).describe())
            return
        self._stop_kept_job()  # before the machine is read: its GPUs are this job's
        # the one plan, before the panel shows anything; a kept job may only load what later %%ddp cells train
        plan = plan_job(prepared, options, keep=args.keep, say=print)
        warning = doctor.kernel_memory_warning()
        if warning:
            print(f"nbddp: warning: {warning}", file=sys.stderr)
        nproc = plan.processes
        panel = LivePanel(nproc)
        channel = Channel(nproc, args.idle_limit * 60 or None) if args.keep else None
        try:
            job = run_job(plan, view=panel, keep=channel)
        finally:
            if channel is not None and not channel.ready():
                channel.close()
        self.shell.user_ns[args.out] = job
        panel.close(job)
        if job.run.process is not None:
            registered = cell is not None and selection.source == "registered"
            setup = tuple(c.source for c in self.registry.cells) if registered else None
            self.kept.start(KeptJob(job.run.process, channel, job.run_dir, list(prepared.script.cells), job.cwd, setup,
                                    ran_here=cells_ran_here(selection, kernel), started_at=self._execution_count()))
            print(f"nbddp: the {nproc} rank(s) stay up: %%ddp cells run on them; %ddp_stop ends them"
                  + (f" (or {args.idle_limit:g} min idle)" if args.idle_limit else ""))
        error = outcome_error(job, label)
        if error:
            raise error

    @staticmethod
    def _check_idle_limit(args) -> None:
        if args.keep and args.idle_limit < 0:
            raise UsageError(f"--idle-limit takes minutes, 0 or more, not {args.idle_limit:g}")

    def _stop_kept_job(self) -> None:
        """A kept job from before is stopped first: a new job needs its GPUs."""
        if self.kept.job is not None and self.kept.job.alive:
            print("nbddp: stopping the kept job first: this job needs its GPUs")
        self.kept.start(None)

    @staticmethod
    def _show_script(script, args) -> None:
        """The script's warnings, and what --save, --dry-run, --show-script and --diff ask for, before training."""
        for warning in script.warnings:
            print(f"nbddp: warning: {warning}", file=sys.stderr)
        if args.save:
            print(f"nbddp: script written to {script.write(args.save)}")
        if args.dry_run or args.show_script:  # a dry run shows the script too: the cells' code as it runs
            print(script.text)
        if args.diff:
            print(script.diff())

    @magic_arguments()
    @kwds(formatter_class=_HelpFormatter)
    @argument("--also-here", action="store_true", help="run the cell in this kernel too")
    @argument("--list", action="store_true", help="as a line magic: list the registered cells")
    @argument("--clear", action="store_true", help="as a line magic: forget every registered cell")
    @line_cell_magic
    @guard("running %%ddp_setup", passthrough=(UsageError,))
    def ddp_setup(self, line: str, cell: str | None = None):
        """Mark a cell as part of the next %%ddp_train job without running it here, so the kernel does not
        load the model onto a GPU the ranks need. Running the cell again replaces what it registered.
        %ddp_setup --list shows the registered cells, %ddp_setup --clear forgets them.
        """
        args = parse_argstring(self.ddp_setup, line)
        if cell is None:
            if args.clear:
                self.registry.clear()
            print(self.registry.describe())
            return
        added = self.registry.add(f"%%ddp_setup {line}\n{cell}", self._execution_count(), self.record.running_cell_id)
        where = "run here too" if args.also_here else "not run here"
        state = "registered for the job" if added else "empty: nothing registered"
        print(f"nbddp: {state} ({len(self.registry)} cell(s) in all); {where}")
        if args.also_here and not self.shell.run_cell(cell, store_history=False).success:
            raise NbddpError("the cell failed in this kernel (traceback above); it is registered for the job all the same")

    @magic_arguments()
    @kwds(formatter_class=_HelpFormatter)
    @argument("notebook", nargs="?", help="the notebook whose memory to estimate (default: the %%%%ddp_setup "
              "cells, else the notebook this kernel runs, as last saved)")
    @argument("--nproc", type=int, help="processes for the all-reduce (default: one per GPU, 2 without GPUs)")
    @argument("--timeout", type=float, default=doctor.DEFAULT_TIMEOUT_S, metavar="S", help="give up the all-reduce after S seconds")
    @line_magic
    @guard("running %ddp_doctor", passthrough=(UsageError,))
    def ddp_doctor(self, line: str):
        """Pre-flight checks: GPUs and precisions, GPU memory this kernel holds, /dev/shm, an all-reduce across
        every GPU (gloo on CPU), the DataParallel trap of training in a kernel that sees several GPUs, and
        the memory one rank of this notebook needs with the strategy --strategy auto would pick."""
        args = parse_argstring(self.ddp_doctor, line)
        job = self._job_at_hand(args.notebook)
        doctor.run(in_kernel=True, nproc=args.nproc, timeout_s=args.timeout, show=lambda text: print(text, flush=True),
                   script_text=job.script.text if job else None, cwd=job.cwd if job else None)

    def _job_at_hand(self, notebook: str | None):
        """The notebook at hand, converted (``prepare_job``): the file given, else the registered
        ``%%ddp_setup`` cells, else the saved notebook this kernel runs; None where there is none."""
        try:
            if notebook:
                return prepare_job(Path(notebook))
            if len(self.registry):
                return prepare_job(self.registry.cells)
            path = find_notebook(self.shell.user_ns, os.environ, Path.cwd())
            return prepare_job(path) if path else None
        except NbddpError as exc:
            print(f"nbddp: warning: no memory estimate: {exc}", file=sys.stderr)
            return None

    @magic_arguments()
    @kwds(formatter_class=_HelpFormatter)
    @argument("notebook", nargs="?", help="the notebook file (default: the one this kernel runs, as last saved)")
    @_arguments(EXPORT_OPTIONS)
    @line_magic
    @guard("running %ddp_export", passthrough=(UsageError,))
    def ddp_export(self, line: str):
        """Export a notebook as a Kaggle Script kernel that trains on every GPU of Kaggle's machine: a
        self-launching script and its kernel-metadata.json in DIR, for !kaggle kernels push -p DIR.

        Without a path it exports the notebook this kernel runs, as last saved: save it first. Cells holding
        a token or key stop the export at their cell and line (--allow-secrets to go on); cells tagged
        nbddp-skip are left out. Example: %ddp_export --kaggle kaggle_out --id me/my-finetune
        """
        from .export import export_kaggle

        args = parse_argstring(self.ddp_export, line)
        path = Path(args.notebook) if args.notebook else find_notebook(self.shell.user_ns, os.environ, Path.cwd())
        if path is None:
            raise UsageError("this kernel does not say which notebook it runs: give its path, "
                             "%ddp_export my_notebook.ipynb --kaggle DIR --id USER/SLUG")
        result = export_kaggle(path, args.kaggle, **export_options(args))
        for warning in result.warnings:
            print(f"nbddp: warning: {warning}", file=sys.stderr)
        print(f"nbddp: exported {path.name}: {result}")
