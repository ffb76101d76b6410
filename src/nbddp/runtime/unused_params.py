"""DDP's "Expected to have finished reduction" error, said with the parameters' names and the fix.

With ``find_unused_parameters=False`` DDP waits in each backward for a gradient of every trainable
parameter; a model that skips a layer in some step (LayerDrop, an unused head, a branch taken by the data)
leaves that wait unfinished, and the next forward raises a ``RuntimeError`` that lists parameter *indices*.
``DistributedDataParallel.forward`` is wrapped once: such an error is raised again as
``UnusedParameters``, naming the parameters (``module.named_parameters()`` in DDP's own order: trainable
ones, each once) and saying what to change. Any other error, and this one from a wrapper that looks for
unused parameters or has a static graph (its message is torch's to give), passes through untouched.
"""

from __future__ import annotations

import re

#: The start of torch's message.
MARKER = "Expected to have finished reduction in the prior iteration"
_INDICES = re.compile(r"Parameter indices which did not receive grad for rank (\d+): ([\d ]+)")


class UnusedParameters(RuntimeError):
    """Some trainable parameters got no gradient in a step and DDP was told every one would."""


def install() -> bool:
    """Wrap ``DistributedDataParallel.forward`` (once)."""
    from torch.nn.parallel import DistributedDataParallel

    from .patching import wrap

    return wrap(DistributedDataParallel, "forward", _explaining)


def _explaining(forward):
    def wrapper(self, *args, **kwargs):
        try:
            return forward(self, *args, **kwargs)
        except RuntimeError as exc:
            # only what find_unused_parameters=False causes; a static graph's errors are its own
            if MARKER not in str(exc) or getattr(self, "find_unused_parameters", False) or getattr(self, "static_graph", False):
                raise
            raise UnusedParameters(message(self.module, str(exc))) from exc

    return wrapper


def message(module, torch_message: str) -> str:
    """What went wrong, which parameters, and the fix, from torch's message and the wrapped module."""
    trainable = [name for name, p in module.named_parameters() if p.requires_grad]
    found = _INDICES.search(torch_message)
    names, rank = [], None
    if found:
        rank = found.group(1)
        names = [trainable[i] if i < len(trainable) else f"#{i}" for i in map(int, found.group(2).split())]
    shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
    said = f"these parameters got no gradient in the last step (rank {rank}): {shown}" if names else (
        "some parameters got no gradient in the last step")
    return (
        f"nbddp: DistributedDataParallel was told every trainable parameter takes part in each step "
        f"(find_unused_parameters=False), but {said}. The model skips them in some steps (LayerDrop, an unused "
        "head or branch). Fix: let DDP look for unused parameters: TrainingArguments(..., "
        "ddp_find_unused_parameters=True) for a Trainer, DistributedDataParallel(model, "
        "find_unused_parameters=True) for your own wrapper, NBDDP_FIND_UNUSED_PARAMETERS=1 (--env) for the wrapper "
        "nbddp puts on a plain loop; or freeze these parameters (requires_grad=False) "
        "if they are not meant to train."
    )
