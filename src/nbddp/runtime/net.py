"""What the safety net's checks share (``divergence``, ``same_batches``): the tensors a batch holds, the device
their collectives run on, and the notebook's cell and line of the running script."""

from __future__ import annotations

import os
import sys


def collective_device():
    """Where a tensor for a collective lives: this rank's GPU under NCCL, else the CPU."""
    import torch
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def tensors(obj):
    """The tensors in a batch: a tensor, or inside dicts, lists, tuples and mappings (``BatchEncoding``)."""
    import torch

    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from tensors(v)
    elif hasattr(obj, "keys") and hasattr(obj, "__getitem__"):  # BatchEncoding and the like
        for k in obj.keys():
            yield from tensors(obj[k])


def script_place() -> str | None:
    """The notebook's cell and line of the innermost frame of the running script (via its source map)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if not path:
        return None
    path = os.path.abspath(path)
    frame = sys._getframe(1)
    while frame is not None and os.path.abspath(frame.f_code.co_filename) != path:
        frame = frame.f_back
    if frame is None:
        return None
    line = frame.f_lineno
    from .sourcemap import read_source_map

    smap = read_source_map(path)
    hit = smap.lookup(line) if smap else None
    return f"cell {hit[0]}, line {hit[1]}" if hit else f"{os.path.basename(path)}, line {line}"
