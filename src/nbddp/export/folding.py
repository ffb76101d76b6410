"""The strings a notebook's code computes from constants, for the secret scan (``secrets.py``).

A token is as public in ``prefix = "hf_"; tok = prefix + "aBc…"`` as written whole, so the scan reads the
values the code builds, not only its text. ``StringFolder`` walks the cells' ast in cell order and in source
order within a cell, keeps the names bound to a constant string (a later binding to anything else forgets
the name), and folds the expressions built from constants and those names: ``+``, ``+=``, ``%``,
``.format``, f-strings and ``sep.join([...])``. It evaluates nothing: every operation is redone here on
values it knows, and widths, fields and lengths that could make a folded value large are refused, so a hostile
notebook cannot make the scan slow or big.
"""

from __future__ import annotations

import ast
import re
import string
from typing import Iterator, Union

Value = Union[str, int, float]

#: A folded string longer than this is not followed (a token is far shorter; doubling a name in a loop of
#: statements must not grow without end).
MAX_LENGTH = 10_000
#: A width or precision of four digits or more, or one taken from the arguments (``*``): not folded.
_BIG_PERCENT = re.compile(r"%[^a-zA-Z%]*?(?:\*|\d{4})")
_BIG_SPEC = re.compile(r"\d{4}|[{}]")
_CONVERSIONS = {-1: lambda v: v, 115: str, 114: repr, 97: ascii}  # FormattedValue.conversion: none, !s, !r, !a


