"""GPU scaling benchmark: every configuration trains the same workload in one run; results side by side.

    python benchmarks/scaling.py --out DIR [--phase main|variants|profile|explore ...] [--repeat N]
    python benchmarks/scaling.py --out DIR --report RUNDIR...   # one report from several calls' runs

Configurations (``gpu_workload.py`` says what the workload is): one GPU; nbddp on 2 GPUs (a notebook
written the Kaggle way, converted and launched by ``nbddp run``); the hand-written torchrun recipe;
accelerate's ``notebook_launcher`` with 2 processes; one process with the model split over both GPUs.
The multi-process ones run with NVLink and with ``NCCL_P2P_DISABLE=1`` (closer to T4s on PCIe).

Phases: ``main`` (1 GPU, nbddp, hand-written, and nbddp's ``loss_filter`` default on and off, so its gain is
shown on one GPU as well as two), ``variants`` (P2P off, notebook_launcher, model split, fp16), ``profile``
(where each step's GPU time goes), ``explore`` (one DDP option at a time). Every run is appended to
``DIR/runs.jsonl`` as it ends; ``scaling.json``, ``scaling.md`` and ``scaling.png`` hold the medians.
Needs 2 GPUs.
"""

from __future__ import annotations

import argparse
import glob
import re
import statistics
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
import gpu_workload  # noqa: E402


def run(name: str, argv: list[str], env: dict, out_dir: Path, timeout: int = 300) -> dict:
    tag = out_dir / "raw" / re.sub(r"[^A-Za-z0-9_.+-]+", "_", name).strip("_")
    tag.parent.mkdir(parents=True, exist_ok=True)
    for f in glob.glob(f"{tag}.rank*.json"):
        os.unlink(f)
    full_env = {**os.environ, "BENCH_OUT": str(tag), "BENCH_DIR": str(HERE),
                "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(HERE), os.environ.get("PYTHONPATH", "")]),
                **env}
    t = time.time()
    proc = subprocess.run(argv, env=full_env, cwd=HERE, capture_output=True, text=True, timeout=timeout)
    ranks = sorted((json.load(open(f)) for f in glob.glob(f"{tag}.rank*.json")), key=lambda r: r["rank"])
    row = {"name": name, "ok": proc.returncode == 0 and bool(ranks), "wall_s": round(time.time() - t, 1),
           "env": env}
    if ranks:
        r0 = ranks[0]
        row.update(tokens_per_s=r0["tokens_per_s"], step_ms=r0["step_ms"], losses=r0["losses"],
                   peak_mem_gib=[round(r["peak_mem_gib"], 2) for r in ranks])
        if any(r.get("profile") for r in ranks):
            row["profile"] = [r.get("profile") for r in ranks]
        applied = [line for line in proc.stdout.splitlines() if line.startswith("nbddp: ")]
        if applied:
            row["nbddp_lines"] = applied
    else:
        row["error"] = (proc.stdout + proc.stderr)[-3000:]
    print(f"{name:48s} ok={row['ok']} tok/s={row.get('tokens_per_s', 0):9.0f} step={row.get('step_ms', 0):6.1f} ms "
          f"mem={row.get('peak_mem_gib')} wall={row['wall_s']}s", flush=True)
    if not row["ok"]:
        print(row.get("error", "")[-2000:], flush=True)
    with open(out_dir / "runs.jsonl", "a") as fh:  # every run as it ends: a cut-short call keeps what it measured
        fh.write(json.dumps(row) + "\n")
    return row


def torchrun(n: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}"]


def nbddp_notebook(path: Path) -> Path:
    import nbformat

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in gpu_workload.NOTEBOOK_CELLS])
    nbformat.write(nb, str(path))
    return path


PHASES = ("main", "variants", "profile", "explore")


