"""The names a notebook binds to ``nn.DataParallel``, followed cell after cell, and whether it calls it at all.

``rules/data_parallel.py`` rewrites the calls; ``gather_facts`` asks ``calls_data_parallel`` before any cell is
rewritten, since a loader made above the call is sized for it (``rules/sampler.py``).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .. import ast_helpers

if TYPE_CHECKING:
    from ..code import CellCode, Statement

#: What ``torch.nn.DataParallel`` is, by whichever module path a notebook reaches it.
DATA_PARALLEL = frozenset({"torch.nn.DataParallel", "torch.nn.parallel.DataParallel",
                           "torch.nn.parallel.data_parallel.DataParallel"})
#: What a name the notebook never binds stands for: notebooks use ``nn.DataParallel`` and ``DataParallel`` with
#: their imports in a cell nbddp does not see (``%run``, a star import) as often as with them.
UNBOUND = {"torch": "torch", "nn": "torch.nn", "parallel": "torch.nn.parallel", "DataParallel": "torch.nn.DataParallel"}


def calls_data_parallel(codes: list[CellCode]) -> bool:
    """Whether the cells call ``nn.DataParallel`` anywhere, by whichever name they bind to it (read in order, as
    the rule reads them), under an ``if`` or not: known before any cell is rewritten, so a loader made above
    the call is sized for it (``rules/sampler.py``)."""
    names = Names()
    for code in codes:
        names.read(code)
    return any(names.spellings(stmt) for code in codes for stmt in code.statements)


@dataclass
class Names:
    """What each name stands for (a dotted path: ``DP`` → ``torch.nn.DataParallel``, ``tnn`` → ``torch.nn``;
    None for anything else) as the notebook's top-level code binds it, cell after cell.

    The planner asks the rule about the cells in order (``wanted``), so each cell's bindings are read before
    any cell below is planned: a call follows the bindings above it, in its cell and the cells before.
    """

    cells: dict[int, CellCode] = field(default_factory=dict)
    #: names ever bound to DataParallel itself (``DP``): what a statement's text is searched for
    aliases: set[str] = field(default_factory=set)
    _starts: dict[int, dict[str, str | None]] = field(default_factory=dict)  # cell position → bindings above it
    _spelled: dict[Statement, frozenset[str]] = field(default_factory=dict)

    def read(self, cell: CellCode) -> None:
        if self.cells.get(cell.position) is cell:
            return
        self.cells[cell.position] = cell
        self._starts = {p: env for p, env in self._starts.items() if p <= cell.position}
        self._spelled = {}
        bound = _bindings(cell.tree.body, self._start(cell.position))
        self.aliases |= {name for _, name, path in bound if path in DATA_PARALLEL}

    def spellings(self, stmt: Statement) -> frozenset[str]:
        """How the statement's calls spell DataParallel (``DP``, ``tnn.DataParallel``), each as bound where it is
        called; a spelling that means something else at another call of the statement is left out."""
        if stmt not in self._spelled:
            before = dict(self._start(stmt.cell.position))
            for node in stmt.cell.statements[: stmt.index]:
                before.update((name, path) for _, name, path in _bindings(node.nodes, before))
            self._spelled[stmt] = _spellings(stmt.nodes, before)
        return self._spelled[stmt]

    def _start(self, position: int) -> dict[str, str | None]:
        """What the names stand for as the cell at ``position`` starts: every cell above it, read in order (from
        the nearest cell whose start is known: each new cell costs one more cell's walk)."""
        if position not in self._starts:
            above = sorted(p for p in self.cells if p < position)
            known = max((p for p in above if p in self._starts), default=None)
            env = dict(self._starts[known]) if known is not None else {}
            for k in above if known is None else [p for p in above if p >= known]:
                env.update((name, path) for _, name, path in _bindings(self.cells[k].tree.body, env))
            self._starts[position] = env
        return self._starts[position]


def _spellings(nodes: list[ast.stmt], env: dict[str, str | None]) -> frozenset[str]:
    bound = _bindings(nodes, env)
    yes, no = set(), set()
    for call in ast_helpers.live_calls(nodes):
        spelled = ast_helpers.dotted_name(call.func)
        if spelled is None:
            continue
        here = dict(env)
        here.update((name, path) for at, name, path in bound if at <= (call.lineno, call.col_offset))
        (yes if _path(call.func, here) in DATA_PARALLEL else no).add(spelled)
    return frozenset(yes - no)


def _path(expr: ast.AST, env: dict[str, str | None]) -> str | None:
    """The dotted path a ``Name``/``Attribute`` chain reaches (``tnn.DataParallel`` → ``torch.nn.DataParallel``)."""
    if isinstance(expr, ast.Name):
        return env[expr.id] if expr.id in env else UNBOUND.get(expr.id)
    if isinstance(expr, ast.Attribute):
        base = _path(expr.value, env)
        return f"{base}.{expr.attr}" if base else None
    return None


def _bindings(body: list[ast.stmt], env: dict[str, str | None]) -> list[tuple[tuple[int, int], str, str | None]]:
    """Each binding of ``body`` outside function and class bodies, in order: (where it takes effect, the name,
    the dotted path it binds or None). ``env``: what the names stand for before ``body``."""
    env, out = dict(env), []

    def bind(at: ast.AST, name: str, path: str | None) -> None:
        env[name] = path
        out.append(((at.end_lineno, at.end_col_offset), name, path))

    def targets(at: ast.AST, target: ast.AST) -> None:
        for n in ast.walk(target):
            if isinstance(n, ast.Name):
                bind(at, n.id, None)

    def visit(stmts: list[ast.stmt]) -> None:
        for node in stmts:
            if isinstance(node, ast.Import):
                for alias in node.names:
                    top = alias.name.partition(".")[0]
                    bind(node, alias.asname or top, alias.name if alias.asname else top)
            elif isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if alias.name != "*":
                        path = f"{node.module}.{alias.name}" if node.module and not node.level else None
                        bind(node, alias.asname or alias.name, path)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                path = _path(node.value, env)
                for target in getattr(node, "targets", None) or [node.target]:
                    bind(node, target.id, path) if isinstance(target, ast.Name) else targets(node, target)
            elif isinstance(node, ast.AugAssign):
                targets(node, node.target)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                bind(node, node.name, None)
            elif isinstance(node, (ast.For, ast.AsyncFor)):
                targets(node.iter, node.target)
            elif isinstance(node, (ast.With, ast.AsyncWith)):
                for item in node.items:
                    if item.optional_vars is not None:
                        targets(item.context_expr, item.optional_vars)
            if not ast_helpers.is_dead_if(node) and not isinstance(
                    node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                for body in ast_helpers.compound_bodies(node) if ast_helpers.is_compound(node) else ():
                    visit(body)

    visit(body)
    return out
