"""What the safety net costs (target: at most 1% of training time): two gloo ranks train an MLP whose
parameters no DDP wrapper manages (the case the net checks every N steps), on the same data, so the
replicas stay identical and the job runs to the end.

Each rank times every check (``runtime.divergence.check``) and the whole loop; rank 0 reports the checks'
share of the loop's time, how many checks ran, and the loop's time with the net off
(``NBDDP_ALLOW_DIVERGENCE=1``) in a second job. Writes ``benchmarks/results/divergence_overhead.json``.

    python benchmarks/divergence_overhead.py [--steps 400] [--width 512]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "divergence_overhead.json"


def worker(steps: int, width: int, out: str) -> None:
    import torch

    import nbddp.runtime as _nbddp
    from nbddp.runtime import divergence

    _nbddp.setup()
    spent = []
    original = divergence.check

    def timed(*args, **kwargs):
        started = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spent.append(time.perf_counter() - started)

    divergence.check = timed
    torch.manual_seed(0)
    layers = [torch.nn.Linear(width, width) for _ in range(4)] + [torch.nn.Linear(width, 1)]
    model = torch.nn.Sequential(*layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, y = torch.randn(64, width), torch.randn(64, 1)
    started = time.perf_counter()
    for _ in range(steps):
        loss = ((model(x) - y) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    total = time.perf_counter() - started
    if _nbddp.is_main_process():
        Path(out).write_text(json.dumps({"loop_s": total, "checks": len(spent), "check_s": sum(spent),
                                         "params": sum(p.numel() for p in model.parameters())}))
    _nbddp.cleanup()


def job(steps: int, width: int, allow: bool) -> dict:
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"nbddp-divergence-{os.getpid()}-{int(allow)}.json"
    env = dict(os.environ, NBDDP_ALLOW_DIVERGENCE="1" if allow else "0", OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                    __file__, "--worker", "--steps", str(steps), "--width", str(width), "--out", str(out)],
                   env=env, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.worker:
        return worker(args.steps, args.width, args.out)
    on, off = job(args.steps, args.width, False), job(args.steps, args.width, True)
    result = {"steps": args.steps, "params": on["params"], "checks": on["checks"],
              "check_share": on["check_s"] / on["loop_s"], "loop_s_net_on": on["loop_s"], "loop_s_net_off": off["loop_s"]}
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
