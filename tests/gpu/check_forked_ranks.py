"""On a machine with GPUs, ranks forked from torchrun's process (``agent/forked_ranks``) use their GPUs.

torchrun's agent initializes CUDA there before it starts the ranks, but the process the ranks are forked from was
forked before that, from an agent whose imports (``preload``) left CUDA's driver alone.

``python -m nbddp.agent`` starts one rank per GPU, for a script that imports transformers (so that a machine
without GPUs would preload ``torch._inductor`` too); each says whether it was forked (its command line would be
the agent's), sets its device, joins an NCCL group and all-reduces. PASS: every rank was forked, on its own GPU,
and the sum is right. Also printed, for the record: after which import CUDA's driver is loaded and initialized in
a process (torch, what ``PRELOAD`` and ``LATER`` add, the usual notebook libraries). Exit 0 on PASS.

    python3 tests/gpu/check_forked_ranks.py [--nproc N]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RANK = """
import json, os, torch, torch.distributed as dist
if False:
    import transformers  # read by the agent's preload only
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("nccl")
t = torch.ones(1, device="cuda") * (dist.get_rank() + 1)
dist.all_reduce(t)
argv = open("/proc/self/cmdline", "rb").read().split(b"\\0")
print("RESULT " + json.dumps({"rank": dist.get_rank(), "sum": t.item(), "forked": b"nbddp.agent" in argv,
                              "threads": torch.get_num_threads(), "device": t.device.index,
                              "local_rank": int(os.environ["LOCAL_RANK"])}), flush=True)
dist.destroy_process_group()
"""
PROBE = """
import importlib, sys
from nbddp.agent import forked_ranks as f, preload
def say(what):
    maps = open("/proc/self/maps").read()
    print("after", what, "libcuda mapped", "libcuda.so" in maps, "initialized", f.cuda_driver_initialized())
import torch
say("torch")
for m in preload.PRELOAD + tuple(name for name, _ in preload.LATER):
    importlib.import_module(m)
    say(m)
for m in sys.argv[1:]:
    try:
        importlib.import_module(m)
    except Exception as exc:
        print("cannot import", m, exc)
    say(m)
"""


def main() -> int:
    import torch

    parser = argparse.ArgumentParser()
    parser.add_argument("--nproc", type=int, default=torch.cuda.device_count())
    nproc = parser.parse_args().nproc
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    probe = subprocess.run([sys.executable, "-c", PROBE, "transformers", "peft", "trl", "bitsandbytes", "unsloth"],
                           env=env, capture_output=True, text=True)
    print(probe.stdout, probe.stderr[-2000:])
    with tempfile.TemporaryDirectory() as work:
        script = Path(work) / "rank.py"
        script.write_text(RANK)
        done = subprocess.run([sys.executable, "-m", "nbddp.agent", "--standalone", f"--nproc_per_node={nproc}",
                               f"--log-dir={work}/logs", "--redirects=3", "--tee=3", str(script)],
                              env=env, capture_output=True, text=True, timeout=300)
    print(done.stdout[-3000:], done.stderr[-3000:])
    results = [json.loads(line.split("RESULT ", 1)[1]) for line in done.stdout.splitlines() if "RESULT " in line]
    ok = (probe.returncode == 0 and done.returncode == 0 and len(results) == nproc
          and all(r["forked"] and r["device"] == r["local_rank"] and r["sum"] == nproc * (nproc + 1) / 2
                  for r in results))
    print("PASS" if ok else "FAIL", results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
