"""Variable-length benchmark: every route to 2 GPUs trains the same instruction-like workload in one call.

    python benchmarks/varlen.py --out benchmarks/results [--repeat 3] [--set nvlink --set kaggle]
    python benchmarks/varlen.py --out DIR --report            # rebuild the report from DIR/varlen-runs.jsonl
    python benchmarks/varlen.py --cpu --tiny --out /tmp/varlen-smoke   # smoke run on the CPU (gloo)

Configurations (``varlen_workload.py`` says what the workload and its lengths are), run interleaved so drift
in the machine touches each alike, ``--repeat`` passes:

- ``1 GPU``: the notebook as written, its cells as one script, one process;
- ``notebook under torchrun``: the same script under ``torchrun --nproc_per_node=2`` — Unsloth's own route
  when Unsloth is installed (the notebook then loads the model with ``FastLanguageModel``), else the HF
  route (the one change HF's docs give: a device per process instead of ``device_map="auto"``);
- ``hand-written torchrun``: the recipe people write by hand (process group, device per rank,
  ``ddp_find_unused_parameters=False``, non-reentrant checkpointing);
- ``nbddp``: ``nbddp run`` on the notebook, defaults (token-balanced shards on);
- ``nbddp, NBDDP_BALANCE=0``: the same without token balancing.

Sets: ``nvlink`` (bf16, NVLink) and ``kaggle`` (as on Kaggle's 2×T4: ``NCCL_P2P_DISABLE=1``, fp16, each
process capped at 15 GiB with ``torch.cuda.set_per_process_memory_fraction``). Reported per configuration:
real tokens/s (padding not counted; every rank's tokens over rank 0's timed window), scaling against 1 GPU,
the ratios to the notebook under torchrun and to the hand-written recipe, the wait per step (exposed NCCL
time from the profiler, mean of the ranks), the token spread between ranks per step, and the noise between
repeats ((max − min) / median). Every run is appended to ``varlen-runs.jsonl`` as it ends;
``varlen.json`` (``nbddp_scaling_vs_1gpu``, ``nbddp_vs_unsloth_route``, ``nbddp_vs_handwritten``: medians
of the nvlink set), ``varlen.md`` and ``varlen.png`` hold the result. Needs 2 GPUs, except ``--cpu --tiny``,
whose figures measure nothing about GPUs and may not be written under ``benchmarks/results``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from scaling import torchrun  # noqa: E402

SETS = {
    "nvlink": {},
    "kaggle": {"NCCL_P2P_DISABLE": "1", "BENCH_DTYPE": "fp16", "BENCH_MEM_GIB": "15"},
}
RUNS = "varlen-runs.jsonl"


def unsloth_route() -> bool:
    return importlib.util.find_spec("unsloth") is not None


def write_inputs(out: Path) -> tuple[Path, Path, Path]:
    """The notebook nbddp converts, and its cells as one plain script (for 1 GPU and for torchrun)."""
    import nbformat

    import varlen_workload as w

    cells = w.UNSLOTH_CELLS if unsloth_route() else w.NOTEBOOK_CELLS
    nb = out / "varlen_notebook.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells]), str(nb))
    script = out / "varlen_notebook.py"
    script.write_text("\n\n".join(cells) + "\n")
    under_torchrun = out / "varlen_notebook_torchrun.py"
    under_torchrun.write_text(w.script_under_torchrun(cells) + "\n")
    return nb, script, under_torchrun


def configurations(out: Path, sets: list[str]):
    py = sys.executable
    nb, script, under_torchrun = write_inputs(out)
    route = "Unsloth's own route" if unsloth_route() else "HF route"
    nbddp = [py, "-m", "nbddp.cli", "run", str(nb), "--nproc", "2", "--skip-installs", "--runs-dir", str(out / "runs")]
    for name in sets:
        env = SETS[name]
        yield name, "1 GPU (the notebook as written)", [py, str(script)], {**env, "CUDA_VISIBLE_DEVICES": "0"}
        yield name, f"notebook under torchrun ({route})", torchrun(2) + [str(under_torchrun)], env
        yield name, "hand-written torchrun", torchrun(2) + ["varlen_workload.py", "handwritten"], env
        yield name, "nbddp (token-balanced, the default)", nbddp, env
        yield name, "nbddp, NBDDP_BALANCE=0", nbddp, {**env, "NBDDP_BALANCE": "0"}


def run(set_name: str, name: str, argv: list[str], env: dict, out: Path, base_env: dict) -> dict:
    tag = out / "raw" / re.sub(r"[^A-Za-z0-9_.+-]+", "_", f"{set_name}-{name}").strip("_")
    tag.parent.mkdir(parents=True, exist_ok=True)
    result = Path(f"{tag}.rank0.json")
    result.unlink(missing_ok=True)
    full_env = {**os.environ, "BENCH_OUT": str(tag), "BENCH_DIR": str(HERE), **base_env, **env,
                "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(HERE), os.environ.get("PYTHONPATH", "")])}
    started = time.time()
    proc = subprocess.run(argv, env=full_env, cwd=HERE, capture_output=True, text=True, timeout=1200)
    row = {"set": set_name, "name": name, "env": env, "ok": proc.returncode == 0 and result.exists(),
           "wall_s": round(time.time() - started, 1)}
    if result.exists():
        row.update(json.loads(result.read_text()))
        row["nbddp_lines"] = [line for line in proc.stdout.splitlines() if line.startswith("nbddp: token")]
    else:
        row["error"] = (proc.stdout + proc.stderr)[-3000:]
    print(f"[{set_name}] {name:42s} ok={row['ok']} real tok/s={row.get('tokens_per_s', 0):9.0f} "
          f"step={row.get('step_ms', 0):7.1f} ms wait={row.get('wait_ms')} spread={row.get('token_spread')} "
          f"wall={row['wall_s']}s", flush=True)
    if not row["ok"]:
        print(row.get("error", "")[-2000:], flush=True)
    with open(out / RUNS, "a") as fh:  # every run as it ends: a cut-short call keeps what it measured
        fh.write(json.dumps(row) + "\n")
    return row


def medians(runs: list[dict]) -> list[dict]:
    """One row per (set, configuration), first-seen order: median figures, every run's tokens/s, the noise."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in runs:
        groups.setdefault((r["set"], r["name"]), []).append(r)
    rows = []
    for (set_name, name), rs in groups.items():
        ok = sorted((r for r in rs if r["ok"]), key=lambda r: r["tokens_per_s"])
        if not ok:
            rows.append({"set": set_name, "name": name, "ok": False, "runs": len(rs)})
            continue
        row = dict(ok[len(ok) // 2])
        tps = [r["tokens_per_s"] for r in ok]
        row.update(tokens_per_s=statistics.median(tps), tokens_per_s_runs=[round(v) for v in tps],
                   noise=(max(tps) - min(tps)) / statistics.median(tps), runs=len(rs),
                   step_ms=statistics.median(r["step_ms"] for r in ok),
                   token_spread=statistics.median(r["token_spread"] for r in ok))
        waits = [r["wait_ms"] for r in ok if r.get("wait_ms") is not None]
        row["wait_ms"] = statistics.median(waits) if waits else None
        rows.append(row)
    return rows


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def ratios(rows: list[dict], set_name: str) -> dict:
    by = {r["name"]: r for r in rows if r["set"] == set_name and r["ok"]}
    tps = lambda prefix: next((r["tokens_per_s"] for n, r in by.items() if n.startswith(prefix)), None)  # noqa: E731
    nbddp, single, route, hand, unbalanced = (tps(p) for p in ("nbddp (", "1 GPU", "notebook under", "hand-written",
                                                               "nbddp, NBDDP_BALANCE=0"))
    return {"nbddp_scaling_vs_1gpu": ratio(nbddp, single), "nbddp_vs_unsloth_route": ratio(nbddp, route),
            "nbddp_vs_handwritten": ratio(nbddp, hand), "nbddp_balanced_vs_unbalanced": ratio(nbddp, unbalanced)}


def ran_unsloth_route(rows: list[dict]) -> bool:
    """Whether the runs' "notebook under torchrun" was Unsloth's route: its name says so (``configurations``), so
    a report made on another machine (``--report``) says what ran, not what this one has installed."""
    names = [r["name"] for r in rows if r["name"].startswith("notebook under")]
    return any("Unsloth" in n for n in names) if names else unsloth_route()


def report(rows: list[dict], out: Path, device: str) -> dict:
    sets = list(dict.fromkeys(r["set"] for r in rows))
    fmt = lambda v, spec=".3f": format(v, spec) if v is not None else "—"  # noqa: E731
    unsloth = ran_unsloth_route(rows)
    lines = [f"Device: {device}. Route of 'notebook under torchrun': "
             f"{'Unsloth' if unsloth else 'HF (Unsloth not installed)'}.", ""]
    for s in sets:
        base = {r["name"]: r["tokens_per_s"] for r in rows if r["set"] == s and r["ok"]}
        single = next((v for n, v in base.items() if n.startswith("1 GPU")), None)
        route = next((v for n, v in base.items() if n.startswith("notebook under")), None)
        hand = base.get("hand-written torchrun")
        lines += [f"### set: {s} {json.dumps(SETS[s]) if SETS[s] else '(bf16, NVLink)'}", "",
                  "| configuration | real tokens/s (median) | runs | noise | step ms | scaling vs 1 GPU "
                  "| ÷ notebook under torchrun | ÷ hand-written | wait ms/step | token spread/step | peak GiB |",
                  "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|"]
        for r in (r for r in rows if r["set"] == s):
            if not r["ok"]:
                lines.append(f"| {r['name']} | failed | | | | | | | | | |")
                continue
            two = r["world_size"] > 1
            runs = ", ".join(f"{v / 1000:.1f}k" for v in r["tokens_per_s_runs"])
            lines.append(
                f"| {r['name']} | {r['tokens_per_s']:.0f} | {runs} | {r['noise']:.1%} | {r['step_ms']:.1f} | "
                f"{fmt(ratio(r['tokens_per_s'], single))} | {fmt(ratio(r['tokens_per_s'], route) if two else None)} | "
                f"{fmt(ratio(r['tokens_per_s'], hand) if two else None)} | {fmt(r['wait_ms'], '.2f')} | "
                f"{r['token_spread']:.1%} | {[round(m, 1) for m in r['peak_mem_gib']]} |")
        lines.append("")
    result = {"device": device, "route": "unsloth" if unsloth else "hf",
              **ratios(rows, "nvlink" if "nvlink" in sets else sets[0]),
              "by_set": {s: ratios(rows, s) for s in sets}, "rows": rows}
    (out / "varlen.md").write_text("\n".join(lines))
    (out / "varlen.json").write_text(json.dumps(result, indent=1))
    print("\n".join(lines))
    print(json.dumps({k: v for k, v in result.items() if k not in ("rows",)}, indent=1))
    try:
        chart(rows, out / "varlen.png")
    except Exception as exc:  # the table and JSON are the result; the chart is a convenience
        print(f"chart not drawn: {exc}")
    return result


def chart(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r["ok"]]
    fig, (a, b) = plt.subplots(1, 2, figsize=(15, 5.5))
    labels = [f"[{r['set']}] {r['name']}" for r in ok]
    a.barh(labels, [r["tokens_per_s"] / 1000 for r in ok], color=["#c0504d" if "nbddp (" in r["name"] else "#4878a8"
                                                                  for r in ok])
    for i, r in enumerate(ok):
        a.plot([v / 1000 for v in r["tokens_per_s_runs"]], [i] * len(r["tokens_per_s_runs"]), "k.", markersize=4)
    a.set_xlabel("thousand real tokens/s (bar: median; dots: each run)")
    a.invert_yaxis()
    a.tick_params(axis="y", labelsize=7)
    for r in ok:
        if r["name"].startswith("nbddp") and r["losses"]:
            b.plot([s for s, _ in r["losses"]], [v for _, v in r["losses"]], label=f"[{r['set']}] {r['name']}")
    b.set_xlabel("optimizer step (same samples per step)"), b.set_ylabel("loss"), b.legend(fontsize=7)
    b.set_title("nbddp with and without token balancing")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--set", action="append", choices=list(SETS), help="nvlink and kaggle (default: both)")
    ap.add_argument("--repeat", type=int, default=3, help="passes over every configuration, interleaved")
    ap.add_argument("--only", action="append", default=[], metavar="NAME", help="only configurations starting so")
    ap.add_argument("--report", action="store_true", help="run nothing: report from --out's runs")
    ap.add_argument("--device", help="with --report on another machine: the GPUs the runs ran on")
    ap.add_argument("--cpu", action="store_true", help="train on the CPU (gloo): a smoke run, not a measurement")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer model and short rows (with --cpu)")
    args = ap.parse_args()
    if args.cpu and (ROOT / "benchmarks" / "results") in [args.out.resolve(), *args.out.resolve().parents]:
        raise SystemExit("--cpu figures are a smoke run: write them outside benchmarks/results (e.g. /tmp)")
    args.out.mkdir(parents=True, exist_ok=True)
    base_env = {**({"BENCH_CPU": "1", "ACCELERATE_USE_CPU": "true", "CUDA_VISIBLE_DEVICES": ""} if args.cpu else {}),
                **({"BENCH_TINY": "1"} if args.tiny else {})}
    os.environ.update(base_env)  # for this process's import of the workload (its shape, its paths)
    import varlen_workload

    device = "CPU smoke run (gloo), not a GPU measurement" if args.cpu else args.device or varlen_workload.gpu_name()
    if not args.report:
        subprocess.run([sys.executable, str(HERE / "varlen_workload.py"), "prepare"], check=True,
                       env={**os.environ, **base_env})
        configs = [c for c in configurations(args.out, args.set or list(SETS))
                   if not args.only or any(c[1].startswith(o) for o in args.only)]
        for _ in range(args.repeat):
            for set_name, name, argv, env in configs:
                if args.cpu:
                    env = {k: v for k, v in env.items() if k != "CUDA_VISIBLE_DEVICES"}
                run(set_name, name, argv, env, args.out, base_env)
    runs = [json.loads(line) for line in (args.out / RUNS).read_text().splitlines() if line]
    report(medians(runs), args.out, device)


if __name__ == "__main__":
    main()
