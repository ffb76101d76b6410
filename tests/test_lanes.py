"""tests/lanes.py, the plugin that keeps the two lanes honest, on a small suite of its own (run in this process
by pytester: its tests start a few `python -c pass`, so this test is end-to-end itself)."""

import pytest

pytestmark = pytest.mark.e2e

SUITE = '''
import multiprocessing, subprocess, sys
import pytest

def start():
    subprocess.run([sys.executable, "-c", "pass"], check=True)

def test_unmarked_and_starts():
    start()

@pytest.mark.e2e
def test_marked_and_starts_none():
    pass

@pytest.mark.e2e
def test_marked_and_starts():
    start()

def test_unmarked_and_starts_none():
    pass

@pytest.mark.e2e
def test_marked_and_starts_a_multiprocessing_process():
    p = multiprocessing.get_context("spawn").Process(target=print)
    p.start()
    p.join()

@pytest.fixture(scope="module")
def job():
    return subprocess.run([sys.executable, "-c", "print('ran')"], capture_output=True, text=True).stdout

@pytest.mark.e2e
def test_first_user_of_a_launching_fixture(job):
    assert job == "ran\\n"

@pytest.mark.e2e
def test_second_user_of_a_launching_fixture(job):
    assert job == "ran\\n"

@pytest.mark.parametrize("launch", [pytest.param(True, marks=pytest.mark.e2e), False])
def test_one_parameter_launches(launch):
    if launch:
        start()

def test_a_failing_test_is_not_judged():
    start()
    assert False
'''


def test_a_mark_that_does_not_match_fails_with_the_fix(pytester):
    import lanes

    # the inner run shares this process's plugin module: its summary counts only what the inner suite
    # starts, not what the tests run before this one in the same process started (put back after it)
    earlier = list(lanes._started)
    lanes._started.clear()
    pytester.makepyfile(test_suite=SUITE)
    try:
        result = pytester.runpytest_inprocess("-p", "lanes", "-q")
    finally:
        lanes._started[:0] = earlier
    outcomes = result.parseoutcomes()
    assert (outcomes["passed"], outcomes["errors"], outcomes["failed"]) == (9, 2, 1), result.stdout.str()
    errors = [line for line in result.stdout.lines if line.startswith("ERROR ")]
    assert [e.split()[1] for e in errors] == ["test_suite.py::test_unmarked_and_starts",
                                             "test_suite.py::test_marked_and_starts_none"]
    out = result.stdout.str()
    assert "test_unmarked_and_starts started a process but is not marked e2e" in out
    assert "First one: subprocess.Popen(" in out and "Fix: add @pytest.mark.e2e to the test" in out
    assert "test_marked_and_starts_none is marked e2e but started no process" in out
    assert "Fix: remove @pytest.mark.e2e from it" in out
    assert "lanes: 6 processes started by the tests" in out
