"""A cleaned cell's code as the facts, the checks and the rules read it.

``CellCode`` holds a cell's code, its ``ast`` tree and its top-level ``Statement``s, counted the way libcst
counts them (a compound statement, or one line of simple statements: ``a = 1; b = 2`` is one), so a
statement the facts chose is one node of the module libcst parses. ``CodeError`` is code the converter
cannot read or convert, at a line of that code; whoever knows the cell maps it to the cell's line.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from functools import cached_property

from .ast_helpers import all_statements, first_line, is_compound


class CodeError(Exception):
    """Code the converter cannot read or convert, at a line (1-based) of the code it was given: a magic with no
    meaning in a script, Python libcst cannot parse, a rewrite that does not parse."""

    def __init__(self, message: str, line: int):
        super().__init__(message)
        self.message, self.line = message, line


@dataclass(eq=False)
class Statement:
    """One top-level statement of a cleaned cell, as libcst counts statements.

    ``nodes`` are its ast statements (several for ``a = 1; b = 2``), ``first`` its first line in the cell (a
    decorator's line for a decorated definition). The rest is filled in by ``gather_facts``.
    """

    cell: CellCode
    index: int
    nodes: list[ast.stmt]
    first: int
    #: the calls it makes itself (outside function bodies, lambdas and ``if False:``), in source order
    calls: list[ast.Call] = field(default_factory=list)
    #: those of ``calls`` that are not inside a class body either
    plain_calls: list[ast.Call] = field(default_factory=list)
    #: names it binds at the notebook's top level, and names it reads (attributes and keywords are not reads)
    binds: set[str] = field(default_factory=set)
    reads: set[str] = field(default_factory=set)

    @cached_property
    def text(self) -> str:
        """Its source, with the comments and blank lines up to the next statement."""
        statements = self.cell.statements
        end = statements[self.index + 1].first - 1 if self.index + 1 < len(statements) else len(self.cell.lines)
        return "".join(self.cell.lines[self.first - 1 : end])

    def __repr__(self) -> str:
        return f"<Statement {self.index} of cell {self.cell.position}, line {self.first}>"


@dataclass(eq=False)
class CellCode:
    """A cleaned cell's code, its ast and its top-level statements: what the facts and the rules work on."""

    code: str
    tree: ast.Module
    #: the cell's place among the converted cells (0-based)
    position: int = 0
    statements: list[Statement] = field(default_factory=list)

    @classmethod
    def read(cls, code: str, tree: ast.Module | None = None, position: int = 0) -> CellCode:
        """Read cleaned code (already parsed into ``tree`` when the caller has it)."""
        cell = cls(code, tree if tree is not None else ast.parse(code), position)
        cell.statements = [
            Statement(cell, i, group, first_line(group[0])) for i, group in enumerate(group_lines(cell.tree.body, cell))
        ]
        return cell

    @cached_property
    def lines(self) -> list[str]:
        return self.code.splitlines(keepends=True)

    @cached_property
    def default_indent(self) -> str:
        """The indentation of the cell's first indented block, as libcst detects it ("    " without one).

        A statement parsed on its own with libcst would otherwise guess its own, and a block a rule adds would
        be indented differently from the rest of the cell.
        """
        first = None  # the first line that starts an indented block: a statement's, or a ``case``'s
        for node in all_statements(self.tree.body):
            if isinstance(node, ast.Match):
                line, col = node.cases[0].pattern.lineno, None
            elif node.col_offset:
                line, col = node.lineno, node.col_offset
            else:
                continue
            if first is None or line < first:
                text = self.lines[line - 1]
                if col is None or len(text.encode()) - len(text.lstrip().encode()) == col:
                    first = line
        if first is None:
            return "    "
        text = self.lines[first - 1]
        return text[: len(text) - len(text.lstrip())]

    def source(self, node: ast.AST) -> str:
        if node.lineno == node.end_lineno:  # ast's own way splits the whole cell into lines each time
            return self.line_bytes(node.lineno)[node.col_offset : node.end_col_offset].decode()
        return ast.get_source_segment(self.code, node) or ""

    def line_bytes(self, line: int) -> bytes:
        return self.lines[line - 1].encode()


def group_lines(body: list[ast.stmt], cell: CellCode) -> list[list[ast.stmt]]:
    """The statements of a block as libcst counts them: simple statements on one logical line are one."""
    groups: list[list[ast.stmt]] = []
    for node in body:
        if groups and not is_compound(node) and not is_compound(groups[-1][-1]) and _same_line(groups[-1][-1], node, cell):
            groups[-1].append(node)
        else:
            groups.append([node])
    return groups


def _same_line(before: ast.stmt, after: ast.stmt, cell: CellCode) -> bool:
    """Whether ``after`` follows ``before`` on its logical line (``a = 1; b = 2``)."""
    if after.lineno != before.end_lineno and not cell.lines[before.end_lineno - 1].rstrip().endswith("\\"):
        return False
    between = b"".join(cell.line_bytes(n) for n in range(before.end_lineno, after.lineno + 1))
    start = before.end_col_offset
    end = len(between) - len(cell.line_bytes(after.lineno)) + after.col_offset
    return b";" in re.sub(rb"#[^\n]*", b"", between[start:end])
