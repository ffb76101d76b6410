"""Running the planned rules over a cell: ``rewrite``.

Only the plan's chunks are parsed with libcst (``chunk.Chunk``); the lines between them stay as cleaned. The
statement rules run one by one, then the expression rules in one walk (``_Walk``: each statement walked only
by the rules whose check touches it, never into whitespace, punctuation or literal arguments), and their
notes become lines of the cleaned cell, so the script can say what changed and where.
"""

from __future__ import annotations

import ast

import libcst as cst
from libcst.metadata import MetadataWrapper, PositionProvider

from ..ast_helpers import first_line
from ..code import CellCode
from ..cst_helpers import code_of
from ..facts import JobFacts
from ..lines import align
from .chunk import Chunk
from .plan import Plan
from .rule import Rule


def _subclasses(*bases: type) -> frozenset[type]:
    found, todo = set(), list(bases)
    while todo:
        cls = todo.pop()
        found.add(cls)
        todo += cls.__subclasses__()
    return frozenset(found)


#: Whitespace, comments, operators and punctuation: no rule rewrites them, so no walk goes into them (about
#: half of a statement's nodes).
_TRIVIA = _subclasses(
    cst.BaseParenthesizableWhitespace, cst.TrailingWhitespace, cst.EmptyLine, cst.Newline, cst.Comment,
    cst.Semicolon, cst.Colon, cst.Comma, cst.Dot, cst.AssignEqual, cst.ImportStar, cst.BaseUnaryOp,
    cst.BaseBooleanOp, cst.BaseBinaryOp, cst.BaseCompOp, cst.BaseAugOp, cst.LeftParen, cst.RightParen,
    cst.LeftSquareBracket, cst.RightSquareBracket, cst.LeftCurlyBrace, cst.RightCurlyBrace,
)
#: Values with nothing inside but trivia: an argument holding one is not walked unless a rule reads its kind.
_LEAVES = frozenset({cst.Name, cst.Integer, cst.Float, cst.Imaginary, cst.SimpleString, cst.Ellipsis})


class _Walk(cst.CSTTransformer):
    """The libcst walk of one step's rules: each node is offered to each rule in turn, as if each walked alone.

    A rule's ``leave`` gets the node as the rules before it left it; once a rule turns a node into another
    kind (a statement into an ``if``), the rules after it leave that node alone. Walks are what conversion
    time goes to, so the expression rules share one; a statement rule walks alone.
    """

    def __init__(self, rules: list[Rule], skip: set[cst.CSTNode] = frozenset(),
                 only: dict[cst.CSTNode, list[Rule]] | None = None, followed: tuple[set[cst.CSTNode], ...] = ()):
        super().__init__()
        self.rules, self.skip, self.only = rules, skip, only or {}
        #: nodes the facts chose (``Chunk.helper_trainings``, ``Chunk.model_saves``): what a node of a set
        #: becomes joins that set
        self.followed = followed
        self._stack: list[list[Rule]] = []  # the rules that saw each node being walked

    def on_visit(self, node: cst.CSTNode) -> bool:
        # a node in ``only`` is walked by those rules, any other by its parent's; every rule that sees a node
        # sees it leave (its bookkeeping stays balanced); a skipped statement's inside is not walked
        if type(node) in _TRIVIA:
            self._stack.append([])
            return False
        rules = self.only.get(node, self._stack[-1] if self._stack else self.rules)
        self._stack.append(rules)
        walk = all([rule.on_visit(node) is not False for rule in rules]) and node not in self.skip
        if walk and type(node) is cst.Arg and type(node.value) in _LEAVES:
            # ``lr=2e-4``: walked only if a rule reads such a value itself (DeviceRule reads strings)
            return any(rule.reads(node.value) for rule in rules)
        return walk

    def on_leave(self, original, updated):
        for rule in self._stack.pop():
            if type(updated) is not type(original):
                break
            updated = rule.on_leave(original, updated)
        for chosen in self.followed:
            if original in chosen:
                chosen.add(updated)
        return updated

    # libcst offers each attribute of each node to ``visit_<Node>_<attribute>`` methods; rules have none
    def on_visit_attribute(self, node: cst.CSTNode, attribute: str) -> None:
        pass

    def on_leave_attribute(self, original: cst.CSTNode, attribute: str) -> None:
        pass


def rewrite(cell: CellCode, plan: Plan, facts: JobFacts) -> tuple[str, list[tuple[str, int, str]]]:
    """Run the planned rules over a cell; return its new code and ``(rule, line, message)`` for each change.

    Only the plan's chunks are parsed with libcst; the lines between them stay as they are. The statement
    rules run one by one, then the expression rules together (``_Walk``), each step on every chunk of
    the cell as the steps before it left them. A step that notes nothing leaves the cell as it was. Raises
    ``CodeError`` where libcst cannot parse a chunk.
    """
    chunks = [Chunk(cell, stmts, facts, plan) for stmts in plan.chunks]
    changes: list[tuple[str, int, str]] = []
    for step in plan.steps:
        ran = [_run(step, chunk, plan, facts) for chunk in chunks]
        if any(rule.changes for rules, _ in ran for rule in rules):
            changes += _changes(cell, chunks, [rules for rules, _ in ran])
            for chunk, (_, new) in zip(chunks, ran):
                chunk.module, chunk.code = new, None
    return (_join(cell, chunks) if changes else cell.code), changes


