"""``nbddp run`` in a terminal: a failure's headline starts a line of its own, not the end of rank 0's bar."""

import os
import subprocess
import sys

import pytest

from conftest import ROOT, write_notebook

pytestmark = pytest.mark.e2e

BAR_THEN_FAIL = '''import os, sys, time
from tqdm import tqdm
for i in tqdm(range(10_000), file=sys.stderr, mininterval=0):
    time.sleep(0.01)
    if i == 100 and os.environ["RANK"] == "1":
        raise ValueError("boom on rank 1")'''


def test_the_failure_headline_starts_a_line_of_its_own(tmp_path):
    nb = write_notebook(tmp_path / "bar.ipynb", [BAR_THEN_FAIL])
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run([sys.executable, "-m", "nbddp.cli", "run", "--every-rank", str(nb), "--nproc", "2"], capture_output=True,
                          text=True, cwd=tmp_path, env=env, timeout=300)
    assert proc.returncode == 1
    lines = proc.stderr.split("\n")
    headline = next(ln for ln in lines if "rank 1 failed" in ln)
    assert headline.startswith("nbddp: rank 1 failed in cell 1, line 6: ValueError: boom on rank 1"), headline
    bar_lines = [ln for ln in lines if "/10000 [" in ln]
    assert bar_lines and not any("nbddp:" in ln for ln in bar_lines)  # the bar was there, and nothing after it
    assert "runtime" not in proc.stderr.split("rank 1 failed", 1)[1]  # nbddp's own frames are not shown
