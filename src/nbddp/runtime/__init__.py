"""What the generated script imports in every rank. Nothing here imports IPython, nbformat or libcst."""

from .dist import (
    RankInfo,
    cleanup,
    device_map,
    display,
    getoutput,
    is_local_main_process,
    is_main_process,
    main_process_first,
    print0,
    rank_info,
    seed_everything,
    setup,
    shell,
    write_file,
)
from .report import GPUInfo, MultiGPUConfig, get_multi_gpu_config

__all__ = [
    "GPUInfo",
    "MultiGPUConfig",
    "RankInfo",
    "cleanup",
    "device_map",
    "display",
    "get_multi_gpu_config",
    "getoutput",
    "is_local_main_process",
    "is_main_process",
    "main_process_first",
    "print0",
    "rank_info",
    "seed_everything",
    "setup",
    "shell",
    "write_file",
]
