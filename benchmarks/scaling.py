"""GPU scaling benchmark: every configuration trains the same workload in one run; results side by side.

    python benchmarks/scaling.py --out DIR [--phase explore|scaling|all]

Configurations (``gpu_workload.py`` says what the workload is): one GPU; nbddp on 2 GPUs (a notebook
written the Kaggle way, converted and launched by ``nbddp run``); the hand-written torchrun recipe;
accelerate's ``notebook_launcher`` with 2 processes; one process with the model split over both GPUs.
The multi-process ones run with NVLink and with ``NCCL_P2P_DISABLE=1`` (closer to T4s on PCIe).
Writes ``scaling.json``, ``scaling.md`` and ``scaling.png`` into DIR. Needs 2 GPUs.
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
    tag = out_dir / "raw" / re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_")
    tag.parent.mkdir(parents=True, exist_ok=True)
    for f in glob.glob(f"{tag}.rank*.json"):
        os.unlink(f)
    full_env = {**os.environ, "BENCH_OUT": str(tag), "BENCH_DIR": str(HERE),
                "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(HERE), os.environ.get("PYTHONPATH", "")]),
                **env}
    t = time.time()
    proc = subprocess.run(argv, env=full_env, cwd=HERE, capture_output=True, text=True, timeout=timeout)
    ranks = [json.load(open(f)) for f in sorted(glob.glob(f"{tag}.rank*.json"))]
    row = {"name": name, "ok": proc.returncode == 0 and bool(ranks), "wall_s": round(time.time() - t, 1),
           "env": env}
    if ranks:
        r0 = next(r for r in ranks if r["rank"] == 0)
        row.update(tokens_per_s=r0["tokens_per_s"], step_ms=r0["step_ms"], losses=r0["losses"],
                   peak_mem_gib=[round(r["peak_mem_gib"], 2) for r in sorted(ranks, key=lambda r: r["rank"])])
    else:
        row["error"] = (proc.stdout + proc.stderr)[-3000:]
    print(f"{name:48s} ok={row['ok']} tok/s={row.get('tokens_per_s', 0):9.0f} step={row.get('step_ms', 0):6.1f} ms "
          f"mem={row.get('peak_mem_gib')} wall={row['wall_s']}s", flush=True)
    if env.get("BENCH_PROFILE") and proc.stdout:
        print(proc.stdout[-6000:])
    if not row["ok"]:
        print(row.get("error", "")[-2000:], flush=True)
    return row


def torchrun(n: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}"]


def nbddp_notebook(path: Path) -> Path:
    import nbformat

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in gpu_workload.NOTEBOOK_CELLS])
    nbformat.write(nb, str(path))
    return path


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
    if phase in ("explore", "all"):
        # one DDP option at a time on the hand-written recipe, to choose nbddp's runtime defaults
        yield single
        yield hand
        yield ("hand-written P2P off", hand[1], {"NCCL_P2P_DISABLE": "1"})
        for knobs, p2p_too in (({"ddp_broadcast_buffers": False}, True), ({"comm_hook": "bf16"}, True),
                               ({"gradient_as_bucket_view": True}, False), ({"ddp_static_graph": True}, False),
                               ({"average_tokens_across_devices": False}, False)):
            for p2p in ({}, {"NCCL_P2P_DISABLE": "1"}) if p2p_too else ({},):
                label = " (P2P off)" if p2p else ""
                yield (f"hand-written + {json.dumps(knobs)}{label}", hand[1], {"BENCH_KNOBS": json.dumps(knobs), **p2p})
        yield ("hand-written profiled", hand[1], {"BENCH_PROFILE": "1"})
    if phase in ("scaling", "all"):
        yield single
        for name, argv, env in (nbddp, hand, launcher):
            yield (name, argv, env)
            yield (f"{name} (P2P off)", argv, {**env, "NCCL_P2P_DISABLE": "1"})
        yield split
        for name, argv, env in (single, nbddp, hand):
            yield (f"{name} fp16", argv, {**env, "BENCH_DTYPE": "fp16"})


def report(rows: list[dict], out_dir: Path) -> None:
    base = {r["env"].get("BENCH_DTYPE", "bf16"): r["tokens_per_s"] for r in rows if r["name"].startswith("1 GPU") and r["ok"]}
    hand = {(r["env"].get("BENCH_DTYPE", "bf16"), r["env"].get("NCCL_P2P_DISABLE", "0")): r["tokens_per_s"]
            for r in rows if r["name"].startswith("hand-written") and r["ok"] and "BENCH_KNOBS" not in r["env"]
            and "BENCH_PROFILE" not in r["env"]}
    lines = ["| configuration | tokens/s | step ms | scaling vs 1 GPU | ÷ hand-written | peak GiB per rank |",
             "|---|---:|---:|---:|---:|---|"]
    for r in rows:
        if not r["ok"]:
            lines.append(f"| {r['name']} | failed | | | | |")
            continue
        dt = r["env"].get("BENCH_DTYPE", "bf16")
        p2p = r["env"].get("NCCL_P2P_DISABLE", "0")
        r["scaling"] = r["tokens_per_s"] / base[dt] if dt in base else None
        h = hand.get((dt, p2p))
        r["vs_handwritten"] = r["tokens_per_s"] / h if h else None
        fmt = lambda v: f"{v:.3f}" if v else "—"  # noqa: E731
        lines.append(f"| {r['name']} | {r['tokens_per_s']:.0f} | {r['step_ms']:.1f} | {fmt(r['scaling'])} | "
                     f"{fmt(r['vs_handwritten'])} | {r['peak_mem_gib']} |")
    (out_dir / "scaling.md").write_text("\n".join(lines) + "\n")
    (out_dir / "scaling.json").write_text(json.dumps(rows, indent=1))
    print("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        ok = [r for r in rows if r["ok"] and "BENCH_KNOBS" not in r["env"] and "BENCH_PROFILE" not in r["env"]]
        fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.5))
        a.barh([r["name"] for r in ok], [r["tokens_per_s"] / 1000 for r in ok], color="#4878a8")
        a.set_xlabel("thousand tokens/s")
        a.invert_yaxis()
        for r in ok:
            if r.get("losses") and r["env"].get("BENCH_DTYPE", "bf16") == "bf16":
                b.plot([s for s, _ in r["losses"]], [v for _, v in r["losses"]], label=r["name"], alpha=0.8)
        b.set_xlabel("step"), b.set_ylabel("loss"), b.legend(fontsize=7)
        b.set_title("loss curves (bf16)")
        fig.tight_layout()
        fig.savefig(out_dir / "scaling.png", dpi=110)
    except Exception as exc:  # the table and JSON are the result; the chart is a convenience
        print(f"chart not drawn: {exc}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--phase", default="scaling", choices=["explore", "scaling", "all"])
    ap.add_argument("--only", default="", help="comma-separated configuration names to run (exact)")
    ap.add_argument("--repeat", type=int, default=1, help="run the whole list N times, interleaved; report medians")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, str(HERE / "gpu_workload.py"), "prepare"], check=True)  # no CUDA in this process
    configs = [c for c in configurations(args.out, args.phase)
               if not args.only or c[0] in args.only.split(",")]
    runs: dict[str, list[dict]] = {}
    for _ in range(args.repeat):  # interleaved, so drift in the machine touches every configuration alike
        for name, argv, env in configs:
            runs.setdefault(name, []).append(run(name, argv, env, args.out))
    report([median_row(rs) for rs in runs.values()], args.out)


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
