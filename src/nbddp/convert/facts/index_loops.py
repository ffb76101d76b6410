"""Facts about training loops fed without a DataLoader: the loop over batch positions that slices tensors by
index (``for i in range(0, len(X), bs): xb = X[perm[i:i+bs]]``) and the loop over a list of samples
(``for x, y in samples:``). Every rank would train on the same rows; ``rules/shard_loop.py`` gives each rank
its own share of the loop's steps. And the full-batch loop (``for epoch in range(n): model(X_train)``), which
has no steps to share out: ``rules/full_batch.py`` refuses it before launch."""

from __future__ import annotations

import ast
import re
from typing import TYPE_CHECKING, Callable

from ..ast_helpers import compound_bodies, dotted_name, is_compound, is_dead_if, last_name
from .loaders import loader_name

if TYPE_CHECKING:
    from ..code import Statement
    from .job_facts import JobFacts

#: A ``for`` and a ``.backward(`` anywhere: what a cell holding a training loop has (``may_train_in_a_loop``).
_FOR, _BACKWARD = re.compile(r"\bfor\b"), re.compile(r"\.backward\(")


def may_train_in_a_loop(text: str) -> bool:
    """Whether ``text`` may hold a loop calling ``backward``: the loop rules' cheap test before any ast walk. Two
    searches, linear in the text (one pattern ``for…backward(`` scanned to the text's end from each ``for``: 7 s
    for a cell of 6,000 comprehensions)."""
    return _BACKWARD.search(text) is not None and _FOR.search(text) is not None


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


# -- full-batch loops: every step trains on the same whole tensors

#: Tensor methods that give the same rows back (a full tensor moved or cast is still the full tensor).
_SAME_ROWS = frozenset({"to", "cuda", "cpu", "float", "double", "half", "long", "int", "bfloat16", "contiguous"})


def full_batch_loops(stmt: Statement, facts: JobFacts, binding: Callable[[str], Statement | None]
                     ) -> list[tuple[int, int, list[str]]]:
    """(cell position, line, the tensors fed whole) of each loop of a top-level statement that trains a DDP
    model on whole tensors at every step, outside function and class bodies.

    Only where certain: the innermost loop holding ``backward()`` over ``range(…)`` (not shardable: its
    variable feeds no slice) calls the model itself, and every argument of each such call (outside ``no_grad``)
    is a name or attribute bound at the top level before the statement, not inside it, not a loader, and bound
    by a statement (``binding``: the last one binding a name before ``stmt``) that takes no batch from a loader
    and reads no rank; an attribute's object is left as it is by the loop. A helper that trains, indices drawn
    each step, a batch of a loader, an object that draws one (``sampler.next()``), a function's own
    parameters: left alone (the runtime's first-batches check stays the net behind this one).
    """
    if not facts.plain_loop or facts.self_distributed or not facts.ddp_models:
        return []
    inside = _bound_in(stmt.nodes)
    found = []
    for loop in _loops(stmt.nodes):
        fed = _fed_whole(loop, facts, inside, binding)
        if fed:
            found.append((stmt.cell.position, loop.lineno, fed))
    return found


