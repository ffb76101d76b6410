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
    setup,
    shell,
    write_file,
)

__all__ = [
    "RankInfo",
    "cleanup",
    "device_map",
    "display",
    "getoutput",
    "is_local_main_process",
    "is_main_process",
    "main_process_first",
    "print0",
    "rank_info",
    "setup",
    "shell",
    "write_file",
]
