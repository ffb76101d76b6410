"""xformers' block-diagonal attention bias follows the query to its device.

When one process splits a model over several GPUs (``device_map="auto"``/``"balanced"``), the attention
bias is built once, on the first layer's device, and reused by layers on other GPUs. xformers 0.0.27 and
later check this in ``Inputs.validate_inputs`` (``xformers.ops.fmha.common``) and raise "Attention bias and
Query/Key/Value should be on the same device". The shim moves the tensors inside the bias (its
``q_seqinfo``/``k_seqinfo`` and any other tensor field) to the query's device just before that check, and
keeps the bias' own class: ``bias.to(device)`` is not used because in older xformers
``BlockDiagonalCausalMask.to`` is inherited from ``BlockDiagonalMask`` and returns a non-causal mask.
"""

from __future__ import annotations

import copy
import dataclasses

import torch

from ..patching import installed, wrap, when_imported

NAME = "xformers_bias"


def detect() -> bool:
    return installed("xformers")


def apply() -> str:
    when_imported("xformers.ops.fmha.common", patch)
    return "xformers: attention biases move to their query's device (models split over GPUs)"


def patch(module) -> bool:
    """Wrap ``Inputs.validate_inputs`` in ``module`` (``xformers.ops.fmha.common``)."""
    return wrap(module.Inputs, "validate_inputs", _bias_on_query_device)


def _bias_on_query_device(validate_inputs):
    def wrapper(self, *args, **kwargs):
        bias = self.attn_bias  # a tensor-like bias (LowerTriangularMask, dense tensor) is not ours to move
        if dataclasses.is_dataclass(bias) and not isinstance(bias, (type, torch.Tensor)):
            self.attn_bias = on_device(bias, self.query.device)
        return validate_inputs(self, *args, **kwargs)

    return wrapper


def on_device(obj, device):
    """``obj`` with every tensor in it, through nested dataclass fields, on ``device``; same classes.

    Returns ``obj`` itself when nothing had to move, else a shallow copy with the moved fields.
    """
    if isinstance(obj, torch.Tensor):
        return obj if obj.device == device else obj.to(device)
    if not (dataclasses.is_dataclass(obj) and not isinstance(obj, type)):
        return obj
    moved = {}
    for field in dataclasses.fields(obj):
        value = getattr(obj, field.name, None)
        new = on_device(value, device)
        if new is not value:
            moved[field.name] = new
    if not moved:
        return obj
    clone = copy.copy(obj)
    for name, value in moved.items():
        object.__setattr__(clone, name, value)  # also for frozen dataclasses
    return clone