def configurations(out_dir: Path, phase: str):
    py = sys.executable
    nb = nbddp_notebook(out_dir / "bench_notebook.ipynb")
    single = ("1 GPU", [py, "gpu_workload.py", "handwritten"], {"CUDA_VISIBLE_DEVICES": "0"})
    hand = ("hand-written torchrun", torchrun(2) + ["gpu_workload.py", "handwritten"], {})
    nbddp = ("nbddp", [py, "-m", "nbddp.cli", "run", str(nb), "--nproc", "2", "--skip-installs",
                       "--runs-dir", str(out_dir / "runs")], {})
    launcher = ("accelerate notebook_launcher",
                [py, "-c", "from accelerate import notebook_launcher; import gpu_workload as w; "
                           "notebook_launcher(w.launcher_fn, num_processes=2)"], {})
    split = ("1 process, model split over 2 GPUs", [py, "gpu_workload.py", "device_map_auto"], {})
    # nbddp's Trainer default on one GPU too, so its gain is not mistaken for scaling
    single_filter = ("1 GPU + nbddp loss_filter", single[1], {**single[2], "BENCH_SHIMS": "loss_filter"})
    nbddp_unfiltered = ("nbddp without loss_filter", nbddp[1], {"NBDDP_SHIM_LOSS_FILTER": "0"})
    p2p_off = {"NCCL_P2P_DISABLE": "1"}
    if phase == "main":
        yield from (single, single_filter, nbddp, nbddp_unfiltered, hand)
    if phase == "variants":
        yield single
        for name, argv, env in (nbddp, hand, launcher):
            yield (f"{name} (P2P off)", argv, {**env, **p2p_off})
        yield launcher
        yield split
        for name, argv, env in (single, nbddp, hand):
            yield (f"{name} fp16", argv, {**env, "BENCH_DTYPE": "fp16"})
    if phase == "profile":  # steps WARMUP+5..+15 under torch.profiler; throughput of these runs not reported
        for name, argv, env in (single, single_filter, nbddp, nbddp_unfiltered, hand):
            yield (f"{name} [profiled]", argv, {**env, "BENCH_PROFILE": "1"})
    if phase == "explore":
        # one DDP option at a time on the hand-written recipe, to choose nbddp's runtime defaults
        yield single
        yield hand
        yield ("hand-written P2P off", hand[1], p2p_off)
        for knobs, p2p_too in (({"ddp_broadcast_buffers": False}, True), ({"comm_hook": "bf16"}, True),
                               ({"gradient_as_bucket_view": True}, False), ({"ddp_static_graph": True}, False),
                               ({"average_tokens_across_devices": False}, False)):
            for p2p in ({}, p2p_off) if p2p_too else ({},):
                label = " (P2P off)" if p2p else ""
                yield (f"hand-written + {json.dumps(knobs)}{label}", hand[1], {"BENCH_KNOBS": json.dumps(knobs), **p2p})


def key(row: dict) -> tuple[str, str]:
    """(dtype, P2P) of a run: rows compare with the baseline of the same precision and link."""
    return row["env"].get("BENCH_DTYPE", "bf16"), row["env"].get("NCCL_P2P_DISABLE", "0")


