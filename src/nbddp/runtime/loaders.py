"""Training loaders nbddp could not see being built (a helper returned them), sharded when they run.

``train_loader = create_dataloader(ds, …)`` from an imported helper gives a plain ``DataLoader`` with a
``RandomSampler`` or ``SequentialSampler``; ``shard_loader`` builds the same loader over a
``DistributedSampler`` (same dataset, batch size, workers, collate function, drop_last …). A loader it
cannot rebuild (a custom sampler or batch sampler, an iterable dataset, a DataLoader subclass) is returned
as it is, with one line on rank 0 saying so.
"""

from __future__ import annotations

#: The DataLoader arguments a rebuilt loader takes over from the helper's.
_KEPT = ("batch_size", "num_workers", "collate_fn", "pin_memory", "drop_last", "timeout", "worker_init_fn",
         "multiprocessing_context", "generator", "prefetch_factor", "persistent_workers", "pin_memory_device",
         "in_order")


def shard_loader(loader, name: str = "loader", data_parallel: bool = False):
    """``loader`` over this rank's share of its dataset, or ``loader`` itself (said once) where it cannot be;
    ``data_parallel`` (the notebook calls DataParallel): its batch is the kernel's step, each rank takes its
    part (``data_parallel.data_parallel_batch``)."""
    from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler, SequentialSampler

    from .dist import distributed_sampler, print0, rank_info

    if rank_info().world_size < 2 or not isinstance(loader, DataLoader):
        return loader
    sampler = getattr(loader, "sampler", None)
    if isinstance(sampler, DistributedSampler):
        return loader
    plain = type(loader) is DataLoader and not isinstance(loader.dataset, IterableDataset) and loader.batch_size
    if not plain or type(sampler) not in (RandomSampler, SequentialSampler):
        print0(f"nbddp: warning: {name} comes from a helper and uses {type(sampler).__name__}: left as it is, "
               "so every rank reads all of it; give it sampler=_nbddp.distributed_sampler(dataset, shuffle=True)",
               flush=True)
        return loader
    shuffle = isinstance(sampler, RandomSampler)
    changes = {"sampler": distributed_sampler(loader.dataset, shuffle=shuffle)}
    if data_parallel:
        from .data_parallel import data_parallel_batch

        changes["batch_size"] = data_parallel_batch(loader.batch_size)
    return rebuilt(loader, **changes)


def rebuilt(loader, **changes):
    """A ``DataLoader`` over ``loader``'s dataset with its arguments (batch size, workers, collate function,
    drop_last …), ``changes`` put in (a sampler, or ``shuffle``)."""
    import inspect

    from torch.utils.data import DataLoader

    accepted = inspect.signature(DataLoader.__init__).parameters
    kept = {k: getattr(loader, k) for k in _KEPT if k in accepted and hasattr(loader, k) and k not in changes}
    if kept.get("prefetch_factor") is not None and not kept.get("num_workers"):
        kept.pop("prefetch_factor")
    return DataLoader(loader.dataset, **kept, **changes)


def shard_range(steps):
    """This rank's positions of a loop over batch positions (``range(0, len(X), bs)``): rank r of n takes
    positions r, r + n, r + 2n …, every rank as many (the last ``len % n`` are left out, so DDP's all-reduce
    never waits on a rank with a step fewer). Fewer positions than ranks, or not a ``range``: as given."""
    from .dist import rank_info

    info = rank_info()
    if info.world_size < 2 or not isinstance(steps, range) or len(steps) < info.world_size:
        return steps
    return steps[info.rank : len(steps) - len(steps) % info.world_size : info.world_size]


def shard_items(items):
    """This rank's samples of a sequence a training loop walks (a list, tuple, tensor, array or map-style
    Dataset): the positions ``shard_range`` takes. A DataLoader (sharded by its sampler), an iterator, or fewer
    samples than ranks: as given (the runtime's first-batches check says so if every rank then trains alike)."""
    from .dist import rank_info

    info = rank_info()
    if info.world_size < 2 or _not_a_sequence(items):
        return items
    try:
        count = len(items)
    except TypeError:
        return items
    if count < info.world_size:
        return items
    positions = shard_range(range(count))
    import torch

    if isinstance(items, (list, tuple, torch.Tensor)) or type(items).__module__.split(".")[0] == "numpy":
        return items[positions.start : positions.stop : positions.step]
    from torch.utils.data import Subset

    return Subset(items, list(positions))


def _not_a_sequence(items) -> bool:
    """What ``shard_items`` leaves as it is: loaders, iterators, mappings, strings, iterable datasets."""
    from collections.abc import Iterator, Mapping

    from torch.utils.data import DataLoader, IterableDataset

    sized = hasattr(items, "__len__") and hasattr(items, "__getitem__")
    return (not sized or isinstance(items, (DataLoader, IterableDataset, Iterator, Mapping, str, bytes))
            or hasattr(items, "column_names") or hasattr(items, "iloc"))  # HF datasets, DataFrames: columns first


def whole_loader(loader):
    """A training loader over its whole data set again, for rank 0's code after training (a metric computed on
    ``train_loader`` counts every sample, as in the kernel): the loader rebuilt with the shuffle its
    ``DistributedSampler`` had. Any other loader as it is."""
    from torch.utils.data import DataLoader, DistributedSampler

    sampler = getattr(loader, "sampler", None)
    if not isinstance(loader, DataLoader) or not isinstance(sampler, DistributedSampler):
        return loader
    return rebuilt(loader, shuffle=bool(getattr(sampler, "shuffle", False)))