def _loops(body: list[ast.stmt]):
    """The ``for`` loops of a block, nested ones too, outside function and class bodies and ``if False:``."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) or is_dead_if(node):
            continue
        if isinstance(node, ast.For):
            yield node
        if is_compound(node):
            for inner in compound_bodies(node):
                yield from _loops(inner)


def _fed_whole(loop: ast.For, facts: JobFacts, inside: set[str], binding) -> list[str] | None:
    """The tensors a full-batch loop feeds its model whole (its targets after them), or None for any other loop."""
    if not _trains_innermost(loop, facts) or shardable_loop(loop, facts) is not None:
        return None
    ranged = _unwrapped(loop.iter)
    if not (_is_range(ranged) or isinstance(ranged, ast.Call) and last_name(ranged.func) == "trange"):
        return None
    steps = {n.id for n in ast.walk(loop.target) if isinstance(n, ast.Name)}
    if any(isinstance(n, ast.Subscript) and _uses_any(steps, n.slice) for s in loop.body for n in ast.walk(s)):
        return None  # the loop's variable picks rows
    forwards = [c for c in _training_calls(loop.body) if isinstance(c.func, ast.Name) and c.func.id in facts.ddp_models]
    if not forwards:
        return None
    fed: list[str] = []
    for call in forwards:
        for arg in [*call.args, *(k.value for k in call.keywords)]:
            whole = _whole_tensor(arg)
            if whole is None or not _bound_whole(whole.partition(".")[0], facts, inside, binding) \
                    or _object_changed(loop, whole):
                return None
            fed.append(whole)
    targets = [t for t in _targets(loop, forwards) if _bound_whole(t.partition(".")[0], facts, inside, binding)]
    return list(dict.fromkeys(fed + targets))


def _training_calls(body: list[ast.stmt]) -> list[ast.Call]:
    """The calls of a loop's body outside function bodies, lambdas and ``no_grad``/``inference_mode`` blocks
    (an evaluation inside the epoch loop), in source order."""
    found: list[ast.Call] = []
    todo: list[ast.AST] = list(reversed(body))
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)) or is_dead_if(node):
            continue
        if isinstance(node, ast.With) and any(last_name(i.context_expr.func if isinstance(i.context_expr, ast.Call)
                                                        else i.context_expr) in ("no_grad", "inference_mode")
                                              for i in node.items):
            continue
        if isinstance(node, ast.Call):
            found.append(node)
        todo.extend(reversed(list(ast.iter_child_nodes(node))))
    return found


def _whole_tensor(arg: ast.AST) -> str | None:
    """``X_train``, ``data.x``, ``X_train.to(device)`` → the dotted name it reads whole; None for anything else."""
    while isinstance(arg, ast.Call) and isinstance(arg.func, ast.Attribute) and arg.func.attr in _SAME_ROWS:
        arg = arg.func.value
    return dotted_name(arg)


def _targets(loop: ast.For, forwards: list[ast.Call]) -> list[str]:
    """The names beside the forward's output in the loss (``crit(out, y_train)``, ``(model(X) - y) ** 2``; ``out``
    bound to anything computed from the forward, ``model(X).squeeze()``)."""
    outputs = {t.id for s in loop.body for n in ast.walk(s) if isinstance(n, ast.Assign)
               and any(c in forwards for c in ast.walk(n.value)) for t in n.targets if isinstance(t, ast.Name)}
    found = []
    for node in (n for s in loop.body for n in ast.walk(s)):
        if isinstance(node, ast.Call) and node not in forwards:
            operands = list(node.args)
        elif isinstance(node, ast.BinOp):
            operands = [node.left, node.right]
        else:
            continue
        if any(o in forwards or isinstance(o, ast.Name) and o.id in outputs for o in operands):
            found += [name for o in operands if o not in forwards and (name := _whole_tensor(o))
                      and name.partition(".")[0] not in outputs]
    return found


def _bound_whole(name: str, facts: JobFacts, inside: set[str], binding) -> bool:
    """``name`` holds the same whole data on every rank: bound at the top level before the loop's statement, by a
    statement that takes no batch of a loader and reads no rank, and not a loader itself."""
    if name in inside or name not in facts.module_names or _a_loader(name, facts) or name in facts.ddp_models:
        return False
    stmt = binding(name)
    if stmt is None or any(isinstance(n, (ast.For, ast.AsyncFor, ast.While)) for n in stmt.nodes):
        return False
    read = {n.id for node in stmt.nodes for n in ast.walk(node) if isinstance(n, ast.Name)}
    called = {last_name(c.func) for c in stmt.calls}
    return not ({"next", "iter"} & called or any(_a_loader(n, facts) for n in read)
                or any("rank" in n.lower() or "world_size" in n.lower() for n in read | called if n))


def _object_changed(loop: ast.For, whole: str) -> bool:
    """``whole`` is an object's attribute (``sampler.xb``) and the loop may change the object at each step: a
    method of it called (``sampler.next()``; not one giving the same rows, ``data.to(device)``), the object
    handed to a call (``refill(buf)``), an attribute of it set (``batch.x = X[idx]``)."""
    owner, dot, _ = whole.partition(".")
    if not dot:
        return False
    for node in (n for s in loop.body for n in ast.walk(s)):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == owner \
                and isinstance(node.ctx, (ast.Store, ast.Del)):
            return True
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == owner \
                    and func.attr not in _SAME_ROWS:
                return True
            if any(isinstance(a, ast.Name) and a.id == owner for a in [*node.args, *(k.value for k in node.keywords)]):
                return True
    return False


def _bound_in(body: list[ast.stmt]) -> set[str]:
    """Every name a statement binds anywhere in it (an epoch loop's own variables, a batch an outer loop takes)."""
    return {n.id for node in body for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)} \
        | {a.arg for node in body for n in ast.walk(node) if isinstance(n, ast.arguments)
           for a in [*n.posonlyargs, *n.args, *n.kwonlyargs]}


def _uses_any(names: set[str], expr: ast.AST) -> bool:
    return any(isinstance(n, ast.Name) and n.id in names for n in ast.walk(expr))
