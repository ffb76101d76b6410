"""Does token balancing change what a job learns? The evidence behind ``NBDDP_BALANCE``'s default (on).

    python benchmarks/balance_equivalence.py [--seeds 3] [--out benchmarks/results]

Trains ``tests/jobs/balance_trainer.py`` (the HF Trainer, LoRA on the tiny Llama, 384 variable-length rows of
1 to 7 sums, 14 to 119 tokens, batch 4 per rank, 3 epochs, lr 1e-2) on 2 gloo ranks under torchrun, with
token-balanced shards and without (``NBDDP_BALANCE=0``: the Trainer's ``RandomSampler`` sharded by
accelerate), each with several data seeds (the model's initialisation is the same in every run; only the
order the sampler draws differs). Reports:

- the per-epoch sample sets: for every run and epoch, which rows the two ranks trained on together;
- the loss per sample seen (every step is 8 samples in both): the gap between a balanced run and the plain
  run of the same data seed, against the gap between two plain runs of different data seeds (the noise the
  order alone brings), on curves smoothed over 8 steps, and each setting's loss over the last epoch;
- each step's token spread between the ranks (|rank 0 − rank 1| / mean), which balancing exists to remove.

Writes ``balance_equivalence.json``, ``.md`` and ``.png`` into ``--out``. Runs on CPU (gloo): it measures
what is learned, not speed (``benchmarks/varlen.py`` measures speed on GPUs).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
JOB = ROOT / "tests" / "jobs" / "balance_trainer.py"
SETTINGS = {"N": "384", "BATCH": "4", "EPOCHS": "3", "LR": "1e-2"}
SMOOTH = 8


def train(balanced: bool, seed: int, work: Path) -> list[dict]:
    out = work / f"{'balanced' if balanced else 'plain'}-{seed}"
    out.mkdir(parents=True)
    env = {**os.environ, **SETTINGS, "OUT": str(out), "DATA_SEED": str(seed),
           "NBDDP_BALANCE": "1" if balanced else "0",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(JOB)]
    proc = subprocess.run(argv, env=env, cwd=out, capture_output=True, text=True, timeout=900)
    if proc.returncode:
        raise SystemExit(f"run failed ({out.name}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def smooth(values: list[float]) -> list[float]:
    return [statistics.mean(values[i:i + SMOOTH]) for i in range(0, len(values) - SMOOTH + 1)]


def gap(a: list[float], b: list[float]) -> float:
    """Mean absolute difference of two smoothed loss curves."""
    return statistics.mean(abs(x - y) for x, y in zip(smooth(a), smooth(b)))


def summarise(runs: dict) -> dict:
    n = int(SETTINGS["N"])
    sets_ok = all(sorted(ranks[0]["seen"][e] + ranks[1]["seen"][e]) == list(range(n))
                  for ranks in runs.values() for e in ranks[0]["seen"])
    seeds = sorted({s for _, s in runs})
    loss = {key: runs[key][0]["loss"] for key in runs}
    steps_per_epoch = len(loss[(False, seeds[0])]) // int(SETTINGS["EPOCHS"])
    balanced_vs_plain = [gap(loss[(True, s)], loss[(False, s)]) for s in seeds]
    plain_vs_plain = [gap(loss[(False, s)], loss[(False, t)]) for s, t in itertools.combinations(seeds, 2)]
    balanced_vs_balanced = [gap(loss[(True, s)], loss[(True, t)]) for s, t in itertools.combinations(seeds, 2)]
    last = {b: [statistics.mean(loss[(b, s)][-steps_per_epoch:]) for s in seeds] for b in (True, False)}
    spread = {b: statistics.mean(abs(x - y) / ((x + y) / 2) for s in seeds
                                 for x, y in zip(runs[(b, s)][0]["tokens"], runs[(b, s)][1]["tokens"]))
              for b in (True, False)}
    return {
        "settings": {**SETTINGS, "ranks": 2, "backend": "gloo (CPU)", "seeds": seeds, "smoothing_steps": SMOOTH},
        "every_epoch_every_sample_once": sets_ok,
        "loss_gap_balanced_vs_plain_same_seed": balanced_vs_plain,
        "loss_gap_plain_vs_plain_other_seed": plain_vs_plain,
        "loss_gap_balanced_vs_balanced_other_seed": balanced_vs_balanced,
        "last_epoch_loss_balanced": last[True],
        "last_epoch_loss_plain": last[False],
        "token_spread_per_step_balanced": spread[True],
        "token_spread_per_step_plain": spread[False],
        "losses": {f"{'balanced' if b else 'plain'} seed {s}": v for (b, s), v in loss.items()},
    }


def table(r: dict) -> str:
    f = lambda xs: ", ".join(f"{x:.4f}" for x in xs)  # noqa: E731
    return "\n".join([
        "Token-balanced shards vs the Trainer's sampler, 2 gloo ranks (CPU), "
        f"{r['settings']['N']} rows, batch {r['settings']['BATCH']} per rank, {r['settings']['EPOCHS']} epochs, "
        f"data seeds {r['settings']['seeds']}. `python benchmarks/balance_equivalence.py`.",
        "",
        "| measure | balanced | plain (NBDDP_BALANCE=0) |",
        "|---|---|---|",
        f"| every sample once per epoch, across ranks | {r['every_epoch_every_sample_once']} | "
        f"{r['every_epoch_every_sample_once']} |",
        f"| loss over the last epoch, per seed | {f(r['last_epoch_loss_balanced'])} | "
        f"{f(r['last_epoch_loss_plain'])} |",
        f"| token spread between ranks per step | {r['token_spread_per_step_balanced']:.1%} | "
        f"{r['token_spread_per_step_plain']:.1%} |",
        "",
        f"Gap between smoothed loss curves ({r['settings']['smoothing_steps']} steps), per sample seen:",
        "",
        f"- balanced vs plain, same data seed: {f(r['loss_gap_balanced_vs_plain_same_seed'])}",
        f"- plain vs plain, other data seed (the order's own noise): {f(r['loss_gap_plain_vs_plain_other_seed'])}",
        f"- balanced vs balanced, other data seed: {f(r['loss_gap_balanced_vs_balanced_other_seed'])}",
        "",
    ])


def chart(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batch = int(r["settings"]["BATCH"]) * 2
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, values in r["losses"].items():
        curve = smooth(values)
        ax.plot([batch * (i + SMOOTH) for i in range(len(curve))], curve, label=name,
                color="#c0504d" if name.startswith("balanced") else "#4878a8", alpha=0.8)
    ax.set_xlabel("samples seen"), ax.set_ylabel(f"loss ({SMOOTH}-step mean)"), ax.legend(fontsize=7)
    ax.set_title("token-balanced shards (red) vs the Trainer's sampler (blue)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=HERE / "results")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        runs = {(b, s): train(b, s, Path(tmp)) for s in range(args.seeds) for b in (True, False)}
    result = summarise(runs)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "balance_equivalence.json").write_text(json.dumps(result, indent=1))
    (args.out / "balance_equivalence.md").write_text(table(result))
    chart(result, args.out / "balance_equivalence.png")
    print(table(result))


if __name__ == "__main__":
    main()
