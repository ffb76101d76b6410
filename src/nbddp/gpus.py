"""This machine's NVIDIA GPUs as torch will see them, read from the driver with ``nvidia-smi`` (NVML).

Why not torch: the launcher only needs a count and each GPU's free memory before it starts torchrun, and
importing torch with CUDA then initialising it in a child process cost a fresh job about 15 s of its start on
an H100 (``benchmarks/results/job_overhead_gpu.md``); ``nvidia-smi`` answers in a fraction of a second.
``CUDA_VISIBLE_DEVICES`` is applied as CUDA applies it: indices or UUID prefixes, read up to the first entry that
names no GPU. Where ``nvidia-smi`` cannot answer (no NVIDIA driver tools, an AMD GPU), torch is asked.

A job reads the machine once (``read_machine``: the GPU count and each GPU's free memory, one ``Machine``),
and every decision of the job reads that record: the processes (``Machine.processes``), the strategy.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field

MiB = 2**20
GiB = 2**30
QUERY = ("nvidia-smi", "--query-gpu=index,uuid,memory.free", "--format=csv,noheader,nounits")

#: Overrides the GPU count (tests of the GPU checks on a CPU machine; choosing as on another machine).
GPU_COUNT_ENV = "NBDDP_GPU_COUNT"
#: Caps each GPU's free memory, in GiB, to choose as on a smaller GPU (a Kaggle T4's 15 GiB on a larger card).
GPU_MEMORY_ENV = "NBDDP_GPU_MEMORY_GIB"
#: A GPU driver's device files (NVIDIA's control device, AMD's ROCm, WSL's GPU): without any, torch sees no GPU.
GPU_DEVICE_FILES = ("/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd", "/dev/dxg")
#: Free bytes per GPU asked of torch in a child process, where ``nvidia-smi`` cannot say (this one never
#: initialises CUDA).
_TORCH_PROBE = ("import json, torch\n"
                "print(json.dumps([torch.cuda.mem_get_info(i)[0] for i in range(torch.cuda.device_count())]))")


@dataclass(frozen=True)
class Machine:
    """One reading of this machine, for one job: the GPUs torch sees (``CUDA_VISIBLE_DEVICES`` applied,
    ``NBDDP_GPU_COUNT`` where set) and each one's free bytes (capped by ``NBDDP_GPU_MEMORY_GIB``; ``()`` where
    there is none, where it was not asked, or where nothing could say). ``memory_read``: whether the free
    memory was looked for (a count-only reading that ``nvidia-smi`` answered has it too, at no cost)."""

    gpus: int
    free_bytes: tuple[int, ...] = ()
    memory_read: bool = field(default=True, compare=False)  # of the reading, not of the machine
    #: the machine the job runs on is this one (not so for the Kaggle export's accelerator): its host memory is
    #: the one CPU ranks are checked against
    here: bool = field(default=True, compare=False)

    def processes(self, requested: int | None = None) -> int:
        """How many processes a job starts: ``requested`` (``--nproc``), else one per GPU, else two (CPU, gloo).
        The one place this is decided."""
        return requested or self.gpus or 2


def has_gpu_driver() -> bool:
    """Whether a GPU driver's device file is here (``GPU_DEVICE_FILES``): without one, torch sees no GPU."""
    return any(os.path.exists(dev) for dev in GPU_DEVICE_FILES)


def read_machine(memory: bool = True, timeout_s: float = 60.0) -> Machine:
    """This machine's GPUs, asked once: ``nvidia-smi`` where it answers (a fraction of a second), else torch
    (the count through NVML, without a CUDA context; the free memory from a child process). ``memory=False``
    asks only the count. No GPU driver here: 0, with nothing asked."""
    forced = os.environ.get(GPU_COUNT_ENV, "").strip()
    if not forced.isdigit() and not has_gpu_driver():
        return Machine(0)  # importing torch (seconds, in every launcher) would only say 0
    visible = visible_gpus() if not forced.isdigit() or (memory and not _capped()) else None
    count = int(forced) if forced.isdigit() else len(visible) if visible is not None else _torch_count()
    if not count:
        return Machine(0)
    if not memory:  # what nvidia-smi said of the memory is kept: a later need of it asks nothing again
        return (Machine(count, cap_free(tuple(g.free_bytes for g in visible)[:count])) if visible is not None
                else Machine(count, memory_read=False))
    if visible is not None:
        free = tuple(g.free_bytes for g in visible)
    elif _capped() and forced.isdigit():
        free = (_cap(),) * count  # a machine stated whole: its count and each GPU's memory
    else:
        free = _torch_free(timeout_s)
    return Machine(count, cap_free(free[:count]))


def cap_free(free: tuple[int, ...]) -> tuple[int, ...]:
    """Each GPU's free bytes, no more than ``NBDDP_GPU_MEMORY_GIB`` where it is set."""
    return tuple(min(n, _cap()) for n in free) if _capped() else tuple(free)


def _capped() -> bool:
    return bool(os.environ.get(GPU_MEMORY_ENV, "").strip())


def _cap() -> int:
    return int(float(os.environ[GPU_MEMORY_ENV]) * GiB)


def _torch_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count()


def _torch_free(timeout_s: float) -> tuple[int, ...]:
    try:
        out = subprocess.run([sys.executable, "-c", _TORCH_PROBE], capture_output=True, text=True, timeout=timeout_s)
        return tuple(json.loads(out.stdout.strip().splitlines()[-1]))
    except (subprocess.SubprocessError, ValueError, IndexError, OSError):
        return ()


@dataclass(frozen=True)
class Gpu:
    index: int
    uuid: str
    free_bytes: int


def visible_gpus(timeout_s: float = 10.0) -> tuple[Gpu, ...] | None:
    """The GPUs a process started now would see, in its order; None where ``nvidia-smi`` cannot say."""
    text = query(timeout_s)
    gpus = None if text is None else parse_query(text)
    return None if gpus is None else apply_visible(gpus, os.environ.get("CUDA_VISIBLE_DEVICES"))


def query(timeout_s: float = 10.0) -> str | None:
    """What ``nvidia-smi`` says of every GPU (``QUERY``); None where it cannot be run or fails."""
    if shutil.which(QUERY[0]) is None:
        return None
    try:
        out = subprocess.run(QUERY, capture_output=True, text=True, timeout=timeout_s)
    except (subprocess.SubprocessError, OSError):
        return None
    return out.stdout if out.returncode == 0 else None


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
