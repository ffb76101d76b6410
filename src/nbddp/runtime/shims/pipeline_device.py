"""A transformers pipeline goes to this rank's GPU, as the notebook's went to its GPU in the kernel.

Once a process group is up, transformers' ``Pipeline.__init__`` drops its ``device`` argument and takes the
model's device instead (``if _is_torch_distributed_initialized(): self.device = self.model.device``, meant for
models split by tensor parallelism; transformers 5.17 and 5.24 do this). In a rank,
``pipeline("text-classification", model="…", device=0)`` or ``pipeline(…, model=model)`` over a model still on the
CPU then predicts on the CPU, where the kernel predicted on GPU 0: slower by the GPU's factor and with other
floating-point results, said nowhere (seen on two H200s: both ranks' pipelines on ``cpu``).

The shim makes the pipeline choose its device as one process would, with "the GPU" read as this rank's, as the
device rule reads an explicit GPU in the code: ``device=N``, ``"cuda"``, ``"cuda:N"``, ``torch.device("cuda", N)``
and no device at all (one process's pipeline takes GPU 0) give this rank's GPU. A CPU device, a model spread over
devices by accelerate (``hf_device_map``, which the pipeline never moves) and a process without a process group are
left to transformers.
"""

from __future__ import annotations

import contextlib
import inspect
import sys

from ..patching import installed, wrap, when_imported
from . import say

NAME = "pipeline_device"
MODULE = "transformers.pipelines.base"
#: transformers' own test for a process group, which ``Pipeline.__init__`` reads to drop its ``device``.
GROUP_CHECK = "_is_torch_distributed_initialized"


def detect() -> bool:
    return installed("transformers")


def apply() -> None:
    when_imported(MODULE, patch)
    return None  # said when it moves a pipeline, not for every job that has transformers


def patch(module) -> bool:
    return wrap(module.Pipeline, "__init__", _as_in_one_process)


def _as_in_one_process(init):
    signature = inspect.signature(init)

    def __init__(self, *args, **kwargs):
        module = sys.modules[MODULE]
        if not _in_process_group() or not hasattr(module, GROUP_CHECK):
            return init(self, *args, **kwargs)
        bound = signature.bind(self, *args, **kwargs)
        model = bound.arguments.get("model")
        device = bound.arguments.get("device")
        wanted = rank_device(device, model, _local_rank(), _cuda())
        if wanted is not device:
            bound.arguments["device"] = wanted
        before = getattr(model, "device", None)
        with _no_group_seen(module):
            init(*bound.args, **bound.kwargs)
        if before is not None and str(getattr(self, "device", before)) != str(before):
            say("a transformers pipeline runs on this rank's own device, as the notebook's ran on the device it "
                "named in one process (under DDP transformers would have kept it on its model's device)")

    return __init__


def rank_device(device, model, local_rank: int, cuda: bool):
    """The ``device`` to give ``Pipeline.__init__`` in this rank: the rank's GPU where one process's pipeline would
    take a GPU (``device`` None without an accelerate map, a GPU ordinal, ``"cuda"``/``"cuda:N"``, a CUDA
    ``torch.device``), else ``device`` itself (a CPU, another kind of device; no CUDA here)."""
    if not cuda:
        return device
    if device is None:
        return device if getattr(model, "hf_device_map", None) is not None else local_rank
    if isinstance(device, bool):
        return device
    if isinstance(device, int):
        return local_rank if device >= 0 else device
    kind = device.type if hasattr(device, "type") else str(device).split(":", 1)[0]
    return f"cuda:{local_rank}" if kind == "cuda" else device


@contextlib.contextmanager
def _no_group_seen(module):
    """``Pipeline.__init__`` deciding its device as in a process without a process group."""
    check = getattr(module, GROUP_CHECK)
    setattr(module, GROUP_CHECK, lambda: False)
    try:
        yield
    finally:
        setattr(module, GROUP_CHECK, check)


def _in_process_group() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _local_rank() -> int:
    from ..rank import rank_info

    return rank_info().local_rank


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()
