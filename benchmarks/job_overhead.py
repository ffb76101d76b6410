"""A fresh job's own cost: ``nbddp run --nproc 1`` against plain ``torchrun`` of the same code, and where the
launcher's seconds go.

    python benchmarks/job_overhead.py [--repeat 3] [--out benchmarks/results]
    python benchmarks/job_overhead.py --gpu NOTEBOOK.ipynb --plain SCRIPT.py   # the lead's GPU run (Unsloth)

CPU: a one-cell notebook that imports torch and joins the process group as any DDP script does, against a
hand-written script doing the same under ``torchrun --standalone --nproc_per_node=1``; runs alternate, medians
compared. Then one ``nbddp run`` under cProfile: seconds in imports, conversion, waiting for torchrun, and
which modules the launcher imported (torch must not be one of them on a machine without GPUs). ``--gpu``
times the given notebook against the given plain script the same way (a real Unsloth job: give the local
4-bit model's folder in both). Writes ``job_overhead.json`` and ``job_overhead.md``.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
CELL = "import os, torch\nprint('hello from rank', os.environ['RANK'], torch.__version__)"
PLAIN = """import os, torch
import torch.distributed as dist
dist.init_process_group("gloo")
print('hello from rank', os.environ['RANK'], torch.__version__)
dist.barrier()
dist.destroy_process_group()
"""
# torchrun beside this Python (a venv), else the one on PATH (a system Python, as on the GPU image)
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
if not Path(TORCHRUN).exists():
    TORCHRUN = shutil.which("torchrun") or TORCHRUN


def timed(argv: list[str], cwd: Path) -> float:
    started = time.perf_counter()
    subprocess.run(argv, cwd=cwd, env=ENV, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - started


def compare(notebook: Path, plain: Path, repeat: int, cwd: Path) -> dict:
    nbddp, torchrun = [], []
    for _ in range(repeat):
        nbddp.append(timed([sys.executable, "-m", "nbddp.cli", "run", "--nproc", "1", "--every-rank", str(notebook)], cwd))
        torchrun.append(timed([TORCHRUN, "--standalone", "--nproc_per_node=1", str(plain)], cwd))
    n, t = statistics.median(nbddp), statistics.median(torchrun)
    return {"nbddp_s": nbddp, "torchrun_s": torchrun, "nbddp_median_s": n, "torchrun_median_s": t, "over_s": n - t}


def profile_launcher(notebook: Path, cwd: Path) -> dict:
    """One ``nbddp run`` in this process under cProfile: where the launcher's own seconds go."""
    from nbddp import cli

    profiler = cProfile.Profile()
    old = os.getcwd()
    os.chdir(cwd)
    started = time.perf_counter()
    try:
        profiler.runcall(cli.main, ["run", "--nproc", "1", "--every-rank", str(notebook)])
    except SystemExit:
        pass
    finally:
        os.chdir(old)
    wall = time.perf_counter() - started
    stats = pstats.Stats(profiler)

    def cumulative(suffix: str, name: str) -> float:
        return sum(v[3] for k, v in stats.stats.items() if k[0].endswith(suffix) and k[2] == name)

    waiting = cumulative("launch/supervise.py", "launch")
    converting = cumulative("convert/script.py", "convert_notebook")
    return {"wall_s": wall, "launch_s": waiting, "convert_s": converting, "before_launch_s": wall - waiting,
            "torch_imported_by_launcher": "torch" in sys.modules, "slowest_outside_launch": _slowest(stats)}


def _slowest(stats: pstats.Stats, keep: int = 15) -> list[str]:
    """nbddp's own functions with the most cumulative seconds, torchrun's wait left out: where a start goes."""
    rows = [(v[3], f"{Path(k[0]).name}:{k[1]} {k[2]}") for k, v in stats.stats.items()
            if "/nbddp/" in k[0] and "supervise.py" not in k[0] and v[3] >= 0.05]
    return [f"{seconds:.2f} s {where}" for seconds, where in sorted(rows, reverse=True)[:keep]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--gpu", metavar="NOTEBOOK", help="a GPU notebook to time (with --plain)")
    parser.add_argument("--plain", metavar="SCRIPT", help="the same code as a plain script, for --gpu")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="nbddp-overhead-"))
    if args.gpu:
        notebook, plain, what = Path(args.gpu).resolve(), Path(args.plain).resolve(), f"GPU: {args.gpu}"
    else:
        notebook, plain, what = work / "hello.ipynb", work / "plain.py", "CPU: a cell importing torch, 1 process"
        nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(CELL)]), str(notebook))
        plain.write_text(PLAIN)
    load = os.getloadavg()
    result = {"what": what, "cpus": os.cpu_count(), "load_before": [round(x, 2) for x in load],
              "compare": compare(notebook, plain, args.repeat, work), "profile": profile_launcher(notebook, work),
              "load_after": [round(x, 2) for x in os.getloadavg()]}
    name = "job_overhead_gpu" if args.gpu else "job_overhead"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    c, p = result["compare"], result["profile"]
    (args.out / f"{name}.md").write_text("\n".join([
        "# A fresh job's own cost (benchmarks/job_overhead.py)", "",
        f"{what}. {result['cpus']} CPUs shared with other jobs (load average {result['load_before']} before, "
        f"{result['load_after']} after): the seconds move with the load, the difference less.", "",
        "| | median s | runs |", "|---|---|---|",
        f"| `nbddp run --nproc 1` | {c['nbddp_median_s']:.2f} | {', '.join(f'{x:.2f}' for x in c['nbddp_s'])} |",
        f"| `torchrun --standalone --nproc_per_node=1` (plain script) | {c['torchrun_median_s']:.2f} | "
        f"{', '.join(f'{x:.2f}' for x in c['torchrun_s'])} |",
        f"| nbddp over torchrun | {c['over_s']:.2f} | |", "",
        f"One `nbddp run` profiled in-process: {p['wall_s']:.2f} s, of which {p['before_launch_s']:.2f} s before and "
        f"after torchrun runs (conversion {p['convert_s']:.2f} s) and {p['launch_s']:.2f} s while it runs; torch "
        f"imported by the launcher: {p['torch_imported_by_launcher']}.", "",
        "Its slowest functions outside torchrun's run (cumulative, nested ones counted in their callers too):", "",
        *(f"- {row}" for row in p.get("slowest_outside_launch", [])), ""]))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
