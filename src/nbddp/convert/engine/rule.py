"""The base of every rewrite rule: where it has work, asked with Python's ``ast``, and what it does, with libcst.

A rule is one class, in a module of its own under ``convert/rules/``, listed once in ``rules.RULES``:

- its *check*, class methods asked before libcst reads anything, from cheapest to dearest: ``wanted`` (may
  the rule have anything to do in this cell: the cell's text, the notebook's facts), ``could_change`` (in
  this statement: its text; the expression rules walk only the statements whose text one of them could
  change), ``touches`` (does the statement hold something the rule rewrites or notes: its ast nodes). A
  check may say yes where the rule then does nothing, never the reverse: a statement no check touches keeps
  its cleaned source as it is, without a libcst parse. ``keywords`` lists the keyword arguments the rule
  reads; libcst reads stand-ins for the others (``plan.Plan``).
- its *rewrite*: ``visit_<Node>``/``leave_<Node>`` methods over libcst nodes, as a libcst transformer has
  them, and ``note`` for each change, which the engine turns into a line of the cell.

A rule is not itself a libcst transformer: the engine's walk (``rewrite.py``) drives it, so several rules
share one walk, and a rule's module imports no libcst (``cst_helpers.cst`` loads it at the first use, and
the checks run for every cell of every notebook while libcst is needed only where a check says yes).

Two kinds of rule:

- *statement rules* (``on_statements``) act on the top-level statements ``gather_facts`` picked out. They
  run first, one after the other, and find their statements through the chunk (``Rule.statement``), so the
  choice is made once for the whole notebook. ``BlockRule`` puts each run of such statements into a block.
- *expression rules* rewrite calls, arguments and loops wherever they are, together in one walk.

No rule looks inside an ``if False:`` block: notebooks keep optional steps there (GGUF export, pushing to
the Hub), and they stay exactly as written.
"""

from __future__ import annotations

import ast
import functools
import re
from typing import TYPE_CHECKING

from ..cst_helpers import cst, is_dead_if

if TYPE_CHECKING:
    from ..code import CellCode, Statement
    from ..facts import JobFacts


