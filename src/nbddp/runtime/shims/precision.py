"""Mixed precision the rank's device really has: fp16 on GPUs without native bf16, fp32 on CPU.

TRL's configs default to ``bf16=True`` (``SFTConfig``, ``GRPOConfig``, … unless ``fp16`` is set). On a GPU
without native bf16 (compute capability below 8.0: T4, V100, P100) torch still reports bf16 as supported,
through emulation (``torch.cuda.is_bf16_supported(including_emulation=True)``), so training runs silently
slow or Triton kernels fail to compile. On CPU, transformers refuses the default outright: "Your setup
doesn't support bf16/gpu". The shim wraps ``TrainingArguments.__post_init__`` (every TRL config inherits
it) and, before transformers validates the settings, replaces bf16 with fp16 on such GPUs and turns both off
on CPU, saying so once. ``decide()`` holds the rule as a pure function of the device's properties.
"""

from __future__ import annotations


from dataclasses import dataclass

from .. import settings
from ..patching import installed, wrap, when_imported
from . import say

NAME = "precision"

#: The first compute capability with native bf16 (Ampere).
NATIVE_BF16 = (8, 0)


@dataclass(frozen=True)
class Device:
    """What precision depends on: the device's kind (``"cuda"``, ``"cpu"``, …), name and capability."""

    kind: str
    name: str
    major: int = 0
    minor: int = 0

    @property
    def label(self) -> str:
        return f"{self.name} (compute capability {self.major}.{self.minor})" if self.kind == "cuda" else self.name


@dataclass(frozen=True)
class Precision:
    """The mixed-precision flags to train with, and why they differ from what was asked (None: unchanged)."""

    bf16: bool
    fp16: bool
    reason: str | None = None


def decide(device: Device, bf16: bool, fp16: bool) -> Precision:
    """The flags to use on ``device`` for the requested ``bf16``/``fp16``."""
    if device.kind == "cpu" and (bf16 or fp16):
        return Precision(False, False, "no GPU: fp16/bf16 turned off, training in fp32")
    if device.kind == "cuda" and bf16 and (device.major, device.minor) < NATIVE_BF16:
        return Precision(False, True, f"{device.label} has no native bf16 (torch would emulate it): fp16 instead")
    return Precision(bool(bf16), bool(fp16))


def current_device(use_cpu: bool = False) -> Device:
    """This rank's device, as the runtime chose it (``use_cpu``: the training arguments asked for CPU)."""
    import torch

    from ..dist import rank_info

    info = rank_info()
    if use_cpu or not info.device.startswith("cuda"):
        return Device("cpu", "CPU")
    props = torch.cuda.get_device_properties(info.local_rank)
    assumed = assumed_capability()
    if assumed:  # rehearse another GPU's precision rules, e.g. a Kaggle T4 (7.5) on a newer card
        return Device("cuda", f"{props.name} as if compute capability {assumed[0]}.{assumed[1]}", *assumed)
    return Device("cuda", props.name, props.major, props.minor)


def assumed_capability() -> tuple[int, int] | None:
    """``NBDDP_ASSUME_CC=7.5``: decide precision as on a GPU of that compute capability (None when unset)."""
    value = (settings.current().assume_cc or "").strip()  # NBDDP_ASSUME_CC
    if not value:
        return None
    major, _, minor = value.partition(".")
    try:
        return int(major), int(minor or 0)
    except ValueError:
        raise ValueError(f"NBDDP_ASSUME_CC must look like 7.5, not {value!r}") from None


def detect() -> bool:
    """Needed where TRL's default would be changed: transformers present and a CPU or a pre-Ampere GPU."""
    return installed("transformers") and _default_change(current_device()) is not None


def apply() -> str:
    when_imported("transformers.training_args", patch)
    device = current_device()
    reason = _default_change(device) or "mixed precision as requested"
    return f"precision on {device.label}: {reason}; training arguments that ask otherwise are adjusted"


def _default_change(device: Device) -> str | None:
    """Why TRL's default (bf16 on) would be changed on ``device``; None where it is right."""
    return decide(device, bf16=True, fp16=False).reason


def patch(module) -> bool:
    """Wrap ``TrainingArguments.__post_init__`` in ``module`` (``transformers.training_args``)."""
    return wrap(module.TrainingArguments, "__post_init__", _adjusting_precision)


def _adjusting_precision(post_init):
    def __post_init__(self, *args, **kwargs):
        device = current_device(use_cpu=bool(getattr(self, "use_cpu", False)))
        for train, half in (("bf16", "fp16"), ("bf16_full_eval", "fp16_full_eval")):
            if not hasattr(self, train):
                continue
            choice = decide(device, bool(getattr(self, train)), bool(getattr(self, half)))
            if choice.reason:
                setattr(self, train, choice.bf16)
                setattr(self, half, choice.fp16)
                say(f"{type(self).__name__}: {choice.reason} ({train}={choice.bf16}, {half}={choice.fp16})")
        return post_init(self, *args, **kwargs)

    return __post_init__
