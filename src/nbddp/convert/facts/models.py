"""Facts about models: which ones DDP wraps and where, what an ``Accelerator`` prepares, whether the notebook
trains a PEFT adapter."""

from __future__ import annotations

import ast
from typing import TYPE_CHECKING

from ..ast_helpers import DEFS, compound_bodies, dotted_name, is_compound, is_dead_if, keyword, last_name
from ..code import group_lines
from .training import is_trainer_class, is_training_call

if TYPE_CHECKING:
    from ..code import CellCode, Statement
    from .job_facts import JobFacts, Seen


_OPTIMIZERS = frozenset(
    "SGD Adam AdamW RMSprop Adagrad Adadelta Adamax NAdam RAdam LBFGS SparseAdam ASGD Rprop Lion Adafactor "
    "AdamW8bit Adam8bit PagedAdamW PagedAdamW8bit".split()
)


def is_optimizer(call: ast.Call) -> bool:
    name = dotted_name(call.func) or ""
    return last_name(call.func) in _OPTIMIZERS or name.startswith(("torch.optim.", "optim."))


def model_of_parameters(call: ast.Call) -> tuple[str, str] | None:
    """``(model, part)`` for ``model.parameters()`` / ``model.named_parameters()`` (part ``""``), and for the
    parameters of one of its parts, ``model.mask_decoder.parameters()`` (part ``"mask_decoder"``),
    ``model.layers[-1].parameters()``: an optimizer over a part trains the model, which DDP wraps whole (its
    gradients flow through the whole forward; the parts no step reaches are what DDP's search for unused
    parameters is for)."""
    func = call.func
    if not (isinstance(func, ast.Attribute) and func.attr in ("parameters", "named_parameters")):
        return None
    node = func.value
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return node.id, ast.unparse(func.value)[len(node.id):].lstrip(".")


def is_peft(call: ast.Call) -> bool:
    """``get_peft_model(…)``, ``PeftModel.from_pretrained(…)``/``AutoPeftModel….from_pretrained(…)``, or a
    trainer given ``peft_config=``."""
    name = last_name(call.func)
    if name == "get_peft_model":
        return True
    if name == "from_pretrained" and isinstance(call.func, ast.Attribute):
        return (last_name(call.func.value) or "").startswith(("Peft", "AutoPeft"))
    return is_trainer_class(name) and keyword(call, "peft_config") is not None


def plan_accelerate(seen: Seen, facts: JobFacts, top: list[Statement], trains: list[bool]) -> None:
    """What an ``Accelerator`` prepares is Accelerate's: no DDP wrap, no sampler from nbddp.

    Except a name a training statement before the ``prepare`` reads: course ch3 §4 trains ``model`` over
    ``train_dataloader`` in plain loops, then hands the loader to Accelerate. That training is nbddp's (the
    loader is sharded, the model wrapped), and where the object it trained is the one ``prepare`` gets (the
    name not bound again in between), it is handed over as the notebook made it (``handed_to_accelerate``).
    What ``prepare`` binds is Accelerate's from there on (``prepare_binds``; no wrap after it).

    ``top``: every top-level statement in notebook order; ``trains``: which of them train."""
    position = {id(stmt): i for i, stmt in enumerate(top)}
    plain_first = set()
    for call, targets, stmt in seen.prepared:
        if not (isinstance(call.func.value, ast.Name) and call.func.value.id in facts.accelerators):
            continue
        at = position[id(stmt)]
        facts.prepare_binds[stmt] = set(targets)
        for name in (a.id for a in call.args if isinstance(a, ast.Name)):
            last = next((i for i in range(at - 1, -1, -1) if trains[i] and name in top[i].reads), None)
            if last is None:
                facts.accelerate_prepared.add(name)
                continue
            plain_first.add(name)
            if not any(name in s.binds for s in top[last + 1 : at]):
                facts.handed_to_accelerate.add(name)
        facts.accelerate_prepared.update(t for t in targets if t not in plain_first)
    facts.ddp_models -= facts.accelerate_prepared


def plan_ddp_wraps(top: list[Statement], first: int, facts: JobFacts) -> None:
    """Where a plain PyTorch model is wrapped in DDP: after the last statement that makes or moves it before
    a training statement, at the top level and in each block (a function or a fold loop that builds a model
    and trains it). A model made after an earlier training (a second model, a PEFT model built on the first)
    is wrapped before the training that follows it."""
    training = {id(s) for s in facts.training}
    for name in sorted(facts.ddp_models):
        for stmt in _last_placements(top, training, name, facts.prepare_binds):
            facts.ddp_wrap_after.setdefault(stmt, []).append(name)
    for stmt in top:
        if is_compound(stmt.nodes[0]):
            before = len(facts.ddp_wrap_inside)
            for block in _blocks(stmt.nodes[0], stmt.cell):
                _plan_block(block, stmt.cell, facts)
            if len(facts.ddp_wrap_inside) > before:
                facts.ddp_wraps_inside.add(stmt)


