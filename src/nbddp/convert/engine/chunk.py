"""A chunk: consecutive top-level statements of a cell, parsed with libcst together, as the rules leave them.

libcst's price is for each character it reads, so a chunk is parsed with stand-ins for what no rule reads
(``plan.Plan``): a line naming a statement a statement rule only moves into a block, a line for a run of
statements inside a block no expression rule changes, ``_nbddp_arg_N_=0`` for a run of keyword arguments no
rule reads. ``restore`` puts back what they stand for, as written, or indented as libcst indents a statement
moved into a block.
"""

from __future__ import annotations

import io
import re
import tokenize

import libcst as cst
from libcst.metadata import MetadataWrapper, PositionProvider

from ..code import CellCode, CodeError, Statement
from ..facts import JobFacts
from .plan import Plan


class Chunk:
    """Consecutive top-level statements of a cell, parsed with libcst together, as the rules leave them.

    ``statement_of`` maps the chunk's top-level nodes to the notebook's statements: the nodes as parsed,
    and those a rule rebuilt or copied and kept at the top level.
    """

    def __init__(self, cell: CellCode, statements: list[Statement], facts: JobFacts,
                 plan: Plan | None = None):
        self.cell, self.statements = cell, statements
        self.first = statements[0].first  # its first line in the cell
        nxt = statements[-1].index + 1
        self.end = cell.statements[nxt].first if nxt < len(cell.statements) else len(cell.lines) + 1
        self.code: str | None = "".join(cell.lines[self.first - 1 : self.end - 1])
        #: a stand-in's name → the text it stands for (lines of statements, or keyword arguments)
        self.stood_in: dict[str, str] = {}
        read = self._with_stand_ins(plan) if plan is not None else self.code
        try:
            module = cst.parse_module(read)
        except cst.ParserSyntaxError as exc:
            message = f"the rewriter cannot read this Python: {exc.message}"
            raise CodeError(message, self.first + exc.raw_line - 1) from None
        if len(module.body) != len(statements):  # grouping statements by line went wrong: a bug, say so
            raise AssertionError(f"libcst read {len(module.body)} statements where ast read {len(statements)}")
        # a block a rule adds takes the cell's indentation, not whatever this piece of it would suggest
        self.module = module.with_changes(default_indent=cell.default_indent)
        self.parsed = self.module
        self.statement_of: dict[cst.CSTNode, Statement] = dict(zip(module.body, statements))
        self.wraps_inside = {
            line: names for (position, line), names in facts.ddp_wrap_inside.items()
            if position == cell.position and self.first <= line < self.end
        }
        self._lines: dict[cst.CSTNode, tuple[int, int]] | None = None
        #: the calls to an imported training helper (``JobFacts.helper_trainings``), as parsed; the walks add
        #: each as they rebuild it (``rewrite._Walk``), so a later step's rule finds it still
        self.helper_trainings: set[cst.CSTNode] = self._calls_at({
            (line, column) for position, line, column in facts.helper_trainings
            if position == cell.position and self.first <= line < self.end})
        #: the ``torch.save`` calls pickling a model DDP wraps (``JobFacts.model_saves``), followed the same way
        self.model_saves: set[cst.CSTNode] = self._calls_at({
            (line, column) for position, line, column in facts.model_saves
            if position == cell.position and self.first <= line < self.end})

    def _calls_at(self, places: set[tuple[int, int]]) -> set[cst.CSTNode]:
        """The parsed calls starting at ``places``, (line of the cell, column in characters)."""
        if not places:  # positions cost a pass over the chunk: only where the facts chose a call
            return set()
        columns = {column for _, column in places}
        positions = MetadataWrapper(self.parsed, unsafe_skip_copy=True).resolve(PositionProvider)
        return {node for node, p in positions.items() if isinstance(node, cst.Call) and p.start.column in columns
                and (self.line_in_current(p.start.line) + self.first - 1, p.start.column) in places}

    def _with_stand_ins(self, plan: Plan) -> str:
        """The chunk's code as libcst reads it: stand-ins for what no rule reads (``Plan``).

        A statement of ``plan.stand_ins`` (a simple one, which a statement rule only moves into a block)
        becomes one line that names it; what a rule does to that line, ``restore`` does to the statement's
        lines, as libcst would have (``_indented``). A statement inside a block that no rule changes
        (``plan.inner``) becomes such a line at its own indentation, and a run of keyword arguments no rule
        reads (``plan.arguments``) becomes ``_nbddp_arg_N_=0``; both come back as written. libcst's price is
        for each character it reads: a stand-in is a few.
        """
        lines, out, at = self.cell.lines, [], self.first
        for stmt in self.statements:
            if stmt not in plan.stand_ins and stmt not in plan.arguments and stmt not in plan.inner:
                continue
            last = max(node.end_lineno for node in stmt.nodes)
            out += lines[at - 1 : stmt.first - 1]
            if stmt in plan.stand_ins:
                out.append(self._stand_in("".join(lines[stmt.first - 1 : last]), len(stmt.nodes)))
            else:
                out += self._inside_stood_in(stmt.first, last, plan.arguments.get(stmt, ()), plan.inner.get(stmt, ()))
            at = last + 1
        return "".join(out + lines[at - 1 : self.end - 1])

    def _stand_in(self, text: str, statements: int) -> str:
        """The line standing in for ``text`` (lines of ``statements`` statements at its indentation)."""
        indent = text[: len(text) - len(text.lstrip(" \t"))]
        name = f"_nbddp_stands_in_{len(self.stood_in)}_"
        self.stood_in[name] = text
        return indent + "; ".join([name] * statements) + "\n"  # as many statements as libcst counts

    def _inside_stood_in(self, first: int, last: int, runs, groups) -> list[str]:
        """Lines ``first``…``last`` of the cell with a stand-in for each run of arguments and each run of
        statements inside a block (ast columns are bytes)."""
        raw = [self.cell.line_bytes(n) for n in range(first, last + 1)]
        starts = [0]
        for line in raw:
            starts.append(starts[-1] + len(line))
        at = lambda line, col: starts[line - first] + col  # noqa: E731
        spans = [(at(r[0].lineno, r[0].col_offset), at(r[-1].end_lineno, r[-1].end_col_offset), None) for r in runs]
        for group in groups:  # whole lines
            start = getattr(group[0], "decorator_list", None) and group[0].decorator_list[0] or group[0]
            spans.append((at(start.lineno, 0), at(max(n.end_lineno for n in group) + 1, 0), 1))
        text = b"".join(raw)
        for a, b, statements in sorted(spans, reverse=True):  # from the end, so the earlier offsets hold
            if statements is None:
                name = f"_nbddp_arg_{len(self.stood_in)}_"
                self.stood_in[name] = text[a:b].decode()
                text = text[:a] + f"{name}=0".encode() + text[b:]
            else:
                text = text[:a] + self._stand_in(text[a:b].decode(), statements).encode() + text[b:]
        return text.decode().splitlines(keepends=True)

    def restore(self, code: str) -> str:
        """Code of (part of) the chunk with its stand-ins replaced by what they stand for."""
        if not self.stood_in:
            return code
        # (a name this chunk did not make is left as it is)
        code = _STAND_IN.sub(lambda m: self._back(self.stood_in[m.group(2)], m.group(1)) if m.group(2) in self.stood_in
                             else m.group(0), code)
        return _ARGUMENT.sub(lambda m: self.stood_in.get(m.group(1), m.group(0)), code)

    @staticmethod
    def _back(text: str, indent: str) -> str:
        """Stood-in lines, at the indentation their stand-in came back at."""
        own = text[: len(text) - len(text.lstrip(" \t"))]
        if indent == own:
            return text
        if own:  # only a top-level statement is moved into a block (``plan.plan_cell``)
            raise AssertionError(f"a statement inside a block was moved: {text!r}")
        return _indented(text, indent)

    def line_in_current(self, line: int) -> int:
        """A line of the module's own code as a line of ``current()``: a stand-in above it is as many lines
        as what it stands for."""
        if not self.stood_in:
            return line
        return len(self.restore("".join(self.module.code.splitlines(keepends=True)[: line - 1])).splitlines()) + 1

    def current(self) -> str:
        if self.code is None:
            self.code = self.restore(self.module.code)
        return self.code

    def wrap_inside(self, node: cst.CSTNode) -> list[str] | None:
        """The models DDP wraps right after a statement inside a block (``JobFacts.ddp_wrap_inside``)."""
        lines = self.statement_lines().get(node)
        return self.wraps_inside.get(lines[0]) if lines is not None else None

    def statement_lines(self) -> dict[cst.CSTNode, tuple[int, int]]:
        """The first and last line in the cell of each statement as parsed: how the facts name a statement
        inside a block (by its line). Positions cost a pass over the chunk: only where the facts chose one."""
        if self._lines is None:
            positions = MetadataWrapper(self.parsed, unsafe_skip_copy=True).resolve(PositionProvider)
            self._lines = {n: (p.start.line + self.first - 1, p.end.line + self.first - 1)
                           for n, p in positions.items() if isinstance(n, cst.BaseStatement)}
        return self._lines


