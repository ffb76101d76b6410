"""Plain PyTorch: each epoch loop calls ``set_epoch`` on its loaders' samplers: the rule and where it has work."""

from __future__ import annotations

import ast
import re
from typing import TYPE_CHECKING

from ..cst_helpers import cst, is_dead_if, last_name
from ..engine.rule import Rule

if TYPE_CHECKING:
    from ..facts import JobFacts


class SetEpochRule(Rule):
    """Plain PyTorch: each epoch loop calls ``set_epoch`` on the DistributedSamplers it reads from.

    A ``DistributedSampler`` shuffles with a seed plus its epoch; without ``set_epoch(epoch)`` every epoch
    sees the same order. The innermost loop over epochs (a ``for`` whose body reads a loader, other than
    the loop over the loader itself) starts with ``_nbddp.set_epoch(loader, epoch)``, which does nothing
    for a loader without such a sampler.
    """

    # -- where it has work: Python's ast, before libcst reads anything

    name = "set_epoch"
    pattern = re.compile(r"\bfor\b")

    @classmethod
    def wanted(cls, cell, facts) -> bool:
        code = cell.code
        loaders = "loader" in code.lower() or any(name in code for name in facts.sharded_loaders)
        return facts.plain_loop and loaders and super().wanted(cell, facts)

    @classmethod
    def touches(cls, stmt, facts, nodes) -> bool:
        # an epoch loop (a ``for`` over a plain name) that reads a loader somewhere in its statement
        loops = any(isinstance(n, (ast.For, ast.AsyncFor)) and isinstance(n.target, ast.Name) for n in nodes)
        return loops and any(
            isinstance(n, ast.Name) and (n.id in facts.sharded_loaders or "loader" in n.id.lower()) for n in nodes
        )

    # -- what it does: libcst

    def __init__(self, facts, chunk):
        super().__init__(facts, chunk)
        self._done = [False]  # per open loop: whether a loop inside it already got set_epoch

    def visit_For(self, node: cst.For) -> None:
        self._done.append(False)

    def leave_For(self, original: cst.For, updated: cst.For) -> cst.For:
        inner = self._done.pop()
        if inner:
            self._done[-1] = True
            return updated
        if not isinstance(original.target, cst.Name):
            return updated
        loaders = [name for name in _loaders_in(original.body, self.facts) if name != _iterated(original.iter)]
        if not loaders:
            return updated
        epoch = original.target.value
        calls = [cst.parse_statement(f"_nbddp.set_epoch({name}, {epoch})\n") for name in loaders]
        body = updated.body
        if isinstance(body, cst.IndentedBlock):
            body = body.with_changes(body=calls + list(body.body))
        else:  # for epoch in range(n): fit(loader)
            body = body.with_changes(body=[c.body[0] for c in calls] + list(body.body))
        self.note(original, f"each epoch reshuffles {', '.join(loaders)}'s DistributedSampler (set_epoch({epoch}))")
        self._done[-1] = True
        return updated.with_changes(body=body)



def _iterated(expr: cst.BaseExpression) -> str | None:
    """The loader a ``for`` iterates: ``dl`` in ``dl``, ``enumerate(dl)``, ``tqdm(dl, …)``, ``enumerate(tqdm(dl))``."""
    while isinstance(expr, cst.Call) and expr.args and last_name(expr.func) in ("enumerate", "tqdm", "iter"):
        expr = expr.args[0].value
    return expr.value if isinstance(expr, cst.Name) else None


def _loaders_in(body: cst.CSTNode, facts: JobFacts) -> list[str]:
    """Loaders a loop body uses, in source order: iterated (``for b in train_loader``) or handed to a function
    (``fit(train_loader)``); not in a function defined there, nor in an ``if False:`` block."""
    found: list[str] = []
    todo = [body]
    while todo:  # depth first, in source order
        node = todo.pop()
        if isinstance(node, cst.FunctionDef) or is_dead_if(node):
            continue
        name = _used_loader(node, facts)
        if name and name not in found:
            found.append(name)
        todo += reversed(node.children)
    return found


def _used_loader(node: cst.CSTNode, facts: JobFacts) -> str | None:
    """The loader a node uses: a loop over a sharded loader or one named so (not one Accelerate prepared: it
    sets its loaders' epochs itself; not one built without a DistributedSampler: set_epoch would reshuffle
    nothing), or a sharded loader handed to a function."""
    if isinstance(node, cst.For):
        name = _iterated(node.iter)
        if name and name not in facts.accelerate_prepared | facts.whole_loaders and (
                name in facts.sharded_loaders or "loader" in name.lower()):
            return name
    elif isinstance(node, cst.Arg) and isinstance(node.value, cst.Name) and node.value.value in facts.sharded_loaders:
        return node.value.value
    return None
