"""Small questions about Python's ``ast`` nodes, asked by the cleaner, the facts and the rules' checks.

Their libcst counterparts, for the rules' rewrites, are in ``cst_helpers.py``; both answer alike (a dead
``if`` is the same block in either tree), so what a check sees is what its rule will see.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator

#: Statements with blocks of their own.
COMPOUND = (ast.If, ast.For, ast.AsyncFor, ast.While, ast.Try, ast.TryStar, ast.With, ast.AsyncWith,
            ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Match)
#: Definitions: their bodies are not the statement's own code.
DEFS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def dotted_name(node: ast.AST) -> str | None:
    """``a.b.C`` for a Name/Attribute chain, else None."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = dotted_name(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


def last_name(node: ast.AST) -> str | None:
    """The last part of a call's name: ``AutoModel`` for ``transformers.AutoModel``, ``train`` for ``t.train``."""
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Name):
        return node.id
    return None


def is_dead_if(node: ast.AST) -> bool:
    """``if False:`` / ``if 0:``: code a notebook keeps switched off."""
    if not isinstance(node, ast.If) or not isinstance(node.test, ast.Constant):
        return False
    value = node.test.value
    # ``0`` written as such (libcst's Integer("0")), not ``00`` or ``0x0``
    return value is False or type(value) is int and value == 0 and node.test.end_col_offset - node.test.col_offset == 1


def keyword(call: ast.Call, key: str) -> ast.keyword | None:
    return next((k for k in call.keywords if k.arg == key), None)


def is_literal(node: ast.AST, *values) -> bool:
    """A constant that is one of ``values`` (by identity: ``False`` is not ``0``)."""
    return isinstance(node, ast.Constant) and any(node.value is v for v in values)


def calls(nodes: Iterable[ast.AST]) -> Iterator[ast.Call]:
    """The calls among ``nodes``."""
    return (n for n in nodes if isinstance(n, ast.Call))


def live_calls(nodes: Iterable[ast.AST]) -> list[ast.Call]:
    """Every call in ``nodes``, function bodies and lambdas included, outside ``if False:`` blocks: the calls a
    rule's walk meets (no rule looks inside ``if False:``)."""
    found: list[ast.Call] = []
    todo: list[ast.AST] = list(nodes)
    while todo:
        node = todo.pop()
        if is_dead_if(node):
            continue
        if isinstance(node, ast.Call):
            found.append(node)
        todo.extend(ast.iter_child_nodes(node))
    return found


def is_compound(node: ast.stmt) -> bool:
    return isinstance(node, COMPOUND)


def compound_bodies(node: ast.stmt) -> list[list[ast.stmt]]:
    """The statement lists of a compound statement: its body, ``else``, ``finally``, handlers and cases."""
    bodies = [getattr(node, name, None) or [] for name in ("body", "orelse", "finalbody")]
    return bodies + [h.body for h in getattr(node, "handlers", ())] + [c.body for c in getattr(node, "cases", ())]


def all_statements(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """Every statement in a block, nested ones included (not those inside expressions: there are none)."""
    for node in body:
        yield node
        if is_compound(node):
            for inner in compound_bodies(node):
                yield from all_statements(inner)


def first_line(node: ast.stmt) -> int:
    """Where a statement starts: its first decorator's line for a decorated definition."""
    decorators = getattr(node, "decorator_list", None)
    return decorators[0].lineno if decorators else node.lineno
