"""Ranks forked by the agent's forker (``agent/forker.py``) against another nbddp source tree, side by side.

    git archive <commit> src | tar -x -C /tmp/base
    python benchmarks/forker_against.py /tmp/base/src [--repeat 5]

``tests/jobs/exit_race.py`` through ``python -m nbddp.agent`` on 2 and on 8 forked ranks, the two source trees
alternating run by run; each run's wall seconds and the CPU seconds of its process tree (``RUSAGE_CHILDREN``).
Prints medians, the ratios and the load average before and after (how busy the machine was). Written for the
forker's change: what a job pays for the extra process and the socket round trip per rank.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

from forked_ranks import timed  # this folder's: one run's wall and CPU seconds, the tree's

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "tests" / "jobs" / "exit_race.py"


def launch(src: Path, nproc: int) -> tuple[float, float]:
    """Wall and CPU seconds of one launch of ``JOB`` on ``nproc`` ranks with nbddp from ``src``."""
    logs = Path(tempfile.mkdtemp())
    argv = [sys.executable, "-m", "nbddp.agent", "--standalone", f"--nproc_per_node={nproc}", f"--log-dir={logs}",
            "--redirects=3", str(JOB)]
    return timed(argv, {**os.environ, "PYTHONPATH": str(src)}, logs)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("baseline", type=Path, help="the other tree's src folder")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    trees = {"this tree": ROOT / "src", "baseline": args.baseline}
    load_before = os.getloadavg()
    runs: dict = {}
    for _ in range(args.repeat):
        for nproc in (2, 8):
            for name, src in trees.items():
                runs.setdefault((nproc, name), []).append(launch(src, nproc))
    print(f"{os.cpu_count()} CPUs; load average before {load_before[0]:.2f}, after {os.getloadavg()[0]:.2f}; "
          f"{args.repeat} runs each, medians\n")
    print("| ranks | wall this tree | wall baseline | ratio | CPU s this tree | CPU s baseline | ratio |")
    print("|---|---|---|---|---|---|---|")
    for nproc in (2, 8):
        wall = [statistics.median(w for w, _ in runs[(nproc, n)]) for n in trees]
        cpu = [statistics.median(c for _, c in runs[(nproc, n)]) for n in trees]
        print(f"| {nproc} | {wall[0]:.2f} | {wall[1]:.2f} | {wall[0] / wall[1]:.2f} | "
              f"{cpu[0]:.2f} | {cpu[1]:.2f} | {cpu[0] / cpu[1]:.2f} |")


if __name__ == "__main__":
    main()
