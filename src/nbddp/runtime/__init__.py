"""What the generated script imports in every rank. Nothing here imports IPython, nbformat or libcst."""

from .dist import (
    RankInfo,
    barrier,
    ddp,
    device,
    device_map,
    distributed_sampler,
    is_local_main_process,
    is_main_process,
    main_process_first,
    on_rank0,
    print0,
    rank0_mode,
    rank0_only,
    rank_info,
    seed_everything,
    set_epoch,
    unwrap,
)
from .data_parallel import data_parallel, data_parallel_batch, device_count
from .from_rank0 import from_rank0
from .handoff import for_accelerate
from .lifecycle import cleanup, setup
from .loaders import shard_items, shard_loader, shard_range, whole_loader
from .loop_sums import before_loop, before_meter, meter_over_ranks, over_ranks
from .rich import display
from .shell_lines import cd, expand, getoutput, shell, shell_cell, write_file
from .report import GPUInfo, MultiGPUConfig, get_multi_gpu_config

__all__ = [
    "GPUInfo",
    "MultiGPUConfig",
    "RankInfo",
    "barrier",
    "before_loop",
    "before_meter",
    "cd",
    "cleanup",
    "data_parallel",
    "data_parallel_batch",
    "ddp",
    "device",
    "device_count",
    "device_map",
    "distributed_sampler",
    "display",
    "expand",
    "for_accelerate",
    "from_rank0",
    "get_multi_gpu_config",
    "getoutput",
    "is_local_main_process",
    "is_main_process",
    "main_process_first",
    "on_rank0",
    "meter_over_ranks",
    "over_ranks",
    "print0",
    "rank0_mode",
    "rank0_only",
    "rank_info",
    "seed_everything",
    "set_epoch",
    "shard_items",
    "shard_loader",
    "shard_range",
    "setup",
    "shell",
    "shell_cell",
    "unwrap",
    "whole_loader",
    "write_file",
]
