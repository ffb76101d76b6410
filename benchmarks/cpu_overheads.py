"""CPU benchmarks of what nbddp adds around torchrun, side by side in one run (2 gloo processes).

    python benchmarks/cpu_overheads.py [--repeat 3] [--out benchmarks/results]

- launch overhead: wall time of ``nbddp run`` on a two-cell notebook (convert, write the run directory,
  torchrun, follow rank 0, collect) against plain ``torchrun --standalone`` on the same code as a minimal
  hand-written DDP script (``init_process_group``, the cells, ``destroy_process_group``);
  the runs alternate and the medians are compared (target: ≤ 1 s more). Twice: cells no rule changes,
  and cells a rule rewrites (the converter then loads libcst as well).
- interrupt: SIGINT to ``nbddp run`` while both ranks sleep in a cell → seconds until no process of the
  job is left (target ≤ 5 s).
- rank-0 line latency: a cell prints ``time.time()`` every 50 ms; the launcher's sink notes when each line
  arrives (target ≤ 100 ms median). Polling every 50 ms puts the expected median near 25 ms.
Writes ``cpu_overheads.json`` and ``cpu_overheads.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nbformat
import psutil

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
CELLS = ["import os", "print('hello from rank', os.environ['RANK'])"]
#: Cells one of the converter's rules rewrites (the device string), so the conversion loads libcst too.
REWRITTEN = ["import os, torch", "device = 'cuda:0' if torch.cuda.is_available() else 'cpu'\n"
             "print('hello from rank', os.environ['RANK'], 'on', device)"]


def write_notebook(path: Path, cells: list[str]) -> Path:
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells]), str(path))
    return path


def timed(argv: list[str], cwd: Path) -> float:
    t = time.perf_counter()
    subprocess.run(argv, cwd=cwd, env=ENV, check=True, capture_output=True)
    return time.perf_counter() - t


def launch_overhead(work: Path, repeat: int, cells: list[str] = CELLS, name: str = "hello") -> dict:
    nb = write_notebook(work / f"{name}.ipynb", cells)
    script = work / f"{name}.py"  # the same cells as a minimal hand-written DDP script: join the group, leave it
    script.write_text("import torch.distributed as dist\ndist.init_process_group('gloo')\n" + "\n".join(cells)
                      + "\ndist.destroy_process_group()\n")
    nbddp = [sys.executable, "-m", "nbddp.cli", "run", "--every-rank", str(nb), "--nproc", "2", "--runs-dir", str(work / "runs")]
    plain = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)]
    a, b = [], []
    for _ in range(repeat):  # alternate, so drift touches both alike
        a.append(timed(nbddp, work))
        b.append(timed(plain, work))
    return {"nbddp_s": a, "torchrun_s": b, "overhead_s": statistics.median(a) - statistics.median(b)}


def interrupt(work: Path, repeat: int) -> dict:
    nb = write_notebook(work / "sleep.ipynb", ["import time", "print('ready', flush=True)\ntime.sleep(600)"])
    times = []
    for _ in range(repeat):
        runs = work / f"runs-int-{len(times)}"
        proc = subprocess.Popen([sys.executable, "-m", "nbddp.cli", "run", "--every-rank", str(nb), "--nproc", "2", "--runs-dir",
                                 str(runs)], cwd=work, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        for line in proc.stdout:  # rank 0 is in the sleeping cell
            if "ready" in line:
                break
        family = [psutil.Process(proc.pid)] + psutil.Process(proc.pid).children(recursive=True)
        t = time.perf_counter()
        proc.send_signal(signal.SIGINT)
        _, alive = psutil.wait_procs(family, timeout=30)
        times.append(time.perf_counter() - t)
        for p in alive:
            p.kill()
        proc.wait()
    return {"seconds": times, "median_s": statistics.median(times), "max_s": max(times)}


def line_latency(work: Path) -> dict:
    from nbddp.display.view import QuietView
    from nbddp.job import run_job
    from nbddp.options import RunOptions

    nb = write_notebook(work / "stamps.ipynb", [
        "import time",
        "for _ in range(60):\n    print(f'STAMP {time.time():.6f}', flush=True)\n    time.sleep(0.05)",
    ])
    delays = []

    class Stamps(QuietView):  # how long each line took from the rank's print to the view
        def sink(self, stream, text):
            now = time.time()
            for line in text.splitlines():
                if line.startswith("STAMP "):
                    delays.append(now - float(line.split()[1]))

    run_job(nb, RunOptions(every_rank=True, nproc=2, runs_dir=work / "runs-lat"), Stamps())
    return {"lines": len(delays), "median_ms": 1000 * statistics.median(delays), "p95_ms":
            1000 * sorted(delays)[int(0.95 * (len(delays) - 1))]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        result = {
            "machine": f"{os.cpu_count()} CPUs, {sys.platform}",
            "launch": launch_overhead(work, args.repeat),
            "launch_rewritten": launch_overhead(work, args.repeat, REWRITTEN, "rewritten"),
            "interrupt": interrupt(work, args.repeat),
            "latency": line_latency(work),
        }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cpu_overheads.json").write_text(json.dumps(result, indent=1))
    la, lr, it, lt = result["launch"], result["launch_rewritten"], result["interrupt"], result["latency"]
    md = [
        "| measure | nbddp | reference | target |",
        "|---|---:|---:|---:|",
        f"| launch, 2 gloo ranks, median of {args.repeat} | {statistics.median(la['nbddp_s']):.2f} s | "
        f"{statistics.median(la['torchrun_s']):.2f} s (hand-written, torchrun) | overhead {la['overhead_s']:+.2f} s (≤ 1 s) |",
        f"| the same, cells a rule rewrites (libcst loads) | {statistics.median(lr['nbddp_s']):.2f} s | "
        f"{statistics.median(lr['torchrun_s']):.2f} s | overhead {lr['overhead_s']:+.2f} s (≤ 1 s) |",
        f"| SIGINT → no process left | median {it['median_s']:.2f} s, max {it['max_s']:.2f} s | | ≤ 5 s |",
        f"| rank-0 line → sink ({lt['lines']} lines) | median {lt['median_ms']:.0f} ms, p95 {lt['p95_ms']:.0f} ms | | ≤ 100 ms |",
    ]
    (args.out / "cpu_overheads.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
