"""A fresh job's own cost: ``nbddp run --nproc 1`` against plain ``torchrun`` of the same code, and where
each second goes in both.

    python benchmarks/job_overhead.py [--repeat 3] [--nproc 1] [--out benchmarks/results]
    python benchmarks/job_overhead.py --gpu NOTEBOOK.ipynb --plain SCRIPT.py   # the lead's GPU run (Unsloth)

CPU: a one-cell notebook that imports torch, against a hand-written script doing the same and joining the
process group as any DDP script does, under ``torchrun --standalone``; runs alternate, medians compared.
Every Python process of a job (the launcher, torchrun's agent, the ranks) runs with ``timeline/`` first on
its ``PYTHONPATH``: its ``sitecustomize`` marks when the process started and ended, the user code marks its
first line, the moment torch is imported (and the group joined) and its last line, and in a rank nbddp's
``setup()`` and ``cleanup()`` are timed and profiled (cProfile). The phases between those marks are the
breakdown. Then one ``nbddp run`` under cProfile in a fresh process (imports counted): the launcher's own
slowest functions and whether it imported torch. ``--gpu`` times the given notebook against the given
plain script the same way (a real Unsloth job: give the local 4-bit model's folder in both; its code
makes no marks, so the phases that need them are left empty). Writes ``job_overhead.json`` and
``job_overhead.md`` (``job_overhead_nprocN.*`` for ``--nproc N``).
"""

from __future__ import annotations

import argparse
import ast
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
TIMELINE = ROOT / "benchmarks" / "timeline"
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TIMELINE), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
MARK = "import sitecustomize as _bench\n_bench.mark('first')\n"
CELL = MARK + """import os, torch
_bench.mark('ready')
print('hello from rank', os.environ['RANK'], torch.__version__)
_bench.mark('last')"""
PLAIN = MARK + """import os, torch
import torch.distributed as dist
dist.init_process_group("gloo")
_bench.mark('ready')
print('hello from rank', os.environ['RANK'], torch.__version__)
_bench.mark('last')
dist.barrier()
dist.destroy_process_group()
"""
# torchrun beside this Python (a venv), else the one on PATH (a system Python, as on the GPU image)
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
if not Path(TORCHRUN).exists():
    TORCHRUN = shutil.which("torchrun") or TORCHRUN

#: The phases of a job, in order: (name, from mark, to mark); a mark is "role:what", "t0" or "end".
PHASES = (
    ("launcher, before torchrun starts", "t0", "launcher:launch start"),
    ("torchrun's Python starting", "launcher:launch start", "agent:site"),
    ("torchrun's agent, until the rank's Python starts", "agent:site", "rank0:site"),
    ("rank: imports before setup()", "rank0:site", "rank0:setup start"),
    ("rank: setup() (torch imported, group joined, shims)", "rank0:setup start", "rank0:setup end"),
    ("rank: from setup() to the first user line", "rank0:setup end", "rank0:first"),
    ("rank: first user line to torch ready (import torch; plain: + group joined)", "rank0:first", "rank0:ready"),
    ("rank: the user's work", "rank0:ready", "rank0:last"),
    ("rank: last user line to exit (cleanup(); plain: barrier, destroy)", "rank0:last", "rank0:exit"),
    ("torchrun's agent: rank exit to its own exit", "rank0:exit", "agent:exit"),
    ("torchrun's exit seen by the launcher (its Python ending, the poll)", "agent:exit", "launcher:launch end"),
    ("launcher: from torchrun's end to its own (report, Python's exit)", "launcher:launch end", "end"),
)


