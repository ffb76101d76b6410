"""Accelerate after plain loops: ``accelerator.prepare`` gets what nbddp distributed as the notebook made it:
the rule and where it has work."""

from __future__ import annotations

import ast
import re

from .. import ast_helpers
from ..cst_helpers import cst, is_attribute, is_name, wrap_named_arguments
from ..engine.rule import Rule


class AccelerateHandoffRule(Rule):
    """``accelerator.prepare(train_dataloader, model, …)`` after plain loops trained them: each such argument
    goes through ``_nbddp.for_accelerate``.

    The plain loops before are nbddp's: ``train_dataloader`` has a ``DistributedSampler`` and ``model`` a DDP
    wrapper. Accelerate shards and wraps what ``prepare`` gets itself; given nbddp's loader it would shard
    the shard (each rank reading a quarter on two ranks), given the wrapper it would wrap it again. So
    ``prepare`` gets the loader rebuilt without nbddp's sampler and the model inside the wrapper
    (``facts.handed_to_accelerate``: what the loops trained is the object ``prepare`` gets).
    """

    # -- where it has work: Python's ast, before libcst reads anything

    name = "accelerate"
    pattern = re.compile(r"\.prepare\s*\(")

    @classmethod
    def wanted(cls, cell, facts) -> bool:
        return bool(facts.handed_to_accelerate) and super().wanted(cell, facts)

    @classmethod
    def touches(cls, stmt, facts, nodes) -> bool:
        return any(cls._handed(call, facts) for call in ast_helpers.calls(nodes))

    @staticmethod
    def _handed(call: ast.Call, facts) -> list[str]:
        func = call.func
        if isinstance(func, ast.Attribute) and func.attr == "prepare" and isinstance(func.value, ast.Name) \
                and func.value.id in facts.accelerators:
            return [a.id for a in call.args if isinstance(a, ast.Name) and a.id in facts.handed_to_accelerate]
        return []

    # -- what it does: libcst

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.Call:
        func = updated.func
        if not (is_attribute(func, "prepare") and is_name(func.value) and func.value.value in self.facts.accelerators):
            return updated
        updated, handed = wrap_named_arguments(updated, self.facts.handed_to_accelerate, "_nbddp.for_accelerate")
        for name in handed:
            self.note(original, f"{name} goes to Accelerate as the notebook made it (no nbddp DistributedSampler "
                                "or DDP wrapper): Accelerate distributes it itself; the plain loops above are nbddp's")
        return updated
