"""What ``%ddp_train?`` and the other magics' help show, and ``%ddp_doctor`` showing each check as it comes."""

import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT
from nbddp import doctor
from nbddp.magics import NbddpMagics
from nbddp.options import SHIM_NAMES
from nbddp.runtime.shims import SHIMS, load


def test_help_texts_are_plain_and_complete():
    helps = {name: getattr(NbddpMagics, name).__doc__ for name in ("ddp_train", "ddp_setup", "ddp_doctor", "ddp_export")}
    for name, text in helps.items():
        assert "``" not in text and not text.startswith("::") and "<" not in text.split("options:")[1], name
        assert text.startswith(f"usage:\n  %{name}") or name == "ddp_train", name
    train = helps["ddp_train"]
    assert train.startswith("usage:\n  %%ddp_train [options] [-- TORCHRUN_ARGS]")
    assert "\n  %ddp_train NOTEBOOK.ipynb [options] [-- TORCHRUN_ARGS]" in train
    no_shim = re.search(r"--no-shim NAME(.*?)\n  --", train, re.S).group(1)
    assert all(n in no_shim for n in SHIM_NAMES)
    assert SHIM_NAMES == tuple(sorted(load(m).NAME for m in SHIMS))  # the help names every shim there is


@pytest.mark.e2e
def test_the_shim_names_come_from_the_shims_folder_without_importing_the_runtime():
    """The help text's names are the module files of runtime/shims; reading them loads neither torch nor the
    runtime (a magic's or the CLI's parser is built in a kernel that may never train)."""
    code = ("import sys, nbddp.options as o; print(' '.join(o.SHIM_NAMES)); "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('nbddp.runtime')))")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    files = sorted(p.stem for p in (ROOT / "src" / "nbddp" / "runtime" / "shims").glob("*.py") if p.stem[0] != "_")
    assert out.splitlines() == [" ".join(files), "[]"]


@pytest.mark.e2e
def test_doctor_shows_each_check_as_it_is_done(monkeypatch):
    shown, at_probe = [], []
    real_probe = doctor.all_reduce_probe

    def probe(**kwargs):
        at_probe.extend(shown)
        return real_probe(**kwargs)

    monkeypatch.setattr(doctor, "all_reduce_probe", probe)
    report = doctor.run(in_kernel=True, nproc=2, timeout_s=120, show=shown.append)
    assert at_probe[0] == "nbddp doctor"
    assert re.match(r"  ok    kernel memory  ", at_probe[1]) and "/dev/shm" in at_probe[2]
    assert at_probe[3].startswith("  ...   all-reduce     starting 2 processes (up to 120 s)")
    assert re.match(r"  ok    all-reduce     2 processes over gloo: correct", shown[-1])
    assert [c.name for c in report.checks] == ["GPUs", "precision", "kernel memory", "/dev/shm", "all-reduce"]
