"""The export's command-line options, in one place for ``nbddp export`` and ``%ddp_export``.

Kept apart from ``kaggle.py`` so building either parser imports nothing heavy (the converter).
"""

from __future__ import annotations

from pathlib import Path

from ..options import RUN_OPTIONS, dest

#: The run options an exported kernel cannot take, and why: its one script runs under Kaggle's own limits.
NOT_EXPORTED = {
    "timeout_s": "the kernel runs under Kaggle's own time limit",
    "runs_dir": "the ranks' logs go to nbddp_logs/ in the kernel's output (NBDDP_LOG_DIR)",
}

#: The export's own options as (flags, argparse keywords), then the run options it shares with ``nbddp run``
#: (``options.RUN_OPTIONS``, one table): ``nbddp export`` and ``%ddp_export`` are built from this.
OWN_OPTIONS: tuple[tuple[tuple[str, ...], dict], ...] = (
    (("--kaggle",), dict(type=Path, required=True, metavar="DIR", help="folder for `kaggle kernels push -p DIR`")),
    (("--id",), dict(required=True, dest="kernel_id", metavar="USER/SLUG", help="the kernel's Kaggle id")),
    (("--title",), dict(help="the kernel's title (default: made from the slug; must slug to it)")),
    (("--accelerator",), dict(default="NvidiaTeslaT4", help="NvidiaTeslaT4 (two T4s, the default), NvidiaTeslaP100 or none")),
    (("--dataset",), dict(action="append", default=[], metavar="OWNER/SLUG", help="a dataset to attach (repeatable)")),
    (("--public",), dict(dest="private", action="store_false", help="a public kernel (default: private)")),
    (("--allow-secrets",), dict(action="store_true", help="export even if a cell holds a token or key")),
)
RUN_EXPORTED = tuple(o for o in RUN_OPTIONS if dest(o) not in NOT_EXPORTED)
OPTIONS = (*OWN_OPTIONS, *RUN_EXPORTED)


def export_options(args) -> dict:
    """``export_kaggle``'s keywords from arguments parsed with ``OPTIONS``: the export's own, and the run
    options' (``RunOptions``' fields, by their ``dest``)."""
    own = dict(kernel_id=args.kernel_id, title=args.title, accelerator=args.accelerator, datasets=args.dataset,
               private=args.private, allow_secrets=args.allow_secrets)
    run = {dest(o): getattr(args, dest(o)) for o in RUN_EXPORTED}
    return {**own, **run, "torchrun_args": tuple(getattr(args, "torchrun_args", ()))}  # the CLI's, after --
