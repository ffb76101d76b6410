"""Waiting for the other ranks where the notebook's own code needs it."""

from __future__ import annotations


def barrier() -> None:
    """Every rank waits here for the others (after rank 0 wrote files they read); alone, a no-op."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
