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


def shard_loader(loader, name: str = "loader"):
    """``loader`` over this rank's share of its dataset, or ``loader`` itself (said once) where it cannot be."""
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
    return rebuilt(loader, sampler=distributed_sampler(loader.dataset, shuffle=shuffle))


def rebuilt(loader, **changes):
    """A ``DataLoader`` over ``loader``'s dataset with its arguments (batch size, workers, collate function,
    drop_last …), ``changes`` put in (a sampler, or ``shuffle``)."""
    import inspect

    from torch.utils.data import DataLoader

    accepted = inspect.signature(DataLoader.__init__).parameters
    kept = {k: getattr(loader, k) for k in _KEPT if k in accepted and hasattr(loader, k)}
    if kept.get("prefetch_factor") is not None and not kept.get("num_workers"):
        kept.pop("prefetch_factor")
    return DataLoader(loader.dataset, **kept, **changes)
