import sys
import types

import pytest

from nbddp.runtime import shims


@pytest.fixture
def fake_shim(monkeypatch):
    calls = []
    mod = types.ModuleType("nbddp.runtime.shims._fake")
    mod.NAME = "fake"
    mod.detect = lambda: calls.append("detect") or False
    mod.apply = lambda: calls.append("apply") or "fake repaired"
    monkeypatch.setitem(sys.modules, "nbddp.runtime.shims._fake", mod)
    return calls


@pytest.mark.parametrize(
    "env, applied, reason",
    [(None, False, "not needed"), ("1", True, "forced on"), ("0", False, "forced off")],
)
def test_switch_overrides_detection(fake_shim, monkeypatch, env, applied, reason):
    if env is not None:
        monkeypatch.setenv("NBDDP_SHIM_FAKE", env)
    lines = []
    (report,) = shims.apply_all(log=lines.append, names=("_fake",))
    assert (report.applied, report.reason) == (applied, reason)
    assert lines == (["nbddp: fake repaired"] if applied else [])


def test_a_failing_shim_is_reported_not_raised(fake_shim, monkeypatch):
    def boom():
        raise RuntimeError("nope")

    monkeypatch.setattr(sys.modules["nbddp.runtime.shims._fake"], "detect", boom)
    lines = []
    (report,) = shims.apply_all(log=lines.append, names=("_fake",))
    assert not report.applied and report.reason == "failed: nope"
    assert "could not be applied" in lines[0]


def test_each_shim_is_named_as_its_module():
    """``--shim NAME`` and ``NBDDP_SHIM_<NAME>`` name the module a reader opens: runtime/shims/<NAME>.py."""
    assert {m: shims.load(m).NAME for m in shims.SHIMS} == {m: m for m in shims.SHIMS}
