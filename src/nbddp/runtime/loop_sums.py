"""What a training loop over a sharded loader adds up (``trn_loss += loss.item() * n``), made the whole data
set's when the loop ends (``rules/loop_sums.py`` writes the calls).

Each rank's loop reads its share of the batches, so its sums are its share's: divided by ``len(dataset)`` they
gave half the epoch's loss on two ranks, and an early stop on them decided on rank 0's half. ``over_ranks`` adds
what each rank's loop added to where the sum stood before it (``before_loop``; one process's sum, in another
order: equal but for the last bits; a count kept across epochs is not counted again); with ``mean`` it averages
what they added instead, for a sum the notebook divides by a count of the rank's own (``len(train_loader)``, its
batches under a DistributedSampler), so the quotient is the whole set's mean. Every rank gets the same value, so
decisions made on it (early stopping, the best checkpoint) agree.
"""

from __future__ import annotations

import numbers


def before_loop(value):
    """Where a sum stands as its loop begins: a copy of a tensor (``+=`` adds to a tensor in place), else itself."""
    import torch

    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def over_ranks(value, since=0, mean: bool = False):
    """``since`` (the sum as the loop began, ``before_loop``) plus what every rank's loop added to it, summed (or
    averaged, ``mean``) over the ranks: a number, as its type (an int summed stays an int), or a tensor, on its
    device. Anything else, one process, or no process group: ``value`` as it is."""
    import torch
    import torch.distributed as dist

    from .dist import device

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return value
    world = dist.get_world_size()
    if isinstance(value, torch.Tensor):
        added = (value.detach() - since).to(device(), copy=True)
        dist.all_reduce(added)
        return (added / world if mean else added).to(value.device) + since
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not isinstance(since, numbers.Real):
        return value
    added = torch.tensor(float(value - since), dtype=torch.float64, device=device())
    dist.all_reduce(added)
    if mean:
        return since + added.item() / world
    if isinstance(value, numbers.Integral):
        return since + int(round(added.item()))
    return type(value)(since + added.item())


def before_meter(meter, summed):
    """Where a running-average object's sums stand as its loop begins (``AverageMeter``'s ``sum`` and ``count``):
    each attribute of ``summed`` as ``before_loop`` takes it; those it lacks are not there."""
    return {attr: before_loop(getattr(meter, attr)) for attr in summed if hasattr(meter, attr)}


def meter_over_ranks(meter, since: dict, derived=()) -> None:
    """The meter's sums made what one process's are (``over_ranks`` of each, from ``since``: ``before_meter``),
    then what ``update`` derives from them set again (``derived``: ``(avg, sum, count)`` for ``avg = sum / count``,
    where the count is not zero). Every rank makes the same calls in the same order."""
    for attr, start in since.items():
        setattr(meter, attr, over_ranks(getattr(meter, attr), since=start))
    for attr, num, den in derived:
        count = getattr(meter, den, 0)
        if attr in since or num not in since or den not in since or not count:
            continue
        setattr(meter, attr, getattr(meter, num) / count)
