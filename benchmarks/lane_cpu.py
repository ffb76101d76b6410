"""Where a test lane's CPU goes: each Python process it starts, by kind and by test.

    .venv/bin/python benchmarks/lane_cpu.py [--out benchmarks/results] [-- PYTEST ARGS…]
    .venv/bin/python benchmarks/lane_cpu.py --from records.jsonl      # read a run's records again

Runs the end-to-end lane as ``make test-e2e`` does (or the pytest arguments after ``--``) with a recorder in
every Python process of the venv: a ``.pth`` file put in its site-packages for the run and taken out after,
since the tests give many of their processes an environment (``PYTHONPATH``) of their own and a ``.pth`` is
read by every interpreter of the venv whatever its environment. At exit each process appends its own CPU
seconds and those of the children it waited for, its parent, its command line and the test it ran under
(``PYTEST_CURRENT_TEST``, which the tests' processes inherit). Ranks forked by ``nbddp.agent`` run no exit
handler of the agent's (``agent/forked_ranks``): their CPU is the agent's children, less what the recorded
processes under it used themselves (each names its ancestors, read from ``/proc`` when it starts). A process killed outright (a kernel a test kills) leaves no record.

Writes ``lane_cpu.json`` (the records and the sums) and ``lane_cpu.md`` (CPU by kind of process, and the
tests that use most) under ``--out``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LANE = ["-q", "-n", "2", "--dist", "loadgroup", "-m", "e2e and not browser and not colab", "-p", "no:cacheprovider"]
#: The recorder each process of the venv imports at start (from the ``.pth`` file); stdlib only.
RECORDER = '''import atexit, json, os, resource, sys, time
_began = time.time()
def _ancestors():
    out, pid = [], os.getppid()
    while pid > 1 and len(out) < 16:
        out.append(pid)
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return out
_ancestry = _ancestors()  # at start, while they live: a process under a forked rank names the agent above it
def _record():
    try:
        own, waited = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        line = json.dumps({"pid": os.getpid(), "ppid": os.getppid(), "argv": [os.path.basename(sys.executable)] + sys.argv[:8],
                           "ancestors": _ancestry, "self": round(own.ru_utime + own.ru_stime, 2), "children": round(waited.ru_utime + waited.ru_stime, 2),
                           "wall": round(time.time() - _began, 2), "test": os.environ.get("PYTEST_CURRENT_TEST", ""),
                           "xdist_worker": "xdist.remote" in sys.modules})
        fd = os.open("%(log)s", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.write(fd, (line + "\\n").encode())
        os.close(fd)
    except Exception:
        pass
atexit.register(_record)
'''
#: How a process is named, by a word of its command line (the first that matches).
KINDS = (("warm process (agent/warm.py: imports once what the agents it forks preload)", "nbddp/agent/warm.py"),
         ("nbddp.agent (its forked ranks apart)", "nbddp/agent"),
         ("torchrun of a launched command", "torch/distributed/run.py"), ("torchrun of a launched command", "bin/torchrun"),
         ("launched-mode stand-in", "nbddp/launched.py"), ("nbddp CLI", "nbddp/cli.py"), ("kernel", "ipykernel"),
         ("one-process baseline (run_cells.py)", "run_cells.py"), ("papermill", "papermill"),
         ("pytest (xdist controller)", "pytest/__main__.py"))
FORKED = "ranks forked by nbddp.agent"
OTHER = "other: the scripts tests and notebooks run themselves (`python train.py`, `python -c …`)"


def record_lane(pytest_args: list[str], log: Path) -> float:
    """Run pytest with the recorder in every process of this venv; the wall seconds."""
    site = Path(sysconfig.get_paths()["purelib"])
    module, pth = site / "nbddp_lane_cpu_recorder.py", site / "zz_nbddp_lane_cpu.pth"
    module.write_text(RECORDER % {"log": log})
    pth.write_text("import nbddp_lane_cpu_recorder\n")
    started = time.monotonic()
    try:
        subprocess.run([sys.executable, "-m", "pytest", *pytest_args], cwd=ROOT, check=False)
    finally:
        pth.unlink(missing_ok=True)
        module.unlink(missing_ok=True)
    return time.monotonic() - started


def kind(record: dict) -> str:
    if record.get("xdist_worker"):
        return "pytest worker"
    text = " ".join(record["argv"])
    return next((name for name, word in KINDS if word in text), OTHER)


def forked_rank_cpu(records: list[dict]) -> dict[int, float]:
    """Each agent's forked ranks' CPU: its children's, less what the recorded processes under it used."""
    def recorded_under(pid: int) -> float:
        return sum(r["self"] for r in records if pid in r.get("ancestors", ()))

    return {r["pid"]: max(0.0, r["children"] - recorded_under(r["pid"]))
            for r in records if kind(r).startswith("nbddp.agent")}


