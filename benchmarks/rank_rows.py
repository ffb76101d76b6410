"""What makes a rank's rows slower than a plain process's: the generation notebook's rows timed on two GPUs at once
under each way of starting the two processes, side by side in one call (2 GPUs; device tool).

    python benchmarks/rank_rows.py --wheels .gpu/wheels [--prompts 96] [--repeats 2] [--out DIR] [--only VARIANT]

``benchmarks/predict_speed.py`` found nbddp's two ranks about 10 % slower a row than two plain processes splitting
the rows by hand on the same host (111 s against 100 s for 256 prompts each). The rows are the same; what differs
is how the processes are started. Each variant runs two processes together, process i on GPU i over its half of
``--prompts`` prompts (the generation notebook of ``predict_speed``: a GPT-2 shape answering one prompt at a time),
and times its rows alone, from the first to the last (not the start):

- ``plain``: ``python`` of the notebook, ``CUDA_VISIBLE_DEVICES=i`` (the rows split by hand);
- ``plain_omp1``: the same with ``OMP_NUM_THREADS=1``, which torchrun sets for every rank of a job of two or more;
- ``plain_both_gpus``: both GPUs visible, ``torch.cuda.set_device(i)`` first (as a rank sees them);
- ``torchrun``: plain ``torchrun --nproc_per_node=2`` of the same rows, an NCCL group joined, no nbddp;
- ``nbddp``: ``nbddp run`` of the notebook (its ranks' rows from the run's share records);
- ``nbddp_omp1``: the same with ``OMP_NUM_THREADS=1`` given (torchrun's own count, given by hand: the control for a
  rank that drops it, tried as a change);
- ``nbddp_omp_half``: the same with ``OMP_NUM_THREADS`` set to half the CPUs (torchrun then leaves it).

``benchmarks/results/rank_rows.md`` says what two calls found.

Variants run in a new order each pass. Writes ``rank_rows_runs.jsonl`` (every run as it ends) and
``rank_rows_last.md``: each variant's seconds a row (the mean of its two processes, and the slower), as a ratio to
``plain`` in the same pass.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import predict_speed as ps  # noqa: E402

VARIANTS = ("plain", "plain_omp1", "plain_both_gpus", "torchrun", "nbddp", "nbddp_omp1", "nbddp_omp_half")
TORCHRUN_PRELUDE = ('import os, torch, torch.distributed as dist\n'
                    'dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")\n'
                    'if torch.cuda.is_available():\n    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))\n'
                    'RANK, WORLD = dist.get_rank(), dist.get_world_size()')


def cells(notebook: Path) -> list[str]:
    import nbformat

    return [c.source for c in nbformat.read(str(notebook), as_version=4).cells if c.cell_type == "code"]


def half(i: int, total: int) -> str:
    return f"prompts = prompts[{total * i // 2}:{total * (i + 1) // 2}]"


def script(parts: list[str], prelude: str, block: str) -> str:
    mark = ps._MARK
    return "\n\n".join([prelude, parts[0], block, mark.format("rows start"), parts[1], mark.format("rows end")]) + "\n"


def plain(variant: str, parts: list[str], work: Path, total: int, timeout: int) -> list[tuple[float, int]]:
    procs = []
    for i in range(2):
        folder = Path(tempfile.mkdtemp(prefix=f"{variant}-{i}-", dir=work))
        env = dict(ps.ENV)
        prelude = ""
        if variant == "plain_both_gpus":
            prelude = f"import torch\ntorch.cuda.set_device({i})"
        else:
            env["CUDA_VISIBLE_DEVICES"] = str(i)
        if variant == "plain_omp1":
            env["OMP_NUM_THREADS"] = "1"
        (folder / "rows.py").write_text(script(parts, prelude, half(i, total)))
        procs.append((folder, subprocess.Popen([sys.executable, "rows.py"], cwd=folder, env=ps.timeline_env(folder, env),
                                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)))
    return [(_rows_s(folder, proc, timeout), halves(total)[i]) for i, (folder, proc) in enumerate(procs)]


def halves(total: int) -> list[int]:
    return [total // 2, total - total // 2]


def _rows_s(folder: Path, proc, timeout: int) -> float:
    _, err = proc.communicate(timeout=timeout)
    if proc.returncode:
        raise SystemExit(f"{folder.name} failed (exit {proc.returncode}):\n{err[-3000:]}")
    marks = ps.timeline([folder], 0.0)
    (role,) = [r for r, m in marks.items() if "rows start" in m]
    return marks[role]["rows end"] - marks[role]["rows start"]


def torchrun(parts: list[str], work: Path, total: int, timeout: int) -> list[tuple[float, int]]:
    folder = Path(tempfile.mkdtemp(prefix="torchrun-", dir=work))
    block = f"prompts = prompts[{total} * RANK // WORLD:{total} * (RANK + 1) // WORLD]"
    (folder / "rows.py").write_text(script(parts, TORCHRUN_PRELUDE, block) + "dist.destroy_process_group()\n")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "rows.py"], cwd=folder, env=ps.timeline_env(folder, ps.ENV), capture_output=True,
                          text=True, timeout=timeout)
    if done.returncode:
        raise SystemExit(f"torchrun failed (exit {done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}")
    marks = ps.timeline([folder], 0.0)
    return [(marks[f"rank{r}"]["rows end"] - marks[f"rank{r}"]["rows start"], halves(total)[r]) for r in (0, 1)]


def nbddp(variant: str, notebook: Path, work: Path, timeout: int) -> list[tuple[float, int]]:
    folder = Path(tempfile.mkdtemp(prefix=f"{variant}-", dir=work))
    shutil.copy(notebook, folder / notebook.name)
    env = dict(ps.ENV)
    if variant == "nbddp_omp1":
        env["OMP_NUM_THREADS"] = "1"
    if variant == "nbddp_omp_half":
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 2) // 2))
    done = subprocess.run([*ps.NBDDP, "run", notebook.name, "--nproc", "2", "--runs-dir", str(folder / "runs")],
                          cwd=folder, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode:
        raise SystemExit(f"{variant} failed (exit {done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}")
    return [(r["rows_s"], r["rows"]) for r in ps.rank_times(folder / "runs", 0.0, 0.0)]  # rows handed out


def run(variant: str, notebook: Path, parts: list[str], work: Path, total: int,
        timeout: int) -> list[tuple[float, int]]:
    if variant.startswith("plain"):
        return plain(variant, parts, work, total, timeout)
    if variant == "torchrun":
        return torchrun(parts, work, total, timeout)
    return nbddp(variant, notebook, work, timeout)


def report(runs: list[dict], total: int, machine: dict) -> str:
    lines = ["# A rank's rows against a plain process's (benchmarks/rank_rows.py)", "",
             f"{machine['gpus']}; {machine['cpus']} CPUs. Each variant: two processes at once, one a GPU, each over "
             f"half of {total} prompts (the generation notebook of `predict_speed.py`); seconds of the rows alone "
             "(first to last row), divided by the rows. Ratio: to `plain` (the rows split by hand) in the same pass.",
             "", "| variant | passes | s a row (mean of the 2 processes), median | slower process, median | "
             "× plain (mean), per pass |", "|---|---:|---:|---:|---|"]
    per_pass: dict[int, dict[str, dict]] = {}
    for r in runs:
        per_pass.setdefault(r["pass"], {})[r["variant"]] = r
    for variant in VARIANTS:
        rows = [r for r in runs if r["variant"] == variant]
        if not rows:
            continue
        ratios = [f"{p[variant]['mean_s'] / p['plain']['mean_s']:.3f}" for p in per_pass.values()
                  if variant in p and "plain" in p]
        lines.append(f"| `{variant}` | {len(rows)} | {statistics.median(r['mean_s'] for r in rows) * 1000:.1f} ms | "
                     f"{statistics.median(r['slower_s'] for r in rows) * 1000:.1f} ms | {', '.join(ratios)} |")
    lines += ["", "Every run: `rank_rows_runs.jsonl`. Load average before and after: "
              f"{machine['load_before']} → {machine['load_after']}."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--only", action="append", choices=VARIANTS)
    parser.add_argument("--timeout", type=int, default=300)
    parser.add_argument("--out", type=Path, default=ps.ROOT / "benchmarks" / "results")
    parser.add_argument("--wheels", type=Path)
    args = parser.parse_args()
    if args.wheels:
        ps.use_wheels(args.wheels)
    sizes = {**ps.SIZES["gpu"], "prompts": args.prompts}
    work = Path(tempfile.mkdtemp(prefix="nbddp-rank-rows-"))
    notebook = ps.write_notebook(work, "generation", sizes)
    parts = cells(notebook)
    machine = {**ps.machine(), "load_before": [round(x, 2) for x in os.getloadavg()]}
    args.out.mkdir(parents=True, exist_ok=True)
    runs_file, runs = args.out / "rank_rows_runs.jsonl", []
    ps.warm_up()
    variants = list(args.only or VARIANTS)
    for k in range(args.repeats):
        for variant in variants[k % len(variants):] + variants[:k % len(variants)]:  # a new order each pass
            timed = run(variant, notebook, parts, work, args.prompts, args.timeout)
            seconds = [s for s, _ in timed]
            per_row = [s / n for s, n in timed]
            row = {"variant": variant, "pass": k, "prompts": args.prompts, "rows_s": seconds,
                   "rows": [n for _, n in timed],
                   "mean_s": statistics.mean(per_row), "slower_s": max(per_row), "at": time.time()}
            runs.append(row)
            print(f"pass {k} {variant:16s} rows {[round(s, 2) for s in seconds]} s; "
                  f"{row['mean_s'] * 1000:.1f} ms a row", flush=True)
            with open(runs_file, "a") as fh:
                fh.write(json.dumps(row) + "\n")
    machine["load_after"] = [round(x, 2) for x in os.getloadavg()]
    text = report(runs, args.prompts, machine)
    (args.out / "rank_rows_last.md").write_text(text)
    print(text, flush=True)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