def report(rows: list[dict], out_dir: Path) -> None:
    """``scaling.md`` / ``.json`` / ``.png`` from median rows; profiled runs go to their own table."""
    timed = [r for r in rows if r["ok"] and "BENCH_PROFILE" not in r["env"]]
    base = {key(r)[0]: r["tokens_per_s"] for r in timed if r["name"] in ("1 GPU", "1 GPU fp16")}
    base_filter = {key(r)[0]: r["tokens_per_s"] for r in timed if r["name"] == "1 GPU + nbddp loss_filter"}
    hand = {key(r): r["tokens_per_s"] for r in timed if r["name"].startswith("hand-written") and "BENCH_KNOBS" not in r["env"]}
    fmt = lambda v: f"{v:.3f}" if v else "—"  # noqa: E731
    lines = ["| configuration | tokens/s (median) | runs | step ms | scaling vs 1 GPU | vs 1 GPU + loss_filter "
             "| ÷ hand-written | peak GiB per rank |",
             "|---|---:|---|---:|---:|---:|---:|---|"]
    for r in rows:
        if "BENCH_PROFILE" in r["env"]:
            continue
        if not r["ok"]:
            lines.append(f"| {r['name']} | failed | | | | | | |")
            continue
        dt, p2p = key(r)
        r["scaling"] = r["tokens_per_s"] / base[dt] if dt in base else None
        r["scaling_vs_filtered"] = r["tokens_per_s"] / base_filter[dt] if dt in base_filter else None
        several = len(r["peak_mem_gib"]) > 1  # a row of 2 processes, comparable with the hand-written recipe
        r["vs_handwritten"] = r["tokens_per_s"] / hand[(dt, p2p)] if several and (dt, p2p) in hand else None
        runs = ", ".join(f"{v / 1000:.1f}k" for v in r.get("tokens_per_s_runs", []))
        lines.append(f"| {r['name']} | {r['tokens_per_s']:.0f} | {runs} | {r['step_ms']:.1f} | {fmt(r['scaling'])} | "
                     f"{fmt(r['scaling_vs_filtered'])} | {fmt(r['vs_handwritten'])} | {r['peak_mem_gib']} |")
    profiled = [r for r in rows if r["ok"] and r.get("profile")]
    if profiled:
        lines += ["", "GPU time per step in profiled runs (ms, from the kernels' timeline; rank 0 / rank 1):", "",
                  "| configuration | step window | busy | compute | NCCL exposed | NCCL total | idle |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for r in profiled:
            cells = [" / ".join(f"{p[k]:.1f}" for p in r["profile"] if p) for k in
                     ("window", "busy", "compute", "nccl_exposed", "nccl_total", "idle")]
            lines.append(f"| {r['name']} | " + " | ".join(cells) + " |")
    (out_dir / "scaling.md").write_text("\n".join(lines) + "\n")
    (out_dir / "scaling.json").write_text(json.dumps(rows, indent=1))
    print("\n".join(lines))
    try:
        chart(timed, out_dir / "scaling.png")
    except Exception as exc:  # the table and JSON are the result; the chart is a convenience
        print(f"chart not drawn: {exc}")


def chart(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if "BENCH_KNOBS" not in r["env"]]
    fig, (a, b) = plt.subplots(1, 2, figsize=(14, 5))
    a.barh([r["name"] for r in rows], [r["tokens_per_s"] / 1000 for r in rows], color="#4878a8")
    for i, r in enumerate(rows):
        a.plot([v / 1000 for v in r.get("tokens_per_s_runs", [])], [i] * len(r.get("tokens_per_s_runs", [])),
               "k.", markersize=4)
    a.set_xlabel("thousand tokens/s (bar: median; dots: each run)")
    a.invert_yaxis()
    for r in rows:
        if r.get("losses") and key(r)[0] == "bf16":
            b.plot([s for s, _ in r["losses"]], [v for _, v in r["losses"]], label=r["name"], alpha=0.8)
    b.set_xlabel("step"), b.set_ylabel("loss"), b.legend(fontsize=7)
    b.set_title("loss curves (bf16)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--phase", action="append", choices=PHASES,
                    help="main (default), variants, profile, explore; repeatable")
    ap.add_argument("--only", action="append", default=[], metavar="NAME",
                    help="run only this configuration (exact name; repeatable)")
    ap.add_argument("--repeat", type=int, default=1, help="run the whole list N times, interleaved; report medians")
    ap.add_argument("--report", type=Path, nargs="*", default=None,
                    help="run nothing: write the report into --out from the runs.jsonl of these folders")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.report is not None:
        report(medians(read_runs(args.report or [args.out])), args.out)
        return
    subprocess.run([sys.executable, str(HERE / "gpu_workload.py"), "prepare"], check=True)  # no CUDA in this process
    configs = [c for phase in args.phase or ["main"] for c in configurations(args.out, phase)
               if not args.only or c[0] in args.only]
    for _ in range(args.repeat):  # interleaved, so drift in the machine touches every configuration alike
        for name, argv, env in configs:
            run(name, argv, env, args.out)
    report(medians(read_runs([args.out])), args.out)


def read_runs(folders: list[Path]) -> list[dict]:
    return [json.loads(line) for folder in folders for line in (folder / "runs.jsonl").read_text().splitlines() if line]


def medians(runs: list[dict]) -> list[dict]:
    """One row per configuration (first-seen order): the run with the median throughput, carrying every run's."""
    by_name: dict[str, list[dict]] = {}
    for r in runs:
        by_name.setdefault(r["name"], []).append(r)
    return [median_row(rs) for rs in by_name.values()]


def median_row(rows: list[dict]) -> dict:
    """The run with the median throughput, carrying every run's tokens/s."""
    ok = sorted((r for r in rows if r["ok"]), key=lambda r: r["tokens_per_s"])
    if not ok:
        return rows[-1]
    row = dict(ok[len(ok) // 2])
    row["tokens_per_s_runs"] = [round(r["tokens_per_s"]) for r in rows if r["ok"]]
    row["tokens_per_s"] = statistics.median(r["tokens_per_s"] for r in ok)
    return row


if __name__ == "__main__":
    main()