def summarize(records: list[dict]) -> dict:
    by_kind = collections.defaultdict(lambda: {"processes": 0, "cpu_s": 0.0})
    by_test = collections.defaultdict(lambda: {"cpu_s": 0.0, "launches": 0})
    forked = forked_rank_cpu(records)
    for r in records:
        name, test = kind(r), r["test"].rsplit(" (", 1)[0]
        by_kind[name]["processes"] += 1
        by_kind[name]["cpu_s"] += r["self"]
        if r["pid"] in forked:
            by_kind[FORKED]["cpu_s"] += forked[r["pid"]]
        if test and name != "pytest worker":
            by_test[test]["cpu_s"] += r["self"] + forked.get(r["pid"], 0.0)
            by_test[test]["launches"] += r["pid"] in forked
    total = sum(v["cpu_s"] for v in by_kind.values())
    return {"total_cpu_s": round(total, 1), "agents": len(forked),
            "by_kind": {k: {"processes": v["processes"], "cpu_s": round(v["cpu_s"], 1)}
                        for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1]["cpu_s"])},
            "by_test": {k: {"cpu_s": round(v["cpu_s"], 1), "launches": v["launches"]}
                        for k, v in sorted(by_test.items(), key=lambda kv: -kv[1]["cpu_s"])}}


def markdown(summary: dict, wall_s: float | None, load: tuple | None, top: int = 25) -> str:
    total = summary["total_cpu_s"]
    lines = ["# CPU of the end-to-end lane, by process", "",
             "`benchmarks/lane_cpu.py`: every Python process of the venv records its own CPU at exit (user + system).", ""]
    if wall_s is not None:
        lines += [f"Wall {wall_s / 60:.1f} min; recorded CPU {total / 60:.1f} min ({total / wall_s:.2f} cores busy of 2)"
                  + (f"; load average before/after: {load}." if load else "."), ""]
    lines += [f"{summary['agents']} launches through `nbddp.agent`.", "",
              "| process | processes | CPU s | share |", "|---|---:|---:|---:|"]
    for name, v in summary["by_kind"].items():
        count = "" if name == FORKED else v["processes"]
        lines.append(f"| {name} | {count} | {v['cpu_s']:.0f} | {100 * v['cpu_s'] / total:.0f} % |")
    lines += ["", f"The {top} tests that use most (their processes' CPU, forked ranks included; not the pytest "
              "worker's own):", "", "| test | launches | CPU s |", "|---|---:|---:|"]
    for name, v in list(summary["by_test"].items())[:top]:
        lines.append(f"| `{name.removeprefix('tests/')}` | {v['launches']} | {v['cpu_s']:.0f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--from", dest="source", type=Path, help="summarize these records instead of running")
    parser.add_argument("--wall-s", type=float, help="with --from: the run's wall seconds, to say in the table")
    parser.add_argument("pytest_args", nargs="*", help="after --: what pytest runs (default: the e2e lane)")
    args = parser.parse_args()
    wall = load = None
    if args.source:
        log, wall = args.source, args.wall_s
    else:
        log = Path(tempfile.mkdtemp(prefix="lane-cpu-")) / "records.jsonl"
        before = os.getloadavg()
        wall = record_lane(args.pytest_args or LANE, log)
        load = tuple(round(x, 2) for x in (*before[:1], *os.getloadavg()[:1]))
    records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    summary = summarize(records)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "lane_cpu.json").write_text(json.dumps({"wall_s": wall, "load": load, **summary}, indent=1) + "\n")
    (args.out / "lane_cpu.md").write_text(markdown(summary, wall, load))
    print((args.out / "lane_cpu.md").read_text())


if __name__ == "__main__":
    main()
