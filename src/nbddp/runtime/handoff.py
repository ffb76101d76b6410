"""What nbddp distributed for a notebook's plain loops, handed to Accelerate as the notebook made it.

Course-style notebooks train ``model`` over ``train_dataloader`` in plain loops, then hand the same loader
(or model) to ``accelerator.prepare``. nbddp gave the loops a ``DistributedSampler`` and a DDP wrapper;
Accelerate shards and wraps what it gets itself, so it must get neither: with nbddp's sampler under its own
each rank would read a shard of a shard. The converter puts ``_nbddp.for_accelerate`` around those
arguments (``convert/rules/accelerate_handoff.py``).
"""

from __future__ import annotations


def for_accelerate(obj):
    """``obj`` as the notebook made it: a DDP-wrapped model's module; a ``DataLoader`` over nbddp's
    ``DistributedSampler`` rebuilt with ``shuffle`` as that sampler had it; anything else as it is."""
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler

    from .loaders import rebuilt

    if isinstance(obj, DistributedDataParallel):
        return obj.module
    if type(obj) is DataLoader and isinstance(obj.sampler, DistributedSampler):
        return rebuilt(obj, shuffle=obj.sampler.shuffle)
    return obj
