"""The cleaner's libcst pass: ``get_ipython()`` calls that are not written the way IPython writes them.

IPython's transformers write each magic as one statement on its own line, which ``clean.py`` rewrites as
text; a notebook's own ``get_ipython()`` calls (spread over lines, inside an expression, in a loop's header)
come here. ``ipython.Magics`` decides what each becomes either way; this module turns its answers into
libcst nodes. Every replacement is one line for one line and keeps the comments and blank lines above the
statement it replaces.
"""

from __future__ import annotations

import libcst as cst

from .code import CodeError
from .cst_helpers import code_of, is_attribute, is_dead_if, is_name
from .ipython import PLACEHOLDER, Kind, Magics


def rewrite_statement(text: str, magics: Magics, dead: bool, line: int) -> str:
    """One statement's code (``text``, at no indentation, from cell line ``line``), rewritten."""
    try:
        module = cst.parse_module(text)
    except cst.ParserSyntaxError as exc:
        raise CodeError(f"not valid Python: {exc.message}", line + exc.raw_line - 1) from None
    return module.visit(IPythonCalls(magics, dead)).code


def rewrite_module(code: str, magics: Magics) -> str:
    """A whole cell's code, rewritten (for calls no single statement can be taken out for)."""
    try:
        module = cst.parse_module(code)
    except cst.ParserSyntaxError as exc:
        raise CodeError(f"not valid Python: {exc.message}", exc.raw_line) from None
    return module.visit(IPythonCalls(magics)).code


def _dropped(what: str) -> cst.SimpleStatementLine:
    """A placeholder for a statement that leaves the script (``Kind.DROPPED``); ``clean._finish`` turns it into a
    comment."""
    return cst.SimpleStatementLine(
        [cst.Expr(cst.Name(PLACEHOLDER))],
        trailing_whitespace=cst.TrailingWhitespace(
            whitespace=cst.SimpleWhitespace("  "), comment=cst.Comment(f"# nbddp: {what}")
        ),
    )


def _string_arg(call: cst.Call, index: int) -> str | None:
    if len(call.args) <= index:
        return None
    value = call.args[index].value
    if isinstance(value, (cst.SimpleString, cst.ConcatenatedString)):
        evaluated = value.evaluated_value
        return evaluated if isinstance(evaluated, str) else None
    return None


def _ipython_call(node: cst.CSTNode, *methods: str) -> bool:
    """``get_ipython().method(…)``, with ``method`` one of ``methods`` when given."""
    if not isinstance(node, cst.Call) or not is_attribute(node.func, *methods):
        return False
    owner = node.func.value
    return isinstance(owner, cst.Call) and is_name(owner.func, "get_ipython")


class IPythonCalls(cst.CSTTransformer):
    """Replace ``get_ipython()`` calls with what ``Magics`` says they become.

    ``dead``: the code handed over sits in ``if False:`` (nothing is pulled out; the block stays as written).
    """

    def __init__(self, magics: Magics, dead: bool = False):
        super().__init__()
        self.magics = magics
        self._dead = int(dead)

    def visit_If(self, node: cst.If) -> None:
        self._dead += is_dead_if(node)

    def leave_If(self, original, updated):
        self._dead -= is_dead_if(original)
        return updated

    def leave_SimpleStatementLine(self, original, updated):
        """Statements made only of a ``get_ipython()`` call become what they mean, or go."""
        if len(updated.body) != 1 or not isinstance(updated.body[0], cst.Expr) or not _ipython_call(updated.body[0].value):
            return updated
        call = updated.body[0].value
        text = code_of(original.with_changes(leading_lines=[])).strip()
        action = self.magics.statement(call.func.attr.value, _string_arg(call, 0), _string_arg(call, 1), text,
                                       bool(self._dead))
        if action.kind is Kind.KEEP:
            return updated
        if action.kind is Kind.SHELL:  # the call's own arguments, as written
            new = updated.with_changes(body=[cst.Expr(_nbddp_call("shell", call.args))])
        elif action.kind is Kind.SHELL_COMMAND:
            command = cst.Arg(cst.SimpleString(repr(action.value)))
            new = updated.with_changes(body=[cst.Expr(_nbddp_call("shell", [command]))])
        elif action.kind is Kind.DROPPED:
            new = _dropped(action.value)
        else:
            new = cst.parse_statement(action.value + "\n")  # Kind.STATEMENT: the code
        # the comments and blank lines above the magic stay: one line for one line
        return new.with_changes(leading_lines=original.leading_lines)

    def leave_Call(self, original, updated):
        """``x = !cmd`` → ``x = _nbddp.getoutput("cmd")``; ``x = %magic`` in expressions likewise."""
        if _ipython_call(updated, "getoutput"):
            return _nbddp_call("getoutput", updated.args)
        return updated


def _nbddp_call(name: str, args) -> cst.Call:
    return cst.Call(func=cst.Attribute(value=cst.Name("_nbddp"), attr=cst.Name(name)), args=list(args))