def _last_placements(top: list[Statement], training: set[int], name: str, prepared: dict) -> list[Statement]:
    """The top-level statements that make or move ``name`` last before some training statement, unless an
    Accelerate ``prepare`` binds it in between (``prepared``: ``JobFacts.prepare_binds``)."""
    found, last = [], None
    for stmt in top:
        if id(stmt) in training:
            if last is not None:
                found.append(last)
            last = None
        elif name in prepared.get(stmt, ()):
            last = None  # Accelerate wraps what its prepare binds
        elif _places(stmt.nodes, name):
            last = stmt
    return found


def _plan_block(block: list[ast.stmt], cell: CellCode, facts: JobFacts) -> None:
    groups = group_lines(block, cell)
    first = next((i for i, g in enumerate(groups) if any(is_training_call(c, facts) for c in calls_in(g))), None)
    if first is None:
        return
    for name in sorted(facts.ddp_models):
        at = placement(groups[:first], name)
        if at is not None:
            facts.ddp_wrap_inside.setdefault((cell.position, at[0].lineno), []).append(name)


def placement(groups: list[list[ast.stmt]], name: str) -> list[ast.stmt] | None:
    """The last statement that makes or moves model ``name``: DDP wraps it right after."""
    return next((g for g in reversed(groups) if _places(g, name)), None)


def _places(group: list[ast.stmt], name: str) -> bool:
    """Whether the statement makes model ``name``, moves it, or changes which of its weights train: DDP
    wraps it after, since DDP fixes at the wrap which weights it syncs. ``name = …``, ``name.to(…)`` /
    ``name.cuda()``, a part replaced (``name.classifier = …``), weights frozen (``name.x.requires_grad_()``,
    ``for p in name.features.parameters(): p.requires_grad = False``)."""
    for small in group:
        if isinstance(small, ast.Assign) and any(_is_or_part_of(t, name) or _unpacks_to(t, name) for t in small.targets):
            return True
        if isinstance(small, ast.Expr) and isinstance(small.value, ast.Call):
            func = small.value.func
            if isinstance(func, ast.Attribute) and func.attr in ("to", "cuda") and isinstance(func.value, ast.Name) and func.value.id == name:
                return True
            if isinstance(func, ast.Attribute) and func.attr == "requires_grad_" and _is_or_part_of(func.value, name):
                return True
        if isinstance(small, ast.For) and _freezes(small, name):
            return True
    return False


def _is_or_part_of(node: ast.AST, name: str) -> bool:
    """``name``, or a part of it (``name.classifier``, ``name.fc.weight``, ``name[0]``, ``name.layers[-1]``)."""
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return isinstance(node, ast.Name) and node.id == name


def _unpacks_to(target: ast.AST, name: str) -> bool:
    """``name, transforms = create_model(…)``."""
    return isinstance(target, (ast.Tuple, ast.List)) and any(
        isinstance(el, ast.Name) and el.id == name for el in target.elts)


def _freezes(loop: ast.For, name: str) -> bool:
    """``for p in name….parameters(): p.requires_grad = …`` (or ``named_parameters``, ``modules``, ``children``)."""
    it = loop.iter
    if not (isinstance(it, ast.Call) and last_name(it.func) in ("parameters", "named_parameters", "modules", "children")
            and isinstance(it.func, ast.Attribute) and _is_or_part_of(it.func.value, name)):
        return False
    return any(isinstance(n, ast.Attribute) and n.attr == "requires_grad" and isinstance(n.ctx, ast.Store)
               or isinstance(n, ast.Call) and last_name(n.func) == "requires_grad_" for n in ast.walk(loop))


def _blocks(node: ast.stmt, cell: CellCode):
    """Every indented block (a body on lines of its own) in a compound statement, outside ``if False:``."""
    if is_dead_if(node):
        return
    for body in compound_bodies(node):
        if not body:
            continue
        if isinstance(node, ast.If) and body is node.orelse and _is_elif(body[0], cell):
            yield from _blocks(body[0], cell)  # an elif: its own bodies are the blocks
            continue
        line = cell.lines[body[0].lineno - 1]
        if len(line.encode()) - len(line.lstrip().encode()) == body[0].col_offset:
            yield body
        for inner in body:
            if is_compound(inner):
                yield from _blocks(inner, cell)


def _is_elif(node: ast.stmt, cell: CellCode) -> bool:
    return isinstance(node, ast.If) and cell.line_bytes(node.lineno)[node.col_offset :].startswith(b"elif")


def calls_in(nodes: list[ast.stmt]) -> list[ast.Call]:
    """Every call in statements, outside function and class bodies, lambdas and ``if False:`` blocks."""
    found: list[ast.Call] = []
    todo: list[ast.AST] = list(nodes)
    while todo:
        node = todo.pop()
        if isinstance(node, (*DEFS, ast.Lambda)) or is_dead_if(node):
            continue
        if isinstance(node, ast.Call):
            found.append(node)
        todo.extend(ast.iter_child_nodes(node))
    return found
