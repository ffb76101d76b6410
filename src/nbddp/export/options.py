"""The export's command-line options, in one place for ``nbddp export`` and ``%ddp_export``.

Kept apart from ``kaggle.py`` so building either parser imports nothing heavy (the converter).
"""

from __future__ import annotations

from pathlib import Path

#: The export's options as (flags, argparse keywords): ``nbddp export`` and ``%ddp_export`` are built from this.
OPTIONS: tuple[tuple[tuple[str, ...], dict], ...] = (
    (("--kaggle",), dict(type=Path, required=True, metavar="DIR", help="folder for `kaggle kernels push -p DIR`")),
    (("--id",), dict(required=True, dest="kernel_id", metavar="USER/SLUG", help="the kernel's Kaggle id")),
    (("--title",), dict(help="the kernel's title (default: made from the slug; must slug to it)")),
    (("--accelerator",), dict(default="NvidiaTeslaT4", help="NvidiaTeslaT4 (two T4s, the default), NvidiaTeslaP100 or none")),
    (("--dataset",), dict(action="append", default=[], metavar="OWNER/SLUG", help="a dataset to attach (repeatable)")),
    (("--public",), dict(dest="private", action="store_false", help="a public kernel (default: private)")),
    (("--allow-secrets",), dict(action="store_true", help="export even if a cell holds a token or key")),
    (("--skip-bad-cells",), dict(action="store_true", help="leave out cells that do not parse, with a warning")),
    (("--strategy",), dict(default="auto", choices=("auto", "ddp", "fsdp", "split", "deepspeed"),
                           help="how the model is spread over the GPUs (auto: estimated for the accelerator's GPUs)")),
    (("--every-rank",), dict(action="store_true", help="export even where nbddp finds no training call: every "
                                                       "cell runs on every rank")),
)


def export_options(args) -> dict:
    """``export_kaggle``'s keywords from arguments parsed with ``OPTIONS``."""
    return dict(kernel_id=args.kernel_id, title=args.title, accelerator=args.accelerator, datasets=args.dataset,
                private=args.private, allow_secrets=args.allow_secrets, skip_bad_cells=args.skip_bad_cells,
                strategy=args.strategy, every_rank=args.every_rank)
