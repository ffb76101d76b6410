"""Options the magic and the CLI share: environment pairs, shim switches, torchrun's arguments."""

import pytest

from nbddp.errors import NbddpError
from nbddp.options import parse_env, shim_env, split_torchrun_args


def test_parse_env():
    assert parse_env(["A=1", "B=x=y", "EMPTY="]) == {"A": "1", "B": "x=y", "EMPTY": ""}
    for bad in ("NOEQUALS", "=value"):
        with pytest.raises(NbddpError, match="NAME=VALUE"):
            parse_env([bad])


def test_shim_env():
    assert shim_env(on=["unsloth"], off=["gc", "bnb"]) == {
        "NBDDP_SHIM_UNSLOTH": "1", "NBDDP_SHIM_GC": "0", "NBDDP_SHIM_BNB": "0"}


def test_split_torchrun_args():
    assert split_torchrun_args(["--nproc", "2"]) == (["--nproc", "2"], [])
    assert split_torchrun_args(["--dry-run", "--", "--nnodes=2", "--", "x"]) == (["--dry-run"], ["--nnodes=2", "--", "x"])


def test_allow_divergence_reaches_the_ranks_from_the_cli_and_the_magic():
    from nbddp.cli import _parser
    from nbddp.magics import NbddpMagics

    args = _parser().parse_args(["run", "nb.ipynb", "--allow-divergence"])
    assert shim_env(allow_divergence=args.allow_divergence) == {"NBDDP_ALLOW_DIVERGENCE": "1"}
    assert shim_env() == {}
    assert "--allow-divergence" in NbddpMagics.ddp_train.__doc__
