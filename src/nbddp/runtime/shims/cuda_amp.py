"""Deprecated ``torch.cuda.amp`` names run as their ``torch.amp`` equivalents, without a FutureWarning.

Since torch 2.4, ``torch.cuda.amp.autocast(...)``, ``GradScaler(...)``, ``custom_fwd`` and ``custom_bwd``
warn on every use (``FutureWarning: torch.cuda.amp.autocast(args...) is deprecated``), once per rank, and
are due to be removed. Older notebooks, and libraries such as bitsandbytes and Unsloth at some releases,
still use them. The shim points those names at thin equivalents built on ``torch.amp`` with the device fixed
to ``"cuda"``: the same behaviour, no warning, and they keep working once torch drops the old names.
"""

from __future__ import annotations

import torch

NAME = "cuda_amp"

#: Where the old names live: the package and the modules it re-exports them from.
_MODULES = ("torch.cuda.amp", "torch.cuda.amp.autocast_mode", "torch.cuda.amp.grad_scaler")


class autocast(torch.amp.autocast):
    """``torch.cuda.amp.autocast(enabled, dtype, cache_enabled)`` as ``torch.amp.autocast("cuda", ...)``."""

    def __init__(self, enabled: bool = True, dtype: torch.dtype = torch.float16, cache_enabled: bool = True):
        super().__init__("cuda", enabled=enabled, dtype=dtype, cache_enabled=cache_enabled)


class GradScaler(torch.amp.GradScaler):
    """``torch.cuda.amp.GradScaler(...)`` as ``torch.amp.GradScaler("cuda", ...)``."""

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, enabled: bool = True):
        super().__init__("cuda", init_scale=init_scale, growth_factor=growth_factor,
                         backoff_factor=backoff_factor, growth_interval=growth_interval, enabled=enabled)


def custom_fwd(fwd=None, *, cast_inputs=None):
    """``torch.cuda.amp.custom_fwd`` as ``torch.amp.custom_fwd(..., device_type="cuda")``."""
    return torch.amp.custom_fwd(fwd, device_type="cuda", cast_inputs=cast_inputs)


def custom_bwd(bwd):
    """``torch.cuda.amp.custom_bwd`` as ``torch.amp.custom_bwd(..., device_type="cuda")``."""
    return torch.amp.custom_bwd(bwd, device_type="cuda")


REPLACEMENTS = {"autocast": autocast, "GradScaler": GradScaler, "custom_fwd": custom_fwd, "custom_bwd": custom_bwd}


def detect() -> bool:
    """Needed where torch marks ``torch.cuda.amp.autocast`` deprecated, or has removed it (not the package)."""
    try:
        import torch.cuda.amp as amp
    except ImportError:
        return False
    current = getattr(amp, "autocast", None)
    return current is None or (current is not autocast and hasattr(current, "__deprecated__"))


def apply() -> str:
    import importlib

    for module_name in _MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:  # a torch without this module: the package itself still gets the names
            continue
        for name, replacement in REPLACEMENTS.items():
            if module_name == _MODULES[0] or hasattr(module, name):
                setattr(module, name, replacement)
    return "torch.cuda.amp.autocast/GradScaler/custom_fwd/custom_bwd run as their torch.amp('cuda') forms"
