"""Facts about training loops fed without a DataLoader: the loop over batch positions that slices tensors by
index (``for i in range(0, len(X), bs): xb = X[perm[i:i+bs]]``) and the loop over a list of samples
(``for x, y in samples:``). Every rank would train on the same rows; ``rules/shard_loop.py`` gives each rank
its own share of the loop's steps."""

from __future__ import annotations

import ast
from typing import TYPE_CHECKING

from ..ast_helpers import last_name
from .loaders import loader_name

if TYPE_CHECKING:
    from .job_facts import JobFacts

#: What the kinds of loop become: the runtime helper taking this rank's share of the steps.
SHARDS = {"range": "_nbddp.shard_range", "items": "_nbddp.shard_items"}


def shardable_loop(loop: ast.AST, facts: JobFacts) -> str | None:
    """"range" for a loop over batch positions whose variable slices the data, "items" for a loop over a
    sequence of samples that no DataLoader gives; None for any other loop.

    Only the innermost loop holding the backward pass counts: an epoch loop around it is not the data's, and a
    full-batch loop (``for epoch in range(n): loss = f(model(X))``) uses its variable in no slice, so it is
    left alone (the runtime's first-batches check stops it: every rank would train on all of ``X``).
    """
    if not isinstance(loop, ast.For) or not _trains_innermost(loop, facts):
        return None
    if _is_range(_unwrapped(loop.iter)) and isinstance(loop.target, ast.Name) and _slices_with(loop, loop.target.id):
        return "range"  # ``range(…)``, ``tqdm(range(…))``
    names = _zipped(loop.iter) or [loader_name(loop.iter)]
    if all(n is not None and not _a_loader(n, facts) and n != "range" for n in names):
        return "items"
    return None


def _unwrapped(expr: ast.AST) -> ast.AST:
    """What ``enumerate``/``tqdm``/``iter`` wrap (``tqdm(range(…))`` → ``range(…)``)."""
    while isinstance(expr, ast.Call) and expr.args and last_name(expr.func) in ("enumerate", "tqdm", "iter"):
        expr = expr.args[0]
    return expr


def _zipped(expr: ast.AST) -> list[str | None] | None:
    """The sequences ``zip(X, Y)`` walks together (each sharded alike), inside ``enumerate``/``tqdm`` too."""
    expr = _unwrapped(expr)
    if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name) and expr.func.id == "zip" and expr.args \
            and not expr.keywords:
        return [a.id if isinstance(a, ast.Name) else None for a in expr.args]
    return None


def _trains_innermost(loop: ast.For, facts: JobFacts) -> bool:
    """The loop's body calls ``backward`` (or a function of the notebook that trains) and no loop inside it does."""
    if not _trains(loop.body + loop.orelse):
        return False
    inner = [n for stmt in loop.body for n in ast.walk(stmt) if isinstance(n, (ast.For, ast.While))]
    return not any(_trains(n.body) for n in inner)


def _trains(body: list[ast.stmt]) -> bool:
    return any(isinstance(n, ast.Call) and last_name(n.func) == "backward" for stmt in body for n in ast.walk(stmt))


def _is_range(expr: ast.AST) -> bool:
    return isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name) and expr.func.id == "range" and not expr.keywords


def _slices_with(loop: ast.For, name: str) -> bool:
    """``name`` starts a window the loop reads (``X[i:i+bs]``, ``perm[i*bs:(i+1)*bs]``: both bounds given; not
    ``losses[epoch:]``), or indexes what the range counts (``for i in range(len(batches)): xb = batches[i]``)."""
    counted = {a.args[0].id for a in ast.walk(loop.iter) if isinstance(a, ast.Call) and last_name(a.func) == "len"
               and a.args and isinstance(a.args[0], ast.Name)}
    for stmt in loop.body:
        for node in ast.walk(stmt):
            if not isinstance(node, ast.Subscript) or not isinstance(node.ctx, ast.Load):
                continue
            index = node.slice
            if isinstance(index, ast.Slice) and index.upper is not None and _uses(name, index.lower):
                return True
            if isinstance(index, ast.Name) and index.id == name and isinstance(node.value, ast.Name) \
                    and node.value.id in counted:
                return True
    return False


def _uses(name: str, *exprs: ast.AST | None) -> bool:
    return any(isinstance(n, ast.Name) and n.id == name for e in exprs if e is not None for n in ast.walk(e))


def _a_loader(name: str, facts: JobFacts) -> bool:
    """A DataLoader the notebook builds or a helper gives, or a name saying it is one: the sampler rule's."""
    known = (facts.sharded_loaders | facts.whole_loaders | facts.helper_loaders | facts.helper_training_loaders
             | facts.accelerate_prepared)
    lowered = name.lower()
    return name in known or "loader" in lowered or lowered.endswith(("dl", "_dl")) or "iter" in lowered
