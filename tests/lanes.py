"""Keeps the two test lanes honest: a test marked ``e2e`` must start a process, and a test that starts one must be
marked ``e2e``.

``make test-fast`` runs ``-m 'not e2e'`` (nothing but this Python process) and ``make test-e2e`` runs ``-m e2e``
(torchrun, kernels, subprocesses running nbddp). A mark that does not match what the test did is an error at the
test's teardown whose message says which mark to add or remove.

A process counts as started when, in this pytest process, `subprocess.Popen`, a `multiprocessing` process,
`os.system`, `os.fork` or `os.posix_spawn` ran, or nbddp's warm process forked a job's agent (`launch/warm_start.py`:
a launcher's later jobs start no process of their own), during the test's setup, call or teardown, or during the setup of
a fixture the test uses (a module-scoped fixture that launches one job for several tests makes each of them a
launching test, though only the first one's setup started it).
"""

from __future__ import annotations

import multiprocessing.process
import os
import platform
import subprocess

import pytest

E2E = "e2e"
_started: list[str] = []  # what this pytest process started, in order (a short description of each)
_launching_fixtures: set[int] = set()  # id() of the FixtureDefs whose setup started a process
#: how the summary names what was started, by a word of its command line (the first that matches)
_KINDS = (("torchrun", ("nbddp.agent", "torch.distributed.run", "torchrun")), ("kernel", ("ipykernel",)),
          ("nbddp CLI", ("nbddp.cli",)), ("other", ("",)))


def _describe(what) -> str:
    if isinstance(what, (list, tuple)):
        what = " ".join(str(part) for part in what)
    text = str(what)
    return text if len(text) <= 120 else text[:117] + "..."


def _record(name: str, describe):
    """Wraps the callable ``name`` so that each call is recorded (``describe`` words the call) before it runs."""

    def wrap(original):
        def recording(*args, **kwargs):
            _started.append(describe(*args, **kwargs))
            return original(*args, **kwargs)

        recording.__wrapped__ = original
        recording.__name__ = name
        return recording

    return wrap


def _install() -> None:
    popen_init = subprocess.Popen.__init__
    if getattr(popen_init, "__wrapped__", None) is not None:
        return  # installed already (pytest imported this module twice)

    subprocess.Popen.__init__ = _record(  # type: ignore[method-assign]
        "__init__", lambda self, args, *a, **k: f"subprocess.Popen({_describe(args)})")(popen_init)
    process = multiprocessing.process.BaseProcess
    process.start = _record(  # type: ignore[method-assign]
        "start", lambda self: f"multiprocessing process {self.name} ({_describe(getattr(self, '_target', ''))})")(
        process.start)
    os.system = _record("system", lambda command: f"os.system({_describe(command)})")(os.system)
    os.fork = _record("fork", lambda: "os.fork()")(os.fork)
    from nbddp.launch import warm_start

    warm = warm_start._WarmProcess
    warm.fork_agent = _record(  # type: ignore[method-assign]
        "fork_agent", lambda self, plan, log: f"agent forked by the warm process ({_describe(plan.argv)})")(warm.fork_agent)
    for name in ("posix_spawn", "posix_spawnp"):
        if hasattr(os, name):
            setattr(os, name, _record(name, lambda path, argv, *a, _name=name, **k: f"os.{_name}({_describe(argv)})")(
                getattr(os, name)))


# platform asks `uname -p` once and keeps the answer: asked here, it is not charged to whichever test asks first
platform.processor()
_install()


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef, request):
    before = len(_started)
    try:
        return (yield)
    finally:
        if len(_started) > before:
            _launching_fixtures.add(id(fixturedef))


def _fixture_started(item) -> bool:
    """True when a fixture this test uses started a process while it was set up (for this test or an earlier
    one of its scope)."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    return any(id(d) in _launching_fixtures for defs in info.name2fixturedefs.values() for d in defs)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    item.stash[_first_key] = len(_started)
    return (yield)


_first_key = pytest.StashKey[int]()
_passed_key = pytest.StashKey[bool]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.when == "call":
        item.stash[_passed_key] = report.passed
    return report


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    result = yield
    # judged only once the test passed: a failure has already said what is wrong, a skip ran nothing
    if item.stash.get(_passed_key, False):
        started = _started[item.stash.get(_first_key, len(_started)):]
        marked = item.get_closest_marker(E2E) is not None
        if started and not marked:
            pytest.fail(
                f"{item.nodeid} started a process but is not marked e2e, so it runs in the fast lane "
                f"(make test-fast). First one: {started[0]}. Fix: add @pytest.mark.e2e to the test (or "
                f"pytest.param(..., marks=pytest.mark.e2e) for one parameter), or test it without starting a "
                f"process.", pytrace=False)
        if marked and not started and not _fixture_started(item):
            pytest.fail(
                f"{item.nodeid} is marked e2e but started no process, so it slows the end-to-end lane "
                f"(make test-e2e). Fix: remove @pytest.mark.e2e from it (where the file's "
                f"`pytestmark = pytest.mark.e2e` marks it, mark the file's launching tests one by one instead).",
                pytrace=False)
    return result


def pytest_terminal_summary(terminalreporter):
    """One line for the lead's before/after: what this pytest process started (a launch that a started
    process makes itself, as ``nbddp run`` or a kernel's ``%%ddp_train`` does, is counted as its parent)."""
    if not _started:
        return
    counts = {name: 0 for name, _ in _KINDS}
    for what in _started:
        counts[next(name for name, words in _KINDS if any(w in what for w in words))] += 1
    spelled = ", ".join(f"{n} {name}" for name, n in counts.items() if n)
    terminalreporter.write_line(f"lanes: {len(_started)} processes started by the tests ({spelled})")
