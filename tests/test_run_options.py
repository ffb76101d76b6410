"""``nbddp run`` and ``%%ddp_train`` take the same run options, built from one table, and they reach
``run_job`` as the same ``RunOptions``."""

import argparse
import dataclasses

import pytest

from nbddp.cli import _parser
from nbddp.magics import NbddpMagics

SHARED_FLAGS = ("--nproc", "--timeout", "--collective-timeout", "--resume", "--shim", "--no-shim", "--no-checkpointing",
                "--allow-divergence", "--env", "--skip-installs", "--skip-bad-cells", "--runs-dir", "--nnodes",
                "--node-rank", "--rdzv-endpoint", "--strategy", "--every-rank")


def _cli_run_parser() -> argparse.ArgumentParser:
    sub = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["run"]


def _options(parser: argparse.ArgumentParser) -> dict:
    """flag → (dest, help, metavar, default) of each optional argument but -h."""
    return {a.option_strings[-1]: (a.dest, a.help, a.metavar, a.default)
            for a in parser._actions if a.option_strings and a.dest != "help"}


def test_the_cli_and_the_magic_take_the_same_run_options_with_the_same_help():
    cli, magic = _options(_cli_run_parser()), _options(NbddpMagics.ddp_train.parser)
    for flag in SHARED_FLAGS:
        assert flag in cli and flag in magic, flag
        assert cli[flag] == magic[flag], flag


def test_both_are_built_from_the_table():
    from nbddp.options import RUN_OPTIONS, SHOW_OPTIONS, dest

    cli, magic = _options(_cli_run_parser()), _options(NbddpMagics.ddp_train.parser)
    table = {flags[-1]: (dest((flags, kw)), kw["help"]) for flags, kw in RUN_OPTIONS}
    assert set(table) == set(SHARED_FLAGS)
    for flag, (name, help_) in table.items():
        assert cli[flag][:2] == magic[flag][:2] == (name, help_), flag
    shown = {flags[-1] for flags, _ in SHOW_OPTIONS}  # --dry-run, --show-script: both front ends, not run options
    assert set(cli) - set(table) == shown  # the CLI's run options are the table's, no more


@pytest.mark.parametrize("parse", [
    lambda argv: _cli_run_parser().parse_args(["nb.ipynb", *argv]),
    lambda argv: NbddpMagics.ddp_train.parser.parse_args(argv),
], ids=["cli", "magic"])
def test_parsed_options_become_the_same_run_job_keywords(parse):
    from nbddp.options import RUN_OPTIONS, RunOptions, dest

    args = parse(["--nproc", "auto", "--timeout", "30", "--collective-timeout", "60", "--resume", "--shim", "unsloth",
                  "--no-checkpointing", "--env", "A=1", "--nnodes", "2", "--rdzv-endpoint", "host:29400"])
    options = RunOptions.parse(args, ["--max-restarts=0"])
    keywords = {name: getattr(options, name) for name in ("nproc", "timeout_s", "collective_timeout_s", "resume",
                                                          "skip_installs", "skip_bad_cells", "runs_dir", "strategy",
                                                          "every_rank")}
    keywords.update(env=options.rank_env, torchrun_args=list(options.torchrun_argv))
    assert keywords == dict(
        nproc=None, timeout_s=30.0, collective_timeout_s=60.0, resume=True, skip_installs=False, skip_bad_cells=False,
        runs_dir=None, strategy="auto", every_rank=False, env={"A": "1", "NBDDP_SHIM_UNSLOTH": "1", "NBDDP_DISABLE_CHECKPOINTING": "1"},
        torchrun_args=["--nnodes=2", "--rdzv-backend=c10d", "--rdzv-endpoint=host:29400", "--max-restarts=0"],
    )
    fields = {f.name for f in dataclasses.fields(RunOptions) if f.init}
    assert {dest(o) for o in RUN_OPTIONS} | {"torchrun_args"} == fields  # every option is a RunOptions field, by name
    assert RunOptions.parse(parse(["--nproc", "3"])).nproc == 3