def _run(step: tuple[type[Rule], ...], chunk: Chunk, plan: Plan, facts: JobFacts):
    """One step's rules over one chunk: the rules (with their notes) and the chunk as they leave it."""
    rules = [rule(facts, chunk) for rule in step]
    followed = (chunk.helper_trainings, chunk.model_saves)
    if step[0].on_statements:
        walker = _Walk(rules, followed=followed)
    elif plan.touching is None:  # the chunk's statements none of the rules could change are not walked
        walker = _Walk(rules, {n for n, s in zip(chunk.parsed.body, chunk.statements) if s not in plan.walked},
                       followed=followed)
    else:  # each statement is walked by the rules that may change it, if any
        only = {node: [r for r in rules if type(r) in plan.touching[s]]
                for node, s in chunk.statement_of.items() if s in plan.touching}
        walker = _Walk(rules, {n for n, s in chunk.statement_of.items() if s not in plan.touching}, only, followed)
    return rules, chunk.module.visit(walker)


def _changes(cell: CellCode, chunks: list[Chunk], ran: list[list[Rule]]) -> list[tuple[str, int, str]]:
    """A step's notes as ``(rule, line, message)``, rule by rule, as if each rule had walked the whole cell.

    A note's line is its node's line in the code as the step found it, mapped back to the cleaned code by
    line alignment, so every change is reported at a line of the cleaned cell.
    """
    current = _join(cell, chunks)
    back = align(cell.code.splitlines(), current.splitlines()) if current != cell.code else None
    located = {}  # (chunk, rule) → the lines of the rule's notes in the current code
    offset, at = 0, 1  # lines of the current code before the chunk; the cell's line after the last chunk
    for k, (chunk, rules) in enumerate(zip(chunks, ran)):
        offset += chunk.first - at
        # as parsed, the chunk's statements start where the cell's do
        spans = None if chunk.module is not chunk.parsed else (
            [s.first - chunk.first + 1 for s in chunk.statements],
            [max(n.end_lineno for n in s.nodes) - chunk.first + 1 for s in chunk.statements],
        )
        for i, rule in enumerate(rules):
            if rule.changes:
                noted = [(node, top) for node, top, _ in rule.changes]
                lines = _note_lines(chunk, noted, spans)
                located[k, i] = [offset + line for line in lines]
        offset += len(chunk.current().splitlines())
        at = chunk.end
    out = []
    for i in range(len(ran[0]) if ran else 0):
        for k, rules in enumerate(ran):
            for (node, _, msg), line in zip(rules[i].changes, located.get((k, i), ())):
                if node in rules[i].cell_lines:
                    out.append((rules[i].name, rules[i].cell_lines[node], chunks[k].restore(msg)))
                    continue
                j = back[line - 1] if back is not None and 0 < line <= len(back) else line - 1
                out.append((rules[i].name, (j if j is not None else line - 1) + 1, chunks[k].restore(msg)))
    return out


def _join(cell: CellCode, chunks: list[Chunk]) -> str:
    """The cell's code: the chunks as the rules left them, the lines between them as they were."""
    out, at = [], 1
    for chunk in chunks:
        out += cell.lines[at - 1 : chunk.first - 1]
        out.append(chunk.current())
        at = chunk.end
    out += cell.lines[at - 1 :]
    return "".join(out)


def _note_lines(
    chunk: Chunk, noted: list[tuple[cst.CSTNode, int | None]], spans: tuple[list[int], list[int]] | None = None
) -> list[int]:
    """The line of each noted node in the chunk's code as it stands (``spans``: its statements' first and
    last lines, when known).

    libcst's ``PositionProvider`` would generate the whole module's source with positions; instead each
    top-level statement's first line comes from Python's own parser, and a node inside a statement is found
    in the statement's text by its own source, stand-ins restored (the k-th node with the same source is its
    k-th occurrence; a node noted twice is found once). Positions are the fallback when that fails, a
    stand-in above counting as the lines it stands for.
    """
    module, code = chunk.module, chunk.current()
    starts, ends = spans or _statement_spans(module.body, code)
    texts = _statement_texts(code, starts)
    seen: dict[tuple[int, str], int] = {}
    found: dict[cst.CSTNode, int] = {}
    out = []
    for node, top in noted:
        if node in found:
            out.append(found[node])
            continue
        line = None
        if top is not None and (node is module.body[top] or starts[top] == ends[top]):
            line = starts[top]  # the statement itself, or a node in a statement of one line
        elif top is not None:
            if isinstance(node, cst.BaseStatement):  # its comments above are not where it starts
                node_code = chunk.restore(code_of(node.with_changes(leading_lines=[]))).strip()
            else:
                node_code = chunk.restore(code_of(node)).strip()
            nth = seen.get((top, node_code), 0)
            seen[(top, node_code)] = nth + 1
            at = -1
            for _ in range(nth + 1):
                at = texts[top].find(node_code, at + 1)
                if at < 0:
                    break
            if at >= 0:
                line = starts[top] + texts[top].count("\n", 0, at)
        if line is None:
            positions = MetadataWrapper(module, unsafe_skip_copy=True).resolve(PositionProvider)
            line = chunk.line_in_current(positions[node].start.line)
        found[node] = line
        out.append(line)
    return out


def _statement_spans(body: list[cst.BaseStatement], code: str) -> tuple[list[int], list[int]]:
    """The first and last line of each top-level statement of ``body`` in ``code``, from Python's own parser
    (fast)."""
    tree = ast.parse(code)
    starts, ends, k = [], [], 0
    for stmt in body:
        starts.append(first_line(tree.body[k]))
        k += len(stmt.body) if isinstance(stmt, cst.SimpleStatementLine) else 1
        ends.append(tree.body[k - 1].end_lineno)
    return starts, ends


def _statement_texts(code: str, starts: list[int]) -> list[str]:
    """The source text of each top-level statement starting at ``starts`` (with the comments after it)."""
    lines = code.splitlines(keepends=True)
    starts = starts + [len(lines) + 1]
    return ["".join(lines[a - 1 : b - 1]) for a, b in zip(starts, starts[1:])]