def timed(argv: list[str], cwd: Path, label: str, work: Path, src: Path | None = None) -> dict:
    """Run one job with the timeline on (nbddp imported from ``src`` where given); its wall seconds, marks and
    phases."""
    timeline = work / f"timeline-{label}.jsonl"
    timeline.unlink(missing_ok=True)
    env = {**ENV, "NBDDP_BENCH_TIMELINE": str(timeline), "NBDDP_RUNS": str(work / "runs")}
    if src:
        env["PYTHONPATH"] = env["PYTHONPATH"].replace(str(ROOT / "src"), str(src.resolve()), 1)
    cpu_before = _children_cpu()
    started = time.time()
    subprocess.run(argv, cwd=cwd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ended = time.time()
    marks, cpu = {"t0": started, "end": ended}, {"job (every process)": _children_cpu() - cpu_before}
    for line in timeline.read_text().splitlines():
        record = json.loads(line)
        marks.setdefault(f"{record['role']}:{record['what']}", record["t"])  # the first of each (rank 0's)
        if record["what"] == "exit" and record["role"] in ("launcher", "agent", "rank0"):
            cpu[record["role"]] = record["cpu"]
    if "launcher:launch start" not in marks:  # plain torchrun: nothing around it, torchrun is launched at once
        marks["launcher:launch start"], marks["launcher:launch end"] = started, ended
    phases = {name: (marks[b] - marks[a] if a in marks and b in marks else None) for name, a, b in PHASES}
    return {"wall_s": ended - started, "phases": phases, "cpu": cpu}


#: The processes whose CPU seconds are compared (each up to its exit handler), and the whole job's.
CPU_ROWS = ("launcher", "agent", "rank0", "job (every process)")


def _children_cpu() -> float:
    """CPU seconds (user + system) of every finished process this one waited for, their own children
    included: a job's CPU, steady where its wall seconds move with the machine's load."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def compare(notebook: Path, plain: Path, repeat: int, nproc: int, cwd: Path, work: Path,
            before: Path | None = None) -> dict:
    """Each run of ``nbddp run``, plain torchrun (and nbddp from the ``before`` source tree) in turn."""
    nbddp = [sys.executable, "-m", "nbddp.cli", "run", "--nproc", str(nproc), "--every-rank", str(notebook)]
    runs: dict[str, list[dict]] = {"nbddp": [], "torchrun": [], **({"before": []} if before else {})}
    for _ in range(repeat):  # alternate, so a change of load falls on each
        runs["nbddp"].append(timed(nbddp, cwd, "nbddp", work))
        runs["torchrun"].append(timed([TORCHRUN, "--standalone", f"--nproc_per_node={nproc}", str(plain)], cwd,
                                      "torchrun", work))
        if before:
            runs["before"].append(timed(nbddp, cwd, "before", work, src=before))
    result = {}
    for who, done in runs.items():
        result[f"{who}_s"] = [r["wall_s"] for r in done]
        result[f"{who}_median_s"] = statistics.median(result[f"{who}_s"])
        result[f"{who}_phases"] = {name: _median([r["phases"][name] for r in done]) for name, _, _ in PHASES}
        result[f"{who}_cpu"] = {name: _median([r["cpu"].get(name) for r in done]) for name in CPU_ROWS}
    result["over_s"] = result["nbddp_median_s"] - result["torchrun_median_s"]
    result["ratio"] = result["nbddp_median_s"] / result["torchrun_median_s"]
    if before:
        result["before_src"] = str(before)
        result["before_over_s"] = result["before_median_s"] - result["torchrun_median_s"]
        result["before_ratio"] = result["before_median_s"] / result["torchrun_median_s"]
    return result


def _median(values: list[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def profile_launcher(notebook: Path, nproc: int, cwd: Path, work: Path) -> dict:
    """One ``nbddp run`` under cProfile in a fresh process, its imports counted: where the launcher's own
    seconds go, and which heavy modules it imported."""
    out = work / "launcher.prof"
    script = (f"import cProfile, sys\nsys.argv = ['nbddp', 'run', '--nproc', '{nproc}', '--every-rank', {str(notebook)!r}]\n"
              f"p = cProfile.Profile()\ntry:\n    p.runcall(__import__('runpy').run_module, 'nbddp.cli', run_name='__main__')\n"
              f"except SystemExit:\n    pass\np.dump_stats({str(out)!r})\n"
              "print(sorted(m for m in ('torch', 'transformers', 'peft', 'IPython', 'libcst', 'rfc3987_syntax') "
              "if m in sys.modules))\n")
    started = time.perf_counter()
    env = {**ENV, "NBDDP_RUNS": str(work / "runs"), "NBDDP_BENCH_PROFILE": str(work / "profile")}
    proc = subprocess.run([sys.executable, "-c", script], cwd=cwd, env=env, capture_output=True, text=True, check=True)
    wall = time.perf_counter() - started
    stats = pstats.Stats(str(out))

    def cumulative(suffix: str, name: str) -> float:
        return sum(v[3] for k, v in stats.stats.items() if k[0].endswith(suffix) and k[2] == name)

    waiting = cumulative("launch/supervise.py", "launch")
    return {"wall_s": wall, "launch_s": waiting, "outside_launch_s": stats.total_tt - waiting,
            "convert_s": cumulative("convert/script.py", "convert_notebook"),
            "imported": ast.literal_eval(proc.stdout.strip().splitlines()[-1]),
            "slowest_outside_launch": _top(out, "", skip="supervise.py", below=waiting),
            "setup_profile": _top(work / "profile" / "rank0-setup.prof", "/nbddp/"),
            "cleanup_profile": _top(work / "profile" / "rank0-cleanup.prof", "/nbddp/")}


def _top(path: Path, where: str, skip: str = "\0", keep: int = 12, below: float = float("inf")) -> list[str]:
    """The functions with the most cumulative seconds in a profile (those whose file names ``where``, less
    those over ``below``: the callers of torchrun's wait): where a start goes. Nested ones count in their
    callers too."""
    if not path.exists():
        return []
    stats = pstats.Stats(str(path))
    rows = [(v[3], f"{'/'.join(Path(k[0]).parts[-2:])}:{k[1]} {k[2]}") for k, v in stats.stats.items()
            if where in k[0] and skip not in k[0] and 0.02 <= v[3] < below and not k[0].startswith(("<", "~"))]
    return [f"{seconds:.2f} s {name}" for seconds, name in sorted(rows, reverse=True)[:keep]]


#: The heading of the hand-written part of the results, which a new run keeps.
FINDINGS = "## Findings"


def _s(x: float | None) -> str:
    return "" if x is None else f"{x:.2f}"


def report(result: dict) -> str:
    c, p = result["compare"], result["profile"]
    has_before = "before_s" in c
    table = ["| where the seconds go (medians) | nbddp | plain torchrun | nbddp − plain |"
             + (" nbddp before | before − plain |" if has_before else ""),
             "|---|---|---|---|" + ("---|---|" if has_before else "")]
    for name, _, _ in PHASES:
        n, t = c["nbddp_phases"][name], c["torchrun_phases"][name]
        row = f"| {name} | {_s(n)} | {_s(t)} | {_s(n - t) if None not in (n, t) else ''} |"
        if has_before:
            b = c["before_phases"][name]
            row += f" {_s(b)} | {_s(b - t) if None not in (b, t) else ''} |"
        table.append(row)
    cpu = ["| CPU seconds (medians) | nbddp | plain torchrun | nbddp − plain |" + (" nbddp before |" if has_before else ""),
           "|---|---|---|---|" + ("---|" if has_before else "")]
    for name in CPU_ROWS:
        n, t = c["nbddp_cpu"][name], c["torchrun_cpu"][name]
        cpu.append(f"| {name} | {_s(n)} | {_s(t)} | {_s(n - t) if None not in (n, t) else ''} |"
                   + (f" {_s(c['before_cpu'][name])} |" if has_before else ""))
    before = [f"| `nbddp run` before ({c['before_src']}) | {c['before_median_s']:.2f} | "
              f"{', '.join(f'{x:.2f}' for x in c['before_s'])} |",
              f"| before over torchrun | {c['before_over_s']:.2f} (× {c['before_ratio']:.2f}) | |"] if has_before else []
    return "\n".join([
        "# A fresh job's own cost (benchmarks/job_overhead.py)", "",
        f"{result['what']}. {result['cpus']} CPUs shared with other jobs (load average {result['load_before']} "
        f"before, {result['load_after']} after): the seconds move with the load, the difference and ratio less.", "",
        "| | median s | runs |", "|---|---|---|",
        f"| `nbddp run --nproc {result['nproc']}` | {c['nbddp_median_s']:.2f} | {', '.join(f'{x:.2f}' for x in c['nbddp_s'])} |",
        f"| `torchrun --standalone --nproc_per_node={result['nproc']}` (plain script) | {c['torchrun_median_s']:.2f} | "
        f"{', '.join(f'{x:.2f}' for x in c['torchrun_s'])} |",
        f"| nbddp over torchrun | {c['over_s']:.2f} (× {c['ratio']:.2f}) | |", *before, "",
        *table, "",
        "The same jobs in CPU seconds, which the load moves less (a process's up to its exit handler; the job's "
        "from the operating system, every process of it):", "", *cpu, "",
        "nbddp's `setup()` in rank 0, profiled in the run below (cumulative; torch's import is the bulk of it):", "",
        *(f"- {row}" for row in p.get("setup_profile", [])), "",
        "and its `cleanup()`:", "", *(f"- {row}" for row in p.get("cleanup_profile", []) or ["nothing over 0.02 s"]), "",
        f"One `nbddp run` under cProfile in a fresh process: {p['wall_s']:.2f} s, of which {p['outside_launch_s']:.2f} s "
        f"outside torchrun's run (conversion {p['convert_s']:.2f} s) and {p['launch_s']:.2f} s while it runs; heavy "
        f"modules the launcher imported: {', '.join(p['imported']) or 'none'}.", "",
        "Its slowest functions outside torchrun's run (cumulative, profiled: slower than unprofiled):", "",
        *(f"- {row}" for row in p.get("slowest_outside_launch", [])), ""])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--gpu", metavar="NOTEBOOK", help="a GPU notebook to time (with --plain)")
    parser.add_argument("--plain", metavar="SCRIPT", help="the same code as a plain script, for --gpu")
    parser.add_argument("--before", type=Path, metavar="SRC", help="also time nbddp imported from this src folder "
                        "(an older checkout's), in the same alternation")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="nbddp-overhead-"))
    if args.gpu:
        notebook, plain, what = Path(args.gpu).resolve(), Path(args.plain).resolve(), f"GPU: {args.gpu}"
    else:
        notebook, plain = work / "hello.ipynb", work / "plain.py"
        what = f"CPU: a cell importing torch, {args.nproc} process(es)"
        nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(CELL)]), str(notebook))
        plain.write_text(PLAIN)
    result = {"what": what, "cpus": os.cpu_count(), "nproc": args.nproc,
              "load_before": [round(x, 2) for x in os.getloadavg()],
              "compare": compare(notebook, plain, args.repeat, args.nproc, work, work, args.before),
              "profile": profile_launcher(notebook, args.nproc, work, work),
              "load_after": [round(x, 2) for x in os.getloadavg()]}
    name = "job_overhead_gpu" if args.gpu else "job_overhead" if args.nproc == 1 else f"job_overhead_nproc{args.nproc}"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    md = args.out / f"{name}.md"
    kept = md.read_text().partition(FINDINGS)[2] if md.exists() else ""  # written by hand: kept across runs
    md.write_text(report(result) + (f"\n{FINDINGS}{kept}" if kept else ""))
    print(report(result))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
