"""Model loaders onto this rank's device: the rule and where it has work."""

from __future__ import annotations

import ast
import re

from .. import ast_helpers
from ..cst_helpers import (
    cst,
    dotted_name,
    fixed_expression,
    has_keyword,
    has_star_kwargs,
    is_attribute,
    last_name,
    set_keyword,
)
from ..engine.rule import Rule
from ..facts.shape import is_model_loader_owner

#: The runtime call that gives each rank its own device as a ``device_map``.
DEVICE_MAP_EXPR = "_nbddp.device_map()"


class DeviceMapRule(Rule):
    """Model loaders load onto this rank's device.

    ``from_pretrained`` with ``device_map="auto"``/``"balanced"``/``"sequential"`` splits one model over all
    GPUs; ``"cuda:0"``, ``{"": 0}`` or none at all put every rank's copy on GPU 0 (Unsloth's default is
    ``"sequential"``). Under DDP each rank holds a whole model on its own GPU, so every model loader gets
    ``device_map=_nbddp.device_map()`` (``{"": local_rank}``, or the CPU without GPUs): ``AutoModel*``,
    ``*ForCausalLM``, ``AutoPeftModel*``, ``PeftModel`` and Unsloth's ``Fast*Model``. Tokenizers,
    processors and configs are left alone. A call with ``**kwargs`` is left alone too (the key may be in them).
    transformers' ``pipeline(…, device_map="auto")`` (the form of many model cards) loads its model so too: its
    ``device_map`` becomes this rank's as well; a pipeline given none is placed by its ``device`` (the
    ``pipeline_device`` shim reads a GPU there as this rank's).
    """

    # -- where it has work: Python's ast, before libcst reads anything

    name = "device_map"
    keywords = frozenset({"device_map"})
    pattern = re.compile(r"(?:Model|For[A-Z])\w*\s*\.\s*from_pretrained|pipeline\s*\(")

    @classmethod
    def touches(cls, stmt, facts, nodes) -> bool:
        return any(
            isinstance(c.func, ast.Attribute) and c.func.attr == "from_pretrained"
            and is_model_loader_owner(ast_helpers.last_name(c.func.value))
            or ast_helpers.last_name(c.func) == "pipeline" and any(k.arg == "device_map" for k in c.keywords)
            for c in ast_helpers.calls(nodes)
        )

    # -- what it does: libcst

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.Call:
        if is_pipeline_with_device_map(updated):
            new, old = set_keyword(updated, "device_map", fixed_expression(DEVICE_MAP_EXPR))
            self.note(original, f"pipeline: device_map={old} → this rank's device")
            return new
        if not is_model_loader(updated):
            return updated
        loader = dotted_name(updated.func) or "from_pretrained"
        if has_star_kwargs(updated) and not has_keyword(updated, "device_map"):
            self.note(original, f"{loader}: has **kwargs, left alone; pass device_map=_nbddp.device_map() yourself")
            return updated
        new, old = set_keyword(updated, "device_map", fixed_expression(DEVICE_MAP_EXPR))
        was = f"device_map={old}" if old is not None else "no device_map"
        self.note(original, f"{loader}: {was} → this rank's device")
        return new


def is_model_loader(call: cst.Call) -> bool:
    """``X.from_pretrained(...)`` where X names a model class (``is_model_loader_owner``)."""
    return is_attribute(call.func, "from_pretrained") and is_model_loader_owner(last_name(call.func.value))


def is_pipeline_with_device_map(call: cst.Call) -> bool:
    """``pipeline(…, device_map=…)`` (transformers' factory, bare or as ``transformers.pipeline``)."""
    return last_name(call.func) == "pipeline" and has_keyword(call, "device_map")
