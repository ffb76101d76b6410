"""The part of ``nbddp doctor`` that runs in the ranks, under torchrun.

Each rank writes what it sees of its device to ``$NBDDP_RUN_DIR/device-<rank>.json`` (before anything that
can hang), then the ranks join a process group and all-reduce: first a small tensor whose sum is checked,
then a larger one, timed. Rank 0 writes ``allreduce.json``. The doctor in the kernel never touches CUDA
itself, so it takes no GPU memory there.
"""

from __future__ import annotations

import json
import time
from datetime import timedelta
from pathlib import Path

from . import settings

#: Elements (float32) of the timed all-reduce: 64 MiB on GPUs, 4 MiB over gloo on CPU.
GPU_ELEMENTS, CPU_ELEMENTS = 2**24, 2**20
#: Timed repetitions after one warm-up.
REPEATS = 5


def device_info(info) -> dict:
    """This rank's place in the job and, on a GPU, its name, capability, memory and precisions."""
    import torch

    out = {"rank": info.rank, "local_rank": info.local_rank, "world_size": info.world_size,
           "backend": info.backend, "device": info.device}
    if info.device.startswith("cuda"):
        props = torch.cuda.get_device_properties(info.local_rank)
        free, total = torch.cuda.mem_get_info(info.local_rank)
        out.update(name=props.name, capability=f"{props.major}.{props.minor}", total_bytes=total,
                   free_bytes=free, bf16=bool(torch.cuda.is_bf16_supported()))
    return out


def main() -> None:
    import torch
    import torch.distributed as dist

    from .dist import rank_info
    from .lifecycle import DEFAULT_TIMEOUT_S, cleanup
    from .io import atomic_write_text

    out_dir = Path(settings.current().run_dir or ".")  # NBDDP_RUN_DIR
    info = rank_info()
    if info.device.startswith("cuda"):
        torch.cuda.set_device(info.local_rank)
    atomic_write_text(out_dir / f"device-{info.rank}.json", json.dumps(device_info(info)))

    seconds = settings.current().timeout  # NBDDP_TIMEOUT
    timeout = timedelta(seconds=DEFAULT_TIMEOUT_S if seconds is None else seconds)
    dist.init_process_group(backend=info.backend, timeout=timeout)
    world = dist.get_world_size()
    check = torch.full((4,), float(info.rank + 1), device=info.device)
    dist.all_reduce(check)
    expected = world * (world + 1) / 2
    correct = bool(torch.all(check == expected).item())

    x = torch.ones(GPU_ELEMENTS if info.device.startswith("cuda") else CPU_ELEMENTS, device=info.device)
    dist.all_reduce(x)  # warm-up: connections are set up on first use
    _sync(info)
    start = time.perf_counter()
    for _ in range(REPEATS):
        dist.all_reduce(x)
    _sync(info)
    seconds = (time.perf_counter() - start) / REPEATS
    if info.rank == 0:
        size = x.numel() * x.element_size()
        bus = size / seconds * 2 * (world - 1) / world if world > 1 else 0.0  # nccl-tests' bus bandwidth
        result = {"correct": correct, "value": float(check[0].item()), "expected": expected, "world_size": world,
                  "backend": info.backend, "bytes": size, "seconds": seconds, "bus_bytes_per_s": bus}
        atomic_write_text(out_dir / "allreduce.json", json.dumps(result))
    cleanup()


def _sync(info) -> None:
    if info.device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
