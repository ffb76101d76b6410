"""Plain PyTorch: saving and loading a DDP-wrapped model goes through the module inside: the rule and where it
has work."""

from __future__ import annotations

import ast
import re

from .. import ast_helpers
from ..cst_helpers import cst, is_attribute, is_name
from ..engine.rule import Rule
from ..facts.loaders import call_place


class UnwrapRule(Rule):
    """Plain PyTorch: saving and loading a DDP-wrapped model goes through ``_nbddp.unwrap(model)``.

    ``DistributedDataParallel`` prefixes every state-dict key with ``module.``; a checkpoint saved from the
    wrapper would not load into the notebook's plain model (and ``torch.save(model)`` would pickle the
    wrapper). ``model.state_dict()``, ``model.load_state_dict(…)`` and ``torch.save(model, …)`` use the
    module inside. Which ``torch.save`` calls pickle such a model is the facts' answer, by place
    (``JobFacts.model_saves``), which the FSDP refusal reads too.
    """

    # -- where it has work: Python's ast, before libcst reads anything

    name = "unwrap"
    pattern = re.compile(r"state_dict|torch\.save")

    @classmethod
    def wanted(cls, cell, facts) -> bool:
        return facts.plain_loop and bool(facts.wrapped_whole) and super().wanted(cell, facts)

    @classmethod
    def touches(cls, stmt, facts, nodes) -> bool:
        models = facts.wrapped_whole
        for call in ast_helpers.calls(nodes):
            func = call.func
            if isinstance(func, ast.Attribute) and func.attr in ("state_dict", "load_state_dict"):
                if isinstance(func.value, ast.Name) and func.value.id in models:
                    return True
            elif call_place(stmt, call) in facts.model_saves:
                return True
        return False

    # -- what it does: libcst

    def _unwrapped(self, name: cst.Name) -> cst.Call:
        return cst.parse_expression(f"_nbddp.unwrap({name.value})")

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.Call:
        models = self.facts.wrapped_whole
        func = updated.func
        if is_attribute(func, "state_dict", "load_state_dict") and is_name(func.value) and func.value.value in models:
            self.note(original, f"{func.value.value}.{func.attr.value}: the module inside DDP")
            return updated.with_changes(func=func.with_changes(value=self._unwrapped(func.value)))
        if original in self.chunk.model_saves and (saved := self._saved_object(updated)) is not None:
            index, name = saved
            self.note(original, f"torch.save({name}): the module inside DDP")
            args = list(updated.args)
            args[index] = args[index].with_changes(value=self._unwrapped(args[index].value))
            return updated.with_changes(args=args)
        return updated

    def _saved_object(self, call: cst.Call) -> tuple[int, str] | None:
        """Where ``torch.save`` is given a DDP model as the object it pickles: the first positional argument,
        or ``obj=``; (its index among the arguments, the model's name), or None."""
        for index, arg in enumerate(call.args):
            first = index == 0 and arg.keyword is None and not arg.star
            named = arg.keyword is not None and arg.keyword.value == "obj"
            if (first or named) and is_name(arg.value) and arg.value.value in self.facts.wrapped_whole:
                return index, arg.value.value
        return None
