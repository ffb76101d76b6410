"""Which rules a cell runs and on which statements, decided with Python's ``ast``: libcst parses only those.

``plan_cell`` asks each rule's check (``rule.Rule``) about the cell and its statements and puts the answers
together: which rules run, step by step (each statement rule alone, then the expression rules together), and
the runs of consecutive statements they run on (``Plan.chunks``), with what in them libcst may read as a
stand-in because no rule reads it. ``tests/test_convert_fast.py`` converts the corpus with and without the
checks and expects the same scripts.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..ast_helpers import compound_bodies, is_compound
from ..code import CellCode, Statement, group_lines

if TYPE_CHECKING:
    from ..facts import JobFacts
    from .rule import Rule


@dataclass
class Plan:
    """What rewriting one cell takes.

    ``steps``: the rules to run, each statement rule alone, then the expression rules together. ``chunks``:
    runs of consecutive top-level statements that some rule may change or note; only these are parsed with
    libcst. ``walked``: the statements the expression rules walk (their text matches one of them).
    ``touching``: for each statement an expression rule may change, those rules (the others leave it
    alone); None when every rule walks every walked statement.
    """

    steps: list[tuple[type[Rule], ...]]
    chunks: list[list[Statement]]
    walked: set[Statement]
    touching: dict[Statement, tuple[type[Rule], ...]] | None = None
    #: simple statements of the chunks that only a statement rule moves into a block: libcst reads a
    #: one-line stand-in for each rather than the statement (``chunk.Chunk``)
    stand_ins: frozenset[Statement] = frozenset()
    #: for statements the expression rules may change, runs of keyword arguments none of them reads: libcst
    #: reads one stand-in argument for each run (``chunk.Chunk``)
    arguments: dict[Statement, list[list[ast.keyword]]] = field(default_factory=dict)
    #: for statements the expression rules may change, runs of statements inside their blocks that none of
    #: them changes: libcst reads one line for each run, at its indentation (``chunk.Chunk``)
    inner: dict[Statement, list[list[ast.stmt]]] = field(default_factory=dict)


def plan_cell(cell: CellCode, facts: JobFacts, rules: tuple[type[Rule], ...], *,
              every_statement: bool = False) -> Plan | None:
    """The rules of ``rules`` (``rules.RULES``) a cell runs and the statements they run on; None when no rule
    has anything to do there.

    ``every_statement``: run the wanted rules over the whole cell, as if every statement were touched (the
    reference the checks are tested against).
    """
    wanted = [rule for rule in rules if rule.wanted(cell, facts)]
    if not wanted or not cell.statements:
        return None
    statement = [rule for rule in wanted if rule.on_statements]
    expression = tuple(rule for rule in wanted if not rule.on_statements)
    walked = {s for s in cell.statements if any(rule.could_change(s.text, facts) for rule in expression)}
    steps = [(rule,) for rule in statement] + ([expression] if expression else [])
    if every_statement:
        return Plan(steps, [list(cell.statements)], walked)
    # where a rule that walks inside statements rewrites the cell, libcst rebuilds every node it walked, and
    # the expression rules then walk every statement, not only those their text matches
    inside = [rule for rule in wanted if rule.walks_inside]
    everywhere = any(rule.touches(s, facts, []) for rule in inside for s in cell.statements)
    found = _Touched(cell, facts, statement, expression, None if everywhere else walked)
    if not found.chunks:
        return None
    if inside:  # such a rule reads every statement whole: no stand-ins
        return Plan(steps, found.chunks, walked, found.rules)
    return Plan(steps, found.chunks, walked, found.rules, *_stand_ins(found, facts))


class _Touched:
    """The statements of a cell some rule touches, in runs of consecutive ones (``chunks``); for each one an
    expression rule touches, those rules (``rules``) and its nodes (``nodes``); and the statements a statement
    rule moves into a block (``moved``). ``walked``: the statements the expression rules look at (None: all).
    """

    def __init__(self, cell: CellCode, facts: JobFacts, statement: list[type[Rule]],
                 expression: tuple[type[Rule], ...], walked: set[Statement] | None):
        self.chunks: list[list[Statement]] = []
        self.rules: dict[Statement, tuple[type[Rule], ...]] = {}
        self.nodes: dict[Statement, list[ast.AST]] = {}  # every node of each statement an expression rule may change
        self.moved: set[Statement] = set()
        previous = None
        for stmt in cell.statements:
            touched = any(rule.touches(stmt, facts, []) for rule in statement)
            if touched:
                self.moved.add(stmt)
            if expression and (walked is None or stmt in walked):
                nodes = [n for node in stmt.nodes for n in ast.walk(node)]
                if rules := tuple(rule for rule in expression if rule.touches(stmt, facts, nodes)):
                    self.rules[stmt], self.nodes[stmt] = rules, nodes
                    touched = True
            if touched:
                if previous is not None and previous == stmt.index - 1:
                    self.chunks[-1].append(stmt)
                else:
                    self.chunks.append([stmt])
                previous = stmt.index


def _stand_ins(found: _Touched, facts: JobFacts):
    """What libcst may read as stand-ins in the chunks: ``Plan.stand_ins``, ``Plan.arguments``, ``Plan.inner``."""
    stand_ins = frozenset(
        stmt for chunk in found.chunks for stmt in chunk
        if stmt not in found.rules and not any(is_compound(node) for node in stmt.nodes)
        and not _multiline_fstring(stmt)
    )
    arguments, inner = {}, {}
    for stmt, rules in found.rules.items():
        if any(rule.keywords is None for rule in rules) or len(stmt.text) < _WORTH_STANDING_IN:
            continue  # a rule that may read anything in the statement, or little to save
        if stmt not in found.moved and (groups := _untouched_inside(stmt, facts, rules)):
            inner[stmt] = groups
        skip = {id(n) for group in inner.get(stmt, ()) for node in group for n in ast.walk(node)}
        if runs := _unread_arguments(stmt, facts, rules, found.nodes[stmt], over_lines=stmt not in found.moved,
                                     skip=skip):
            arguments[stmt] = runs
    return stand_ins, arguments, inner


def _multiline_fstring(stmt: Statement) -> bool:
    """An f-string over several lines: libcst indents the lines inside its fields (no stand-in for it)."""
    if not _FSTRING.search(stmt.text) or all(node.end_lineno == node.lineno for node in stmt.nodes):
        return False
    return any(isinstance(n, ast.JoinedStr) and n.end_lineno != n.lineno for node in stmt.nodes for n in ast.walk(node))


#: Where an f-string may start (a false "yes" only costs a walk).
_FSTRING = re.compile(r"[fF][rRbB]?['\"]")
#: Statements shorter than this are read by libcst whole: a stand-in would save next to nothing.
_WORTH_STANDING_IN = 100


def _untouched_inside(stmt: Statement, facts: JobFacts, rules: tuple[type[Rule], ...]) -> list[list[ast.stmt]]:
    """Runs of consecutive statements inside ``stmt``'s blocks (on lines of their own) that none of
    ``rules`` touches.

    Such a rule acts on the nodes its check touches and reads nothing around them (its keywords are
    listed), so these statements come back as written; the outermost ones are taken.
    """
    cell, found = stmt.cell, []

    def visit(body: list[ast.stmt]) -> None:
        run: list[ast.stmt] = []  # consecutive statements no rule touches: one stand-in
        for group in group_lines(body, cell):
            first = group[0]
            start = getattr(first, "decorator_list", None) and first.decorator_list[0] or first
            if cell.line_bytes(start.lineno)[: start.col_offset].strip():  # shares its line with a header
                return
            if not any(rule.touches(stmt, facts, [n for node in group for n in ast.walk(node)]) for rule in rules):
                run += group
                continue
            if run:
                found.append(run)
                run = []
            if is_compound(first):
                for sub in compound_bodies(first):
                    visit(sub)
        if run:
            found.append(run)

    for node in stmt.nodes:
        if is_compound(node):
            for body in compound_bodies(node):
                visit(body)
    return found


def _unread_arguments(
    stmt: Statement, facts: JobFacts, rules: tuple[type[Rule], ...], nodes: list[ast.AST], over_lines: bool,
    skip: set[int],
) -> list[list[ast.keyword]]:
    """Runs of consecutive keyword arguments in ``stmt``'s calls that none of ``rules`` reads or may change.

    A rule reads the keywords its check lists; an argument holding anything a check touches (a nested
    trainer configuration, a ``"cuda:0"``) is read too. A call's last two arguments are always read (a new
    keyword argument is written the way they are), and so are positional ones. A run is worth a stand-in
    when it has two arguments or a long one. ``over_lines``: a run may span lines (the statement stays
    where it is; a statement rule moving it into a block would indent the lines inside the run). ``skip``:
    the ``id`` of nodes already stood in for; ``nodes``: every node of ``stmt``, outer ones first.
    """
    read = frozenset().union(*(rule.keywords for rule in rules))
    runs: list[list[ast.keyword]] = []
    taken: list[tuple[tuple[int, int], tuple[int, int]]] = []  # the spans of the runs found

    def unread(kw: ast.keyword) -> bool:
        return (kw.arg is not None and kw.arg not in read and (over_lines or kw.lineno == kw.end_lineno)
                and not any(rule.touches(stmt, facts, list(ast.walk(kw.value))) for rule in rules))

    for call in nodes:  # outer calls first: a call inside a run already found is left alone
        if not isinstance(call, ast.Call) or len(call.args) + len(call.keywords) < 3 or id(call) in skip:
            continue
        where = (call.lineno, call.col_offset)
        if any(a <= where < b for a, b in taken):
            continue
        ordered = sorted([*call.args, *call.keywords], key=lambda n: (n.lineno, n.col_offset))[:-2]
        run: list[ast.keyword] = []
        for arg in ordered + [None]:
            if isinstance(arg, ast.keyword) and unread(arg) and (over_lines or not run or arg.lineno == run[0].lineno):
                run.append(arg)
                continue
            if len(run) > 1 or run and (run[0].end_lineno > run[0].lineno or run[0].end_col_offset - run[0].col_offset >= 40):
                runs.append(run)
                taken.append(((run[0].lineno, run[0].col_offset), (run[-1].end_lineno, run[-1].end_col_offset)))
            run = [arg] if isinstance(arg, ast.keyword) and unread(arg) else []
    return runs
