"""What this job runs on: ranks, backend, device, seed, and each GPU with the precisions it supports.

``get_multi_gpu_config()`` builds a ``MultiGPUConfig`` from torchrun's environment and torch's device
properties; ``setup()`` prints its ``summary()`` once, on rank 0, as the run's first line(s).
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass

#: Native bfloat16 arithmetic starts with Ampere. Older GPUs (a T4 is 7.5) emulate it: torch may still
#: report bf16 as supported, but it runs slowly and some Triton kernels fail.
BF16_CAPABILITY = (8, 0)
#: Native float16 arithmetic (every GPU a notebook service lends has it).
FP16_CAPABILITY = (5, 3)


@dataclass(frozen=True)
class GPUInfo:
    """One visible GPU."""

    index: int
    name: str
    capability: tuple[int, int]
    memory_gib: float

    @property
    def bf16(self) -> bool:
        return self.capability >= BF16_CAPABILITY

    @property
    def fp16(self) -> bool:
        return self.capability >= FP16_CAPABILITY

    def describe(self) -> str:
        precisions = ", ".join(p for p, ok in (("fp16", self.fp16), ("bf16", self.bf16)) if ok) or "fp32 only"
        native = "" if self.bf16 else ", no native bf16"
        return f"{self.name} (sm {self.capability[0]}.{self.capability[1]}, {self.memory_gib:.1f} GiB): {precisions}{native}"


@dataclass(frozen=True)
class MultiGPUConfig:
    """The job as this rank sees it; ``gpus`` are the GPUs visible on this machine."""

    world_size: int
    rank: int
    local_rank: int
    local_world_size: int
    backend: str
    device: str
    seed: int | None
    gpus: tuple[GPUInfo, ...] = ()

    @property
    def nodes(self) -> int:
        return max(1, self.world_size // max(1, self.local_world_size))

    @property
    def bf16(self) -> bool:
        """Every GPU has native bf16 (False without GPUs)."""
        return bool(self.gpus) and all(g.bf16 for g in self.gpus)

    @property
    def fp16(self) -> bool:
        """Every GPU has native fp16 (False without GPUs)."""
        return bool(self.gpus) and all(g.fp16 for g in self.gpus)

    def summary(self) -> str:
        """A compact report: one line for the job, one per kind of GPU."""
        nodes = f" on {self.nodes} machines" if self.nodes > 1 else ""
        seed = f", seed {self.seed}" if self.seed is not None else ""
        head = f"nbddp: {self.world_size} process(es){nodes}, backend {self.backend}, rank 0 on {self.device}{seed}"
        if not self.gpus:
            return head + "; no GPU: fp32 only"
        kinds = Counter(g.describe() for g in self.gpus)
        return "\n".join([head] + [f"nbddp:   {n}× {text}" for text, n in kinds.items()])


def gpu_info(index: int, props) -> GPUInfo:
    """A ``GPUInfo`` from ``torch.cuda.get_device_properties(index)``."""
    return GPUInfo(index, props.name, (props.major, props.minor), props.total_memory / 2**30)


def get_multi_gpu_config(info=None, seed: int | None = None) -> MultiGPUConfig:
    """This job's configuration; ``info`` defaults to ``runtime.rank_info()``."""
    import torch

    from .dist import rank_info

    info = info or rank_info()
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return MultiGPUConfig(
        world_size=info.world_size,
        rank=info.rank,
        local_rank=info.local_rank,
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", info.world_size) or 1),
        backend=info.backend,
        device=info.device,
        seed=seed,
        gpus=tuple(gpu_info(i, torch.cuda.get_device_properties(i)) for i in range(count)),
    )
