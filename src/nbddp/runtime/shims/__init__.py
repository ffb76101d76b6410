"""Compatibility shims: one module per known incompatibility, applied inside every rank by ``setup()``.

Each shim module defines:

- ``NAME``: the module's own name; ``NBDDP_SHIM_<NAME>=0|1`` (upper case) forces it off or on, and
  ``nbddp run --no-shim NAME`` / ``--shim NAME`` set that variable for the ranks.
- ``detect() -> bool``: whether the problem can occur here (library present, settings that trigger it).
  A shim for a library that is not installed returns False and stays silent.
- ``apply() -> str | None``: repair it; returns the one plain-words line printed once, by rank 0.

``apply_all()`` runs them in ``SHIMS`` order and returns a ``ShimReport`` per shim.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

#: Shim modules in the order they are applied.
SHIMS: tuple[str, ...] = (
    "cuda_amp",
    "precision",
    "peft_kwargs",
    "xformers_bias",
    "pipeline_device",
    "unsloth",
    "no_checkpointing",  # gradient checkpointing: the escape hatch first,
    "grad_ckpt",  # then DDP × checkpointing
    "ddp_defaults",  # performance defaults that cannot change the result
    "loss_filter",  # the Trainer's per-step NaN check, without a host wait
    "token_average",  # the Trainer's loss × processes undone for a model that ignores the token count
)


@dataclass(frozen=True)
class ShimReport:
    name: str
    applied: bool
    reason: str  # "detected", "forced on", "forced off", "not needed", or "failed: …"
    message: str | None = None


def say(line: str) -> None:
    """Print ``nbddp: line`` once per process, on rank 0: what a shim changed, at the moment it changes it."""
    from .. import rank

    rank.say(f"nbddp: {line}", once=f"shims: {line}")


#: Older names that still switch a shim on, where its own ``NBDDP_SHIM_<NAME>`` is not given: the
#: record's field for each (``NBDDP_DISABLE_CHECKPOINTING=1`` is ``NBDDP_SHIM_NO_CHECKPOINTING=1``).
ALIASES = {"no_checkpointing": "disable_checkpointing"}


def switch(name: str) -> bool | None:
    """The user's switch for a shim: True (forced on), False (forced off) or None (decide by detection)."""
    from .. import settings

    record = settings.current()
    forced = record.switch(name)
    if forced is None and name in ALIASES and getattr(record, ALIASES[name]) is True:
        return True
    return forced


def load(module_name: str):
    return importlib.import_module(f"{__name__}.{module_name}")


def apply_all(log=print, names: tuple[str, ...] | None = None) -> list[ShimReport]:
    """Detect and apply every shim; ``log`` gets each shim's message once (pass a rank-0-only printer)."""
    reports = []
    for module_name in names if names is not None else SHIMS:
        shim = load(module_name)
        forced = switch(shim.NAME)
        if forced is False:
            reports.append(ShimReport(shim.NAME, False, "forced off"))
            continue
        try:
            needed = forced or shim.detect()
            if not needed:
                reports.append(ShimReport(shim.NAME, False, "not needed"))
                continue
            message = shim.apply()
        except Exception as exc:  # a shim must never stop training; say so and go on
            log(f"nbddp: shim {shim.NAME} could not be applied ({type(exc).__name__}: {exc}); continuing without it")
            reports.append(ShimReport(shim.NAME, False, f"failed: {exc}"))
            continue
        if message:
            log(f"nbddp: {message}")
        reports.append(ShimReport(shim.NAME, True, "forced on" if forced else "detected", message))
    return reports
