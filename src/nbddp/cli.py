"""``nbddp convert | run | export | doctor``: a thin shell over the API. Errors meant for the user print without a traceback."""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
from pathlib import Path

from . import __version__
from .errors import NbddpError
from .guard import guarded
from .options import RUN_OPTIONS, SHOW_OPTIONS, TORCHRUN_EPILOG, split_torchrun_args


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nbddp", description="Train a notebook on every GPU through torchrun.")
    p.add_argument("--version", action="version", version=f"nbddp {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("convert", help="write the DDP training script for a notebook")
    c.add_argument("notebook", type=Path)
    c.add_argument("-o", "--output", help="script path (default: print to stdout)")
    c.add_argument("--diff", action="store_true", help="print a unified diff from the notebook's code to the script")
    c.add_argument("--explain", action="store_true", help="list each change with its cell and line")
    c.add_argument("--skip-bad-cells", action="store_true", help="leave out cells that do not parse, with a warning")

    r = sub.add_parser("run", help="convert a notebook and train it under torchrun", epilog=TORCHRUN_EPILOG)
    r.add_argument("notebook", type=Path, help="the notebook file to train")
    for flags, options in (*RUN_OPTIONS, *SHOW_OPTIONS):
        r.add_argument(*flags, **options)

    e = sub.add_parser("export", help="write a self-launching Kaggle Script kernel and its kernel-metadata.json")
    e.add_argument("notebook", type=Path)
    from .export.options import OPTIONS as EXPORT_OPTIONS

    for flags, options in EXPORT_OPTIONS:
        e.add_argument(*flags, **options)

    d = sub.add_parser("doctor", help="pre-flight checks: GPUs, precision, /dev/shm, an all-reduce across every GPU")
    d.add_argument("notebook", type=Path, nargs="?", help="also estimate the memory one rank of this notebook needs")
    d.add_argument("--nproc", type=int, default=None, help="processes for the all-reduce (default: one per GPU; 2 without GPUs)")
    d.add_argument("--timeout", type=float, default=None, help="give up the all-reduce after this many seconds "
                   "(default: the doctor's, doctor.DEFAULT_TIMEOUT_S)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv, extra = split_torchrun_args(list(sys.argv[1:] if argv is None else argv))  # after --: torchrun's
    args = _parser().parse_args(argv)
    args.torchrun_args = extra
    from .launch import STOP_SIGNALS, JobStopped, raise_job_stopped

    for sig in STOP_SIGNALS:  # a scheduler's stop or a closed terminal ends the job as Ctrl-C does
        if signal.getsignal(sig) is not signal.SIG_IGN:
            signal.signal(sig, raise_job_stopped)
    try:
        with guarded(f"running nbddp {args.command} {args.notebook or ''}".rstrip()):  # never nbddp's traceback
            return _COMMANDS[args.command](args)
    except NbddpError as exc:
        print(f"nbddp: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        with contextlib.suppress(OSError):
            print("nbddp: interrupted", file=sys.stderr)
        return 128 + exc.args[0] if isinstance(exc, JobStopped) else 130


def _convert(args) -> int:
    from .convert import convert_notebook
    from .preflight import check_output_file

    check_output_file(args.output, "-o")
    script = convert_notebook(args.notebook, skip_bad_cells=args.skip_bad_cells)
    for w in script.warnings:
        print(f"nbddp: warning: {w}", file=sys.stderr)
    if args.output:
        script.write(args.output)
        print(f"nbddp: wrote {args.output} ({len(script.changes)} changes, {len(script.installs)} installs)", file=sys.stderr)
    if args.explain:
        for change in script.changes:
            print(f"{change}  [{change.rule}]")
        for inst in script.installs:
            print(f"cell {inst.cell}, line {inst.line}: install before launch: {inst.command}  [install]")
    if args.diff:
        sys.stdout.write(script.diff())
    if not (args.output or args.explain or args.diff):
        sys.stdout.write(script.text)
    return 0


def _run(args) -> int:
    from .display import TerminalView, failure_report, summary
    from .job import plan_job, prepare_job, run_job
    from .launch import warm_start, where_ranks_were
    from .options import RunOptions

    options = RunOptions.parse(args, args.torchrun_args)
    source = args.notebook
    if args.show_script or args.dry_run:  # converted first, to show; run_job takes the converted job on
        source = prepare_job(args.notebook, skip_bad_cells=options.skip_bad_cells, every_rank=options.every_rank)
    if args.show_script:
        print(source.script.text)
    if args.dry_run:  # the plan the run would follow, refused as it would be; nothing made or started
        plan = plan_job(source, options)
        for w in source.script.warnings:
            print(f"nbddp: warning: {w}", file=sys.stderr)
        print(plan.describe())
        return 0
    view = TerminalView()  # the bar on one line, the metrics as a table, nothing printed on a bar's line
    with warm_start.not_for_one_launch():  # a warm process would import what the one agent does, no less
        job = run_job(source, options, view)
    result = job.run
    view.finish(result)  # rank 0's consequent traceback folded to one line
    for w in job.script.warnings:
        print(f"nbddp: warning: {w}", file=sys.stderr)
    if not (result.failure or result.ok or result.interrupted or result.timed_out):  # those two were said
        print(f"nbddp: torchrun exited with {result.returncode}; see {result.run_dir / 'torchrun.log'}", file=sys.stderr)
    with contextlib.suppress(OSError):  # a closed terminal (SIGHUP)
        print(summary(job), file=sys.stderr)
    if result.failure:  # what a person reads last: the failing rank, its cell and line
        sys.stderr.write(failure_report(result.failure, others=where_ranks_were(result), hidden=[result.script]))
    if result.stopped_by:
        return 128 + result.stopped_by
    return 0 if job.ok else (130 if job.interrupted else 1)


def _export(args) -> int:
    from .export import export_kaggle, export_options

    result = export_kaggle(args.notebook, args.kaggle, **export_options(args))
    for w in result.warnings:
        print(f"nbddp: warning: {w}", file=sys.stderr)
    print(f"nbddp: {result}", file=sys.stderr)
    return 0


def _doctor(args) -> int:
    from .doctor import run

    script = None
    if args.notebook:
        from .convert import convert_notebook

        script = convert_notebook(args.notebook).text
    cwd = args.notebook.resolve().parent if args.notebook else None
    timeout = {} if args.timeout is None else {"timeout_s": args.timeout}  # the default is spelled once, in doctor
    report = run(nproc=args.nproc, script_text=script, cwd=cwd, **timeout)
    print(report.text())
    return 0 if report.ok else 1


_COMMANDS = {"convert": _convert, "run": _run, "export": _export, "doctor": _doctor}

if __name__ == "__main__":
    sys.exit(main())