class Rule:
    """Base: a rule's check (class methods) and its rewrite (``visit_X``/``leave_X``), with its notes.

    A rule runs on one chunk of a cell at a time (``chunk.Chunk``: consecutive top-level statements parsed
    together). The noted nodes are nodes of the module the rule was given; ``rewrite`` turns them into lines
    of the cell.
    """

    #: what the change list calls the rule
    name = "rule"
    #: a statement rule: it runs alone, before the expression rules, on the statements the facts chose
    on_statements = False
    #: it walks into every statement of its chunks, and libcst rebuilds every node it walks: the expression
    #: rules after it then walk every statement of the cell, and libcst reads no stand-in there
    walks_inside = False
    #: what a cell's or statement's text must contain for the rule to have work (None: anything)
    pattern: re.Pattern | None = None
    #: the keyword arguments whose presence or value the rule reads in a statement it may change; the
    #: others, where they hold nothing the check touches, are read by libcst as stand-ins
    #: (``Plan.arguments``). None: the rule may read any argument, and any statement inside a block.
    keywords: frozenset[str] | None = None

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if any(name.count("_") > 1 and name.startswith(("visit_", "leave_")) for name in vars(cls)):
            raise TypeError(f"{cls.__name__}: rules have no visit_<Node>_<attribute> methods (not dispatched)")

    # -- the check

    @classmethod
    def wanted(cls, cell: CellCode, facts: JobFacts) -> bool:
        return cls.could_change(cell.code, facts)

    @classmethod
    def could_change(cls, text: str, facts: JobFacts) -> bool:
        return cls.pattern is None or cls.pattern.search(text) is not None

    @classmethod
    def touches(cls, stmt: Statement, facts: JobFacts, nodes: list[ast.AST]) -> bool:
        """Whether the rule may rewrite or note something in ``stmt`` (``nodes``: every node in it)."""
        return True

    # -- the rewrite

    def __init__(self, facts: JobFacts, chunk):
        """``chunk``: the ``chunk.Chunk`` the rule runs on (not named here: ``chunk.py`` imports ``plan.py``, which
        names the rules)."""
        self.facts, self.chunk = facts, chunk
        #: (node, index of the top-level statement holding it, message)
        self.changes: list[tuple[cst.CSTNode, int | None, str]] = []
        #: noted nodes whose line in the cleaned cell the rule knows (statements the facts chose by line):
        #: said at that line rather than found by their text, which an earlier statement may repeat
        self.cell_lines: dict[cst.CSTNode, int] = {}
        self._top: dict[cst.CSTNode, int] = {}
        self._current: int | None = None

    def on_visit(self, node: cst.CSTNode) -> bool:
        """The walk entering ``node``: False to keep out of it."""
        if isinstance(node, cst.Module):
            self._top = {stmt: i for i, stmt in enumerate(node.body)}
        elif node in self._top:
            self._current = self._top[node]
        visit = _method(type(self), "visit_" + type(node).__name__)
        return visit is None or visit(self, node) is not False

    def on_leave(self, original: cst.CSTNode, updated: cst.CSTNode):
        """The walk leaving ``original``, whose children are now those of ``updated``: what replaces it."""
        leave = _method(type(self), "leave_" + type(original).__name__)
        return updated if leave is None else leave(self, original, updated)

    @classmethod
    def reads(cls, node: cst.CSTNode) -> bool:
        """Whether the rule has a ``visit_``/``leave_`` method for nodes of this kind."""
        kind = type(node).__name__
        return _method(cls, "visit_" + kind) is not None or _method(cls, "leave_" + kind) is not None

    def statement(self, node: cst.CSTNode) -> Statement | None:
        """The notebook's top-level statement a top-level node of the chunk stands for (None for a new node)."""
        return self.chunk.statement_of.get(node)

    def visit_If(self, node: cst.If) -> bool:
        return not is_dead_if(node)

    def note(self, node: cst.CSTNode, message: str) -> None:
        self.changes.append((node, self._top.get(node, self._current), message))


@functools.cache
def _method(cls: type, name: str):
    """A rule class's own ``visit_X``/``leave_X`` function, or None: found once per kind of node rather than
    looked up by name for each node a walk meets."""
    return next((vars(klass)[name] for klass in cls.__mro__ if name in vars(klass)), None)


class BlockRule(Rule):
    """Base of the statement rules that put each run of consecutive chosen top-level statements into a block."""

    on_statements = True

    def picks(self, stmt: Statement | None) -> bool:
        """Whether the rule takes this top-level statement of the notebook."""
        raise NotImplementedError

    def block(self, run: list[cst.BaseStatement]) -> cst.BaseCompoundStatement:
        """The block holding a run of chosen statements (build its body with ``inside(run)``)."""
        raise NotImplementedError

    def message(self, run: list[cst.BaseStatement]) -> str:
        raise NotImplementedError

    def after(self, run: list[cst.BaseStatement]) -> list[cst.BaseStatement]:
        """Statements that follow the block (none unless a rule says)."""
        return []

    def inside(self, run: list[cst.BaseStatement]) -> list[cst.BaseStatement]:
        """The run as a block's body: the block takes the first statement's comments and blank lines above."""
        first = run[0].with_changes(leading_lines=[])
        self.chunk.statement_of[first] = self.statement(run[0])
        return [first] + run[1:]

    def visit_Module(self, node: cst.Module) -> bool:
        return False  # top-level statements only; they stay the very nodes the chunk maps to statements

    def leave_Module(self, original: cst.Module, updated: cst.Module) -> cst.Module:
        body: list[cst.BaseStatement] = []
        run: list[cst.BaseStatement] = []

        def flush():
            if run:
                body.append(self.block(run).with_changes(leading_lines=run[0].leading_lines))
                body.extend(self.after(run))
                self.note(run[0], self.message(run))
                run.clear()

        for stmt in original.body:
            if self.picks(self.statement(stmt)):
                run.append(stmt)
            else:
                flush()
                body.append(stmt)
        flush()
        return updated.with_changes(body=body)