#: A stand-in's line as libcst writes it back, at whatever indentation a rule gave it.
_STAND_IN = re.compile(r"^([ \t]*)(_nbddp_stands_in_\d+_)(?:; \2)*\n", re.M)
#: A keyword argument's stand-in.
_ARGUMENT = re.compile(r"(_nbddp_arg_\d+_)=0")


def _indented(text: str, indent: str) -> str:
    """A top-level simple statement's lines, indented as libcst indents the statement inside a block.

    libcst indents every line of it, blank lines and comments inside brackets too, except the lines inside
    a multi-line string and those after a backslash that continues the line. (A multi-line f-string is
    never stood in for: libcst indents the lines inside its replacement fields.)
    """
    if not indent:
        return text
    lines = text.splitlines(keepends=True)
    keep = set()  # 0-based lines that stay as written
    if '"""' in text or "'''" in text or "\\\n" in text:
        tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))
        # 0-based, the lines after a string's first; and the lines whose end is a comment's
        keep = {row for t in tokens if t.type == tokenize.STRING for row in range(t.start[0], t.end[0])}
        comments = {t.start[0] - 1 for t in tokens if t.type == tokenize.COMMENT}
        keep |= {i + 1 for i, line in enumerate(lines[:-1])
                 if line.endswith("\\\n") and i not in keep and i not in comments}
    return "".join(line if i in keep else indent + line for i, line in enumerate(lines))
