"""A notebook's ``nn.DataParallel`` in a rank: DDP over the ranks, and what rank 0 gets back after training.

The converter writes ``_nbddp.data_parallel(model, …)`` where the notebook calls ``nn.DataParallel(model, …)``
(``convert/rules/data_parallel.py``). Nothing here imports IPython, nbformat or libcst.
"""

from __future__ import annotations

from .dist import UNWRAPPED, ddp, device


def data_parallel(module, *args, **kwargs):
    """``nn.DataParallel(module, …)`` as a rank runs it: DistributedDataParallel over the ranks, one GPU each.

    DataParallel splits each batch over every GPU the process sees, which in a rank are the other ranks'
    GPUs too; DDP does the same work across the ranks. Its wrapper has ``.module`` and ``module.``-prefixed
    state-dict keys, as DataParallel's. The model goes to this rank's device first (DataParallel kept it on
    its first GPU, wherever the notebook had it). A single process (no process group: ``split``, plain
    ``python``) gets the notebook's own DataParallel, which may use every GPU there.
    """
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return torch.nn.DataParallel(module, *args, **kwargs)
    from torch.nn.parallel import DistributedDataParallel

    module.to(device())
    wrapped = ddp(module)
    if isinstance(wrapped, DistributedDataParallel):  # not FSDP's sharded module (NBDDP_STRATEGY=fsdp)
        wrapped.__dict__[UNWRAPPED] = lambda: as_the_notebook_had_it(wrapped)
    return wrapped


def data_parallel_batch(size):
    """A training loader's ``batch_size`` in a notebook that calls DataParallel: this rank's part of the step.

    DataParallel split each batch of ``size`` over the kernel's GPUs (``ceil(size / n)`` on the first ones);
    the ranks do that work, so each takes ``ceil(size / world)`` and a step holds the kernel's ``size`` samples
    (one more per rank short where ``size`` does not divide: every rank must take as many steps, said once).
    One process, or a size that is not a positive whole number: ``size`` as given."""
    import math

    from .dist import print0, rank_info

    world = rank_info().world_size
    if world < 2 or not isinstance(size, int) or isinstance(size, bool) or size < 1:
        return size
    part = math.ceil(size / world)
    if part * world != size and size not in _said_uneven:
        _said_uneven.add(size)
        print0(f"nbddp: batch_size {size} (the step DataParallel split over the GPUs) does not divide over {world} "
               f"ranks: each takes {part}, a step of {part * world} samples", flush=True)
    return part


_said_uneven: set[int] = set()


def device_count() -> int:
    """The GPUs this rank uses, for the notebook's own ``torch.cuda.device_count()`` (``rules/device_count.py``).

    1 in a rank of a process group with GPUs: it trains on its own one, and work the kernel sized for every
    GPU of one process (``32 * device_count()``) is that rank's share. A single process (``split``, plain
    ``python``) uses every GPU it sees, and without CUDA torch's 0 stays."""
    import torch
    import torch.distributed as dist

    count = torch.cuda.device_count()
    return min(count, 1) if dist.is_available() and dist.is_initialized() else count


def as_the_notebook_had_it(model):
    """Rank 0's model after training, for a DataParallel the notebook made: a one-GPU DataParallel around the
    module DDP trained (no collective in its forward; ``.module`` and the ``module.`` keys as in the kernel)."""
    import torch

    here = device()
    ids = [here.index or 0] if here.type == "cuda" else None
    return torch.nn.DataParallel(model.module, device_ids=ids)
