"""Ranks forked from torchrun's process against fresh ones (``NBDDP_FORK_RANKS`` 1 and 0), side by side.

    python benchmarks/forked_ranks.py [--repeat 3] [--out benchmarks/results]

Two jobs on 2 gloo ranks, the runs alternating fork on / off: a plain PyTorch step (``python -m nbddp.agent``
of a script that joins the group and takes one optimizer step) and the quickstart notebook through
``nbddp run --nproc 2`` (transformers, PEFT, TRL: 60 Trainer steps). Each run's wall seconds and the CPU
seconds of the whole process tree (``RUSAGE_CHILDREN``). Medians and on/off ratios go to ``forked_ranks.json``
and ``forked_ranks.md``, with the load average before and after (how busy the machine was).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PLAIN = """import os, torch, torch.distributed as dist
dist.init_process_group("gloo")
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 8))
opt = torch.optim.AdamW(model.parameters())
model(torch.ones(4, 8)).sum().backward()
opt.step()
dist.destroy_process_group()
"""


def timed(argv: list[str], env: dict, cwd: Path) -> tuple[float, float]:
    """Wall and CPU seconds (user + system, the whole tree) of one run."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(argv, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode:
        raise SystemExit(f"{' '.join(argv)} failed:\n{done.stderr[-3000:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp())
    (work / "plain.py").write_text(PLAIN)
    base = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    jobs = {
        "plain PyTorch step (python -m nbddp.agent)": [sys.executable, "-m", "nbddp.agent", "--standalone",
                                                        "--nproc_per_node=2", f"--log-dir={work / 'logs'}",
                                                        "--redirects=3", str(work / "plain.py")],
        "quickstart notebook (nbddp run --nproc 2)": [sys.executable, "-m", "nbddp.cli", "run",
                                                      str(ROOT / "notebooks" / "quickstart.ipynb"), "--nproc", "2",
                                                      "--runs-dir", str(work / "runs")],
    }
    load_before = os.getloadavg()
    runs: dict = {name: {"1": [], "0": []} for name in jobs}
    for _ in range(args.repeat):
        for name, argv in jobs.items():
            for switch in ("1", "0"):
                runs[name][switch].append(timed(argv, {**base, "NBDDP_FORK_RANKS": switch}, work))
    load_after = os.getloadavg()
    result = {"machine": f"{os.cpu_count()} CPUs, {sys.platform}", "load_before": load_before,
              "load_after": load_after, "repeat": args.repeat, "jobs": {}}
    lines = ["# Forked ranks against fresh ones (NBDDP_FORK_RANKS 1 / 0), 2 gloo ranks, runs alternating", "",
             f"{result['machine']}; load average before {load_before[0]:.2f}, after {load_after[0]:.2f}; "
             f"{args.repeat} runs each, medians.", "",
             "| job | wall forked | wall fresh | wall ratio | CPU s forked | CPU s fresh | CPU ratio |",
             "|---|---|---|---|---|---|---|"]
    for name in jobs:
        on, off = runs[name]["1"], runs[name]["0"]
        med = {k: statistics.median(x[i] for x in v) for k, v in (("on", on), ("off", off)) for i in (0,)}
        cpu = {k: statistics.median(x[1] for x in v) for k, v in (("on", on), ("off", off))}
        result["jobs"][name] = {"forked": on, "fresh": off, "wall_median": med, "cpu_median": cpu}
        lines.append(f"| {name} | {med['on']:.2f} | {med['off']:.2f} | {med['on'] / med['off']:.2f} | "
                     f"{cpu['on']:.2f} | {cpu['off']:.2f} | {cpu['on'] / cpu['off']:.2f} |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "forked_ranks.json").write_text(json.dumps(result, indent=1))
    (args.out / "forked_ranks.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
