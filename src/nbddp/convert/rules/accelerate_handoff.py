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

    The same for a loader a function of the notebook returns (``train_dl = make_loader(df, shuffle=True)``,
    then ``accelerator.prepare(…, train_dl)``, as a Kaggle kernel does inside its ``notebook_launcher``
    function), or at the top level a loader ``prepare`` takes that the training iterates (the facts do not say
    where a name bound in another cell came from): the sampler rule gave the loader in that function a ``DistributedSampler``, which
    Accelerate must not get under its own sharding (``_made_by_a_call``; ``for_accelerate`` leaves anything
    else as it is).
    """

    # -- where it has work: Python's ast, before libcst reads anything

    name = "accelerate"
    pattern = re.compile(r"\.prepare\s*\(")

    @classmethod
    def wanted(cls, cell, facts) -> bool:
        return bool(facts.handed_to_accelerate or facts.plain_loop) and super().wanted(cell, facts)

    @classmethod
    def touches(cls, stmt, facts, nodes) -> bool:
        if not facts.plain_loop:
            return any(cls._handed(call, facts) for call in ast_helpers.calls(nodes))
        made = _made_by_a_call(nodes, facts)
        in_functions = {id(n) for f in nodes if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                        for n in ast.walk(f)}
        at_top = _loaders_at_the_top(facts)
        return any(cls._handed(call, facts) or set(cls._prepared(call, facts)) & (
            made if id(call) in in_functions else at_top) for call in ast_helpers.calls(nodes))

    @staticmethod
    def _prepared(call: ast.Call, facts) -> list[str]:
        """The names ``accelerator.prepare(…)`` is given, for an accelerator of the notebook's."""
        func = call.func
        if isinstance(func, ast.Attribute) and func.attr == "prepare" and isinstance(func.value, ast.Name) \
                and func.value.id in facts.accelerators:
            return [a.id for a in call.args if isinstance(a, ast.Name)]
        return []

    @staticmethod
    def _handed(call: ast.Call, facts) -> list[str]:
        func = call.func
        if isinstance(func, ast.Attribute) and func.attr == "prepare" and isinstance(func.value, ast.Name) \
                and func.value.id in facts.accelerators:
            return [a.id for a in call.args if isinstance(a, ast.Name) and a.id in facts.handed_to_accelerate]
        return []

    # -- what it does: libcst

    def __init__(self, facts, chunk):
        super().__init__(facts, chunk)
        self._made: list[set[str]] = [set()]  # per scope (module, each function): names a call of a function made

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        self._made.append(set())

    def leave_FunctionDef(self, original: cst.FunctionDef, updated: cst.FunctionDef) -> cst.FunctionDef:
        self._made.pop()
        return updated

    def visit_Assign(self, node: cst.Assign) -> None:
        if self.facts.plain_loop and isinstance(node.value, cst.Call) and is_name(node.value.func) \
                and _a_function_of_the_notebook(node.value.func.value, self.facts):
            self._made[-1].update(n.value for t in node.targets for n in _names(t.target))

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.Call:
        func = updated.func
        if not (is_attribute(func, "prepare") and is_name(func.value) and func.value.value in self.facts.accelerators):
            return updated
        updated, handed = wrap_named_arguments(updated, self.facts.handed_to_accelerate, "_nbddp.for_accelerate")
        for name in handed:
            self.note(original, f"{name} goes to Accelerate as the notebook made it (no nbddp DistributedSampler "
                                "or DDP wrapper): Accelerate distributes it itself; the plain loops above are nbddp's")
        if not self.facts.plain_loop:
            return updated
        # in a function, what a function of the notebook made; at the top level, the loaders the training
        # iterates (one a notebook function made in another cell: the facts keep no record of where it came from)
        made = self._made[-1] if len(self._made) > 1 else _loaders_at_the_top(self.facts)
        updated, handed = wrap_named_arguments(
            updated, made - self.facts.handed_to_accelerate - self.facts.optimizers, "_nbddp.for_accelerate")
        for name in handed:
            self.note(original, f"{name} goes to Accelerate as the notebook made it (nbddp's DistributedSampler or "
                                "DDP wrapper taken off, where it has one): Accelerate distributes it itself")
        return updated


def _names(target: cst.BaseExpression) -> list[cst.Name]:
    """The names an assignment's target binds (``a``, ``a, b``, ``(a, b)``)."""
    if isinstance(target, cst.Name):
        return [target]
    if isinstance(target, (cst.Tuple, cst.List)):
        return [n for element in target.elements for n in _names(element.value)]
    return []


def _loaders_at_the_top(facts) -> set[str]:
    """The top-level names ``prepare`` takes that the training iterates, but not those a ``DataLoader(…)`` call
    made and the sampler rule left whole: loaders a call of a notebook function (or another helper) made."""
    return (facts.accelerate_prepared & facts.train_iterated) - facts.optimizers - facts.whole_loaders


def _a_function_of_the_notebook(name: str, facts) -> bool:
    """A function the notebook defines (bound at its top level, not a class: classes are capitalised)."""
    return name in facts.module_names and name[:1].islower()


def _made_by_a_call(nodes, facts) -> set[str]:
    """The names bound to what a function of the notebook returns (``dl = make_loader(…)``), among ``nodes``."""
    made: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Name) \
                and _a_function_of_the_notebook(node.value.func.id, facts):
            made.update(n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name))
    return made
