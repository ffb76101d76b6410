"""A launcher's jobs with their agents forked from a warm process, against a fresh agent each, side by side.

    .venv/bin/python benchmarks/warm_start.py [--reps 3] [--jobs 4] [--out benchmarks/results]

A launcher (a fresh Python process, as a kernel is) runs ``--jobs`` small 2-rank jobs one after another through
``launch.plan`` and ``launch.launch``, once with ``NBDDP_WARM_START=0`` (each agent a fresh ``python -m
nbddp.agent``) and once with it on (``launch/warm_start.py``); the two alternate ``--reps`` times. Two jobs: a
plain torch loop (the agent preloads torch and ``torch._dynamo``), and the same loop in a script that imports
transformers (``torch._inductor`` too). Measured: each job's wall time as the launcher sees it (first job apart:
it starts the warm process), and the CPU of the whole launcher run, every process under it included (each is
waited for by its parent, so its CPU reaches this process's ``RUSAGE_CHILDREN``; the launcher ends its warm
process before it exits).

Writes ``warm_start.json`` and ``warm_start.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

LOOP = '''import torch
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model = torch.nn.parallel.DistributedDataParallel(model)
for _ in range(3):
    loss = model(torch.randn(8, 4)).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
'''
SCRIPTS = {
    "plain torch loop": "import nbddp.runtime\nnbddp.runtime.setup()\n" + LOOP + "nbddp.runtime.cleanup()\n",
    "a script that imports transformers": ("import nbddp.runtime\nnbddp.runtime.setup()\nimport transformers\n" + LOOP
                                           + "nbddp.runtime.cleanup()\n"),
}

#: The launcher: ``jobs`` launches of one script, each job's wall seconds printed as JSON, its warm process ended.
LAUNCHER = r'''
import json, sys, time
from pathlib import Path
from nbddp.launch import launch, new_run_dir, plan, warm_start
from nbddp.options import RunOptions
script, runs, jobs = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
walls = []
for _ in range(jobs):
    began = time.monotonic()
    result = launch(plan(script, new_run_dir(runs, "bench"), RunOptions(nproc=2)), sink=lambda stream, text: None)
    assert result.returncode == 0, result.run_dir
    walls.append(time.monotonic() - began)
for warm in warm_start._warm.values():  # ended and waited for: its CPU reaches this process's parent
    warm.proc.stdin.close()
    warm.proc.wait()
print(json.dumps(walls))
'''


def one_launcher(script: Path, runs: Path, jobs: int, warm: bool) -> dict:
    env = {**os.environ, "NBDDP_WARM_START": "1" if warm else "0",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run([sys.executable, "-c", LAUNCHER, str(script), str(runs), str(jobs)], env=env,
                          capture_output=True, text=True, check=True, timeout=900)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"walls": json.loads(done.stdout.strip().splitlines()[-1]), "cpu_s": cpu}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=4)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    import tempfile

    work = Path(tempfile.mkdtemp(prefix="warm-start-"))
    load_before = os.getloadavg()
    results: dict[str, dict[str, list]] = {}
    for name, code in SCRIPTS.items():
        script = work / (name.replace(" ", "_") + ".py")
        script.write_text(code)
        results[name] = {"fresh": [], "warm": []}
        for _ in range(args.reps):
            for mode in ("fresh", "warm"):
                results[name][mode].append(one_launcher(script, work / "runs", args.jobs, mode == "warm"))
    summary = {"jobs_per_launcher": args.jobs, "reps": args.reps, "cpus": os.cpu_count(),
               "load_before": load_before, "load_after": os.getloadavg(), "runs": results}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "warm_start.json").write_text(json.dumps(summary, indent=1))
    (args.out / "warm_start.md").write_text(markdown(summary))
    print(markdown(summary))


def markdown(summary: dict) -> str:
    jobs = summary["jobs_per_launcher"]
    lines = ["# Agents forked from a warm process, against a fresh agent per job", "",
             f"`benchmarks/warm_start.py`: a launcher runs {jobs} small 2-rank gloo jobs one after another, each agent "
             f"fresh (`NBDDP_WARM_START=0`) or forked from its warm process; the two alternate, {summary['reps']} "
             f"times. {summary['cpus']} CPUs; load average before {fmt_load(summary['load_before'])}, after "
             f"{fmt_load(summary['load_after'])}. Medians; the spread is the lowest and highest of the runs.", "",
             "| job | agents | first job, wall s | each later job, wall s | CPU s a job (every process) | later jobs' wall, warm / fresh | CPU, warm / fresh |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for name, modes in summary["runs"].items():
        row = {}
        for mode, runs in modes.items():
            firsts = [r["walls"][0] for r in runs]
            laters = [w for r in runs for w in r["walls"][1:]]
            cpus = [r["cpu_s"] / jobs for r in runs]
            row[mode] = (statistics.median(laters), statistics.median(cpus))
            lines.append(f"| {name} | {mode} | {statistics.median(firsts):.1f} | {statistics.median(laters):.1f} "
                         f"({min(laters):.1f}–{max(laters):.1f}) | {statistics.median(cpus):.1f} "
                         f"({min(cpus):.1f}–{max(cpus):.1f}) | | |")
        lines.append(f"| {name} | | | | | {row['warm'][0] / row['fresh'][0]:.2f} | {row['warm'][1] / row['fresh'][1]:.2f} |")
    lines += ["", "The CPU a job counts the warm process's imports once per launcher, shared by its jobs: the more jobs "
              "a launcher runs, the less each pays.", ""]
    return "\n".join(lines)


def fmt_load(load) -> str:
    return "(" + ", ".join(f"{x:.2f}" for x in load) + ")"


if __name__ == "__main__":
    main()
