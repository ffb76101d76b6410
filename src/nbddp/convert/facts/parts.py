"""Facts about a model trained through an optimizer over one of its parts, when the training calls that part
itself (``sam_model.mask_decoder(emb)``) and never the model (``sam_model(…)``): the part is what DDP wraps.

SAM's own fine-tuning scripts run ``sam_model.image_encoder(x)`` under ``no_grad`` and then
``sam_model.mask_decoder(…)``, with ``Adam(sam_model.mask_decoder.parameters())``. A DDP wrapper around the
whole model would never run its forward there, so it would average no gradient. The part gets a wrapper of its
own under a new name, and the training's calls of the part go through it; the model still holds the plain part,
so its ``state_dict()`` keys (and the part's) stay as they were.

Where the training also calls the model itself, hands it to a function, or calls something inside a wrapped
part, the model is wrapped whole as before (``models.plan_ddp_wraps``), and the replica check
(``runtime/divergence.py``) stops the job at the first step if the wrapper is bypassed: a part wrapper would be
bypassed by ``sam_model(…)`` in the same way, so neither wrap is right there and the check says so.
"""

from __future__ import annotations

import ast
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..code import Statement
    from .job_facts import JobFacts

#: what a training step may call on a part without running its forward
_MODULE_METHODS = frozenset(
    "train eval parameters named_parameters buffers named_buffers modules named_modules children named_children "
    "zero_grad requires_grad_ to cuda cpu float half bfloat16 double type apply state_dict load_state_dict "
    "register_forward_hook register_forward_pre_hook register_full_backward_hook".split()
)


def plan_part_wraps(top: list[Statement], facts: JobFacts) -> None:
    """For each model of ``facts.trained_parts`` whose training calls the trained parts themselves and never the
    model: the parts DDP wraps and their wrappers' names (``facts.part_wraps``), and the top-level statements
    whose calls of them go through the wrappers (``facts.part_routes``: the training statements and the
    functions they call)."""
    routes, nodes = _training_code(top, facts)
    taken = set(facts.module_names)
    for model in sorted(m for m in facts.trained_parts if m in facts.ddp_models):
        parts = _parts_to_wrap(model, facts.trained_parts[model], nodes)
        if parts:
            facts.part_wraps[model] = {part: _new_name(f"{model}_{part}_ddp", taken) for part in parts}
    if facts.part_wraps:
        facts.part_routes.update(routes)


def _training_code(top: list[Statement], facts: JobFacts) -> tuple[set[Statement], list[ast.AST]]:
    """The top-level statements that train, with those defining the functions they call (by name, at any
    depth), and the ast nodes of that code: what a training step runs, as far as names say."""
    defs: dict[str, tuple[Statement, ast.AST]] = {}
    for stmt in top:
        for node in stmt.nodes:
            for inner in ast.walk(node):
                if isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    defs.setdefault(inner.name, (stmt, inner))
    routes: set[Statement] = set(facts.training)
    nodes: list[ast.AST] = [n for stmt in facts.training for n in stmt.nodes]
    todo, seen = list(nodes), set()
    while todo:
        for call in (n for n in ast.walk(todo.pop()) if isinstance(n, ast.Call)):
            name = call.func.id if isinstance(call.func, ast.Name) else None
            if name in defs and name not in seen:
                seen.add(name)
                stmt, node = defs[name]
                routes.add(stmt)
                nodes.append(node)
                todo.append(node)
    return routes, nodes


def _parts_to_wrap(model: str, trained: set[str], nodes: list[ast.AST]) -> list[str]:
    """The parts of ``model`` the training calls that hold what its optimizer trains, or none where the model
    is to be wrapped whole: the model itself called or handed on, a trained part no call reaches, wrapped parts
    inside each other, or something inside a wrapped part called past it."""
    called: set[str] = set()
    for node in nodes:
        for use in _uses(node, model):
            if use is None:
                return []
            called.add(use)
    wrapped = sorted(c for c in called if any(_holds(c, t) for t in trained))
    if not wrapped or not all(any(_holds(w, t) for w in wrapped) for t in trained):
        return []
    if any(not re.fullmatch(r"\w+(\.\w+)*", w) for w in wrapped):  # ``model.layers[-1](…)``: kept whole
        return []
    if any(a != b and _holds(a, b) for a in wrapped for b in wrapped):
        return []
    inside = [c for c in called if c not in wrapped and any(_holds(w, c) for w in wrapped)]
    if any(c.rsplit(".", 1)[-1] not in _MODULE_METHODS for c in inside):
        return []
    return wrapped


def _uses(root: ast.AST, model: str):
    """For each use of the name ``model`` under ``root``: the part called when it is ``model.a.b(…)``
    (``"a.b"``, ``"a[0]"``), None when the model itself is called, its ``forward`` is, or the name is handed on
    or bound (``model(x)``, ``train(model)``, ``m = model``); other uses (``model.a.weight``) yield nothing."""
    parents = {child: node for node in ast.walk(root) for child in ast.iter_child_nodes(node)}
    for node in ast.walk(root):
        if not (isinstance(node, ast.Name) and node.id == model):
            continue
        top = node
        while isinstance(parents.get(top), (ast.Attribute, ast.Subscript)) and parents[top].value is top:
            top = parents[top]
        above = parents.get(top)
        if top is node:
            yield None  # the model itself: called, handed on, bound
        elif isinstance(above, ast.Call) and above.func is top:
            part = ast.unparse(top)[len(model):].lstrip(".")
            yield None if part in ("forward", "__call__") else part


def _holds(part: str, inner: str) -> bool:
    """Whether ``part`` is ``inner`` or holds it (``mask_decoder`` holds ``mask_decoder.iou_head``,
    ``layers[-1]``)."""
    return inner == part or inner.startswith((part + ".", part + "["))


def _new_name(name: str, taken: set[str]) -> str:
    name = re.sub(r"\W", "_", name)
    while name in taken:
        name += "_"
    taken.add(name)
    return name
