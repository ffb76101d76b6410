"""Unsloth under DDP: each rank loads the whole model onto its own GPU.

Unsloth's loaders (``FastLanguageModel``, ``FastModel``, ``FastVisionModel``) default to
``device_map="sequential"``, which under torchrun puts every rank's copy on the first GPU (or splits it
over all of them). Recent Unsloth releases correct this only for quantized loads and only from a string
map, and take the *global* rank as the GPU index once the process group is up, which is wrong on a second
machine. The shim gives each loader this rank's map (``nbddp.runtime.device_map()``, built from
``LOCAL_RANK``) when the notebook passed none or a planner name (``auto``, ``sequential``, …), and only when more than one process trains;
an explicit map (a dict, a device) is kept. Unsloth is patched after the notebook imports it (it must come before
transformers, TRL and PEFT, so nbddp never imports it first), and nbddp never sets Unsloth's own
``UNSLOTH_*`` variables: the notebook's choices reach every rank unchanged through torchrun's environment.
"""

from __future__ import annotations

import inspect

from ..patching import installed, wrap, when_imported

NAME = "unsloth"

#: The loader classes whose ``from_pretrained`` gets the rank's device map, where Unsloth has them.
LOADERS = ("FastLanguageModel", "FastModel", "FastVisionModel", "FastTextModel")

#: Device maps that ask accelerate to plan a split over every visible GPU: replaced under DDP.
PLANNERS = ("auto", "balanced", "balanced_low_0", "sequential")


def detect() -> bool:
    return installed("unsloth")


def apply() -> str:
    when_imported("unsloth", patch)
    return "Unsloth: its loaders put the whole model on this rank's GPU unless given a device map"


def patch(unsloth) -> int:
    """Wrap ``from_pretrained`` of each Unsloth loader class; returns how many were wrapped now."""
    loaders = [getattr(unsloth, name) for name in LOADERS if hasattr(getattr(unsloth, name, None), "from_pretrained")]
    return sum(wrap(cls, "from_pretrained", _rank_device_map) for cls in loaders)


def _rank_device_map(from_pretrained):
    signature = inspect.signature(from_pretrained)
    named = "device_map" in signature.parameters

    def wrapper(*args, **kwargs):
        from .. import dist

        if dist.rank_info().world_size > 1:
            bound = signature.bind_partial(*args, **kwargs)
            given = bound.arguments.get("device_map") if named else kwargs.get("device_map")
            if given is None or (isinstance(given, str) and given in PLANNERS):
                if named:
                    bound.arguments["device_map"] = dist.device_map()
                    args, kwargs = bound.args, bound.kwargs
                else:
                    kwargs["device_map"] = dist.device_map()
        return from_pretrained(*args, **kwargs)

    return wrapper