class StringFolder:
    """Names bound to constant strings so far, over every cell walked; ``built`` gives a cell's built strings."""

    def __init__(self) -> None:
        self.names: dict[str, str] = {}
        self._folded: tuple[ast.AST | None, str | None] = (None, None)  # an assignment's value, folded once

    def built(self, tree: ast.AST) -> list[tuple[ast.AST, str]]:
        """``(node, value)`` for each outermost expression (or ``+=`` statement) of ``tree`` that folds to a
        string made of more than one piece, in source order; binds and forgets names on the way."""
        found: list[tuple[ast.AST, str]] = []
        self._walk(tree, found)
        return found

    def _walk(self, node: ast.AST, found: list) -> None:
        # one recursive call a node, appending: a chain of generators as deep as the tree cost more
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            self.names.pop(node.id, None)  # assigned, deleted or a loop variable: no longer a known constant
            return
        if isinstance(node, ast.expr):
            value = self._folded[1] if self._folded[0] is node else self.fold(node)
            if value is not None:
                if _pieced(node):
                    found.append((node, value))
                return
        binding = self._binding(node)  # read with the names as they are before this statement
        if isinstance(node, ast.AugAssign) and binding:
            found.append((node, next(iter(binding.values()))))
        for child in _children(node):
            self._walk(child, found)
        self.names.update(binding)

    def fold(self, node: ast.AST) -> str | None:
        """The string ``node`` always evaluates to, given the names known, else None."""
        try:
            value = self._fold(node)
        except (ValueError, TypeError, KeyError, IndexError, OverflowError):
            return None  # the code would raise here too: no value to read
        return value if isinstance(value, str) and len(value) <= MAX_LENGTH else None

    def _fold(self, node: ast.AST) -> str | None:
        if isinstance(node, ast.Constant):
            return node.value if isinstance(node.value, str) else None
        if isinstance(node, ast.Name):
            return self.names.get(node.id) if isinstance(node.ctx, ast.Load) else None
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            return _concat(self.fold(node.left), self.fold(node.right))
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod):
            return self._percent(node)
        if isinstance(node, ast.JoinedStr):
            return self._f_string(node)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr == "format":
                return self._format(node)
            if node.func.attr == "join":
                return self._join(node)
        return None

    def _operand(self, node: ast.AST) -> Value | None:
        """A value that may fill a ``%`` or ``{}`` field: a string, an int or a float constant."""
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        return self.fold(node)

    def _percent(self, node: ast.BinOp) -> str | None:
        template = self.fold(node.left)
        if template is None or _BIG_PERCENT.search(template):
            return None
        right = node.right
        if isinstance(right, ast.Tuple):
            args = tuple(self._operand(e) for e in right.elts)
            return template % args if None not in args else None
        if isinstance(right, ast.Dict):
            keys = [k.value if isinstance(k, ast.Constant) else None for k in right.keys]
            values = [self._operand(v) for v in right.values]
            if None in values or not all(isinstance(k, str) for k in keys):
                return None
            return template % dict(zip(keys, values))
        arg = self._operand(right)
        return template % (arg,) if arg is not None else None

    def _format(self, node: ast.Call) -> str | None:
        template = self.fold(node.func.value)
        if template is None or not _plain_fields(template):
            return None
        if any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords):
            return None
        args = [self._operand(a) for a in node.args]
        kwargs = {k.arg: self._operand(k.value) for k in node.keywords}
        if None in args or None in kwargs.values():
            return None
        return template.format(*args, **kwargs)

    def _f_string(self, node: ast.JoinedStr) -> str | None:
        parts = []
        for part in node.values:
            if isinstance(part, ast.FormattedValue):
                value = self._operand(part.value)
                spec = self.fold(part.format_spec) if part.format_spec is not None else ""
                if value is None or spec is None or _BIG_SPEC.search(spec) or part.conversion not in _CONVERSIONS:
                    return None
                parts.append(format(_CONVERSIONS[part.conversion](value), spec))
            else:
                parts.append(self.fold(part))
        return "".join(parts) if None not in parts else None

    def _join(self, node: ast.Call) -> str | None:
        sep = self.fold(node.func.value)
        if sep is None or len(node.args) != 1 or node.keywords or not isinstance(node.args[0], (ast.List, ast.Tuple)):
            return None
        parts = [self.fold(e) for e in node.args[0].elts]
        if None in parts or sum(map(len, parts)) + len(sep) * len(parts) > MAX_LENGTH:
            return None
        return sep.join(parts)

    def _binding(self, node: ast.AST) -> dict[str, str]:
        """The names a statement binds to a constant string (with the names known before it)."""
        if isinstance(node, ast.Assign):
            value = self.fold(node.value)
            self._folded = (node.value, value)  # its walk, next, reads it from here
            return {t.id: value for t in node.targets if isinstance(t, ast.Name)} if value is not None else {}
        if isinstance(node, (ast.AnnAssign, ast.NamedExpr)) and isinstance(node.target, ast.Name) and node.value:
            value = self.fold(node.value)
            self._folded = (node.value, value)
            return {node.target.id: value} if value is not None else {}
        if isinstance(node, ast.AugAssign) and isinstance(node.op, ast.Add) and isinstance(node.target, ast.Name):
            value = _concat(self.names.get(node.target.id), self.fold(node.value))
            return {node.target.id: value} if value is not None else {}
        return {}


def _children(node: ast.AST) -> Iterator[ast.AST]:
    """``node``'s children in the order they run: an assignment's value before its targets."""
    if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.NamedExpr)):
        if node.value is not None:
            yield node.value
        yield from getattr(node, "targets", None) or [node.target]
        return
    yield from ast.iter_child_nodes(node)


def _pieced(node: ast.expr) -> bool:
    """Whether the value is not already in the cell's text on one line: a name, or a literal written whole,
    is scanned where its value was written."""
    if isinstance(node, ast.Name):
        return False
    return not isinstance(node, ast.Constant) or node.lineno != node.end_lineno


def _concat(left: str | None, right: str | None) -> str | None:
    if left is None or right is None or len(left) + len(right) > MAX_LENGTH:
        return None
    return left + right


def _plain_fields(template: str) -> bool:
    """A ``.format`` template whose fields are positions or names, with small literal specs only (no
    attribute or item lookups, no nested fields)."""
    for _, field, spec, _ in string.Formatter().parse(template):
        if field is not None and (re.search(r"[.\[]", field) or _BIG_SPEC.search(spec or "")):
            return False
    return True
