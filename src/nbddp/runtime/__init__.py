"""What the generated script imports in every rank. Nothing here imports IPython, nbformat or libcst."""

from .dist import (
    RankInfo,
    cleanup,
    ddp,
    device,
    device_map,
    distributed_sampler,
    display,
    getoutput,
    is_local_main_process,
    is_main_process,
    main_process_first,
    print0,
    rank_info,
    seed_everything,
    set_epoch,
    setup,
    shell,
    unwrap,
    write_file,
)
from .loaders import shard_loader
from .sync import barrier
from .report import GPUInfo, MultiGPUConfig, get_multi_gpu_config

__all__ = [
    "GPUInfo",
    "MultiGPUConfig",
    "RankInfo",
    "barrier",
    "cleanup",
    "ddp",
    "device",
    "device_map",
    "distributed_sampler",
    "display",
    "get_multi_gpu_config",
    "getoutput",
    "is_local_main_process",
    "is_main_process",
    "main_process_first",
    "print0",
    "rank_info",
    "seed_everything",
    "set_epoch",
    "shard_loader",
    "setup",
    "shell",
    "unwrap",
    "write_file",
]
