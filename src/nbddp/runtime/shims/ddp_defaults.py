"""Performance defaults for every DDP wrapper, where they cannot change the result.

Measured on two H200s with a 1.1B Llama LoRA fine-tune (``benchmarks/results/``): on NVLink DDP costs little,
and two settings each bought a few per cent of throughput without changing the arithmetic:

- ``gradient_as_bucket_view=True``: gradients live in DDP's communication buckets instead of being copied
  into them after every backward (one copy of all trainable gradients saved per step, and their memory).
- ``broadcast_buffers=False`` when no buffer changes during training: DDP otherwise broadcasts every buffer
  from rank 0 at each forward, a collective that waits for rank 0. Language models' only buffers are
  constants (rotary ``inv_freq``, causal masks); a model with BatchNorm running statistics keeps the
  broadcast, since that is what keeps its statistics the same on every rank.

Arguments the caller wrote out (``TrainingArguments.ddp_broadcast_buffers``, a hand-written
``DistributedDataParallel(..., broadcast_buffers=True)``) are kept. Not defaulted: ``static_graph`` (fails
when the parameters used vary between steps; the checkpointing shim decides it), compressed communication
hooks (no gain measured for LoRA gradients, and they change the numbers).
"""

from __future__ import annotations

from .. import ddp_patch

NAME = "ddp_defaults"

_CHANGING_BUFFERS = ("running_mean", "running_var", "num_batches_tracked")


def detect() -> bool:
    """Always: any script may build a DDP wrapper."""
    return True


def apply() -> str:
    ddp_patch.register_adjuster(NAME, adjust)
    return "DDP defaults: gradient_as_bucket_view on; buffers broadcast only where training changes them"


def buffers_change(module) -> bool:
    """Whether training updates any of the module's buffers (BatchNorm-style running statistics)."""
    return any(name.rsplit(".", 1)[-1] in _CHANGING_BUFFERS for name, _ in module.named_buffers())


def adjust(module, kwargs: dict) -> dict:
    if not ddp_patch.caller_passed("gradient_as_bucket_view"):
        kwargs["gradient_as_bucket_view"] = True
    caller_chose = ddp_patch.caller_passed("broadcast_buffers") or ddp_patch.caller_passed("forward_sync_buffers")
    if not caller_chose and not buffers_change(module):
        # torch ≥ 2.13 names it forward_sync_buffers and warns for broadcast_buffers; earlier torch has only the latter
        kwargs["forward_sync_buffers" if "forward_sync_buffers" in kwargs else "broadcast_buffers"] = False
    return kwargs
