"""This machine's NVIDIA GPUs as torch will see them, read from the driver with ``nvidia-smi`` (NVML).

Why not torch: the launcher only needs a count and each GPU's free memory before it starts torchrun, and
importing torch with CUDA then initialising it in a child process cost a fresh job about 15 s of its start on
an H100 (``benchmarks/results/job_overhead_gpu.md``); ``nvidia-smi`` answers in a fraction of a second.
``CUDA_VISIBLE_DEVICES`` is applied as CUDA applies it: indices or UUID prefixes, read up to the first entry that
names no GPU. Where ``nvidia-smi`` cannot answer (no NVIDIA driver tools, an AMD GPU), callers ask torch.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass

MiB = 2**20
QUERY = ("nvidia-smi", "--query-gpu=index,uuid,memory.free", "--format=csv,noheader,nounits")


@dataclass(frozen=True)
class Gpu:
    index: int
    uuid: str
    free_bytes: int


def visible_gpus(timeout_s: float = 10.0) -> tuple[Gpu, ...] | None:
    """The GPUs a process started now would see, in its order; None where ``nvidia-smi`` cannot say."""
    if shutil.which(QUERY[0]) is None:
        return None
    try:
        out = subprocess.run(QUERY, capture_output=True, text=True, timeout=timeout_s)
    except (subprocess.SubprocessError, OSError):
        return None
    if out.returncode != 0:
        return None
    gpus = parse_query(out.stdout)
    return None if gpus is None else apply_visible(gpus, os.environ.get("CUDA_VISIBLE_DEVICES"))


def parse_query(text: str) -> tuple[Gpu, ...] | None:
    """``nvidia-smi --query-gpu=index,uuid,memory.free`` lines; None where one cannot be read."""
    gpus = []
    for line in text.strip().splitlines():
        try:
            index, uuid, free = (part.strip() for part in line.split(","))
            gpus.append(Gpu(int(index), uuid, int(float(free) * MiB)))
        except ValueError:
            return None
    return tuple(gpus)


def apply_visible(gpus: tuple[Gpu, ...], visible: str | None) -> tuple[Gpu, ...] | None:
    """What ``CUDA_VISIBLE_DEVICES`` leaves of ``gpus``: unset, all of them; else each entry in turn (an index,
    or a GPU's UUID or its prefix), stopping at the first that names none, as CUDA does. None for what only
    CUDA itself can resolve (MIG instances): the caller asks torch."""
    if visible is None:
        return gpus
    entries = [e.strip() for e in visible.split(",")]
    if any(e.startswith("MIG-") for e in entries):
        return None
    chosen: list[Gpu] = []
    for entry in entries:
        match = _named(gpus, entry)
        if match is None or match in chosen:
            break
        chosen.append(match)
    return tuple(chosen)


def _named(gpus: tuple[Gpu, ...], entry: str) -> Gpu | None:
    if entry.isdigit():
        return next((g for g in gpus if g.index == int(entry)), None)
    if entry.startswith("GPU-"):
        found = [g for g in gpus if g.uuid.startswith(entry)]
        return found[0] if len(found) == 1 else None
    return None
