"""Small questions about libcst nodes and small rewrites of them, for the rules and the cleaner's libcst pass.

libcst is imported on first use, not with this module: ``cst`` here is the ``libcst`` module from the first
name looked up on it. A rule's module holds its check (Python's ``ast``, asked for every cell) and its
rewrite (libcst, run only where the check says so), so importing the rules, and with them ``nbddp.job`` or
``nbddp.cli``, costs no libcst import (a large part of a second; ``tests/test_script.py`` checks it is not made).
The ``ast`` counterparts of these helpers, for the checks and the facts, are in ``ast_helpers.py``.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING


class _Libcst:
    """Stands in for the ``libcst`` module until a name is looked up on it: the first look-up imports libcst;
    each name found is kept here, so a later look-up is a plain attribute read."""

    def __getattr__(self, name: str):
        if name.startswith("__"):  # protocols probed on any object (copy, inspect) do not import libcst
            raise AttributeError(name)
        import libcst

        value = getattr(libcst, name)
        setattr(self, name, value)
        return value


if TYPE_CHECKING:
    import libcst as cst
else:
    cst = _Libcst()


@functools.cache
def fixed_expression(code: str) -> cst.BaseExpression:
    """One of the fixed expressions the rules write, parsed once (libcst nodes are immutable)."""
    return cst.parse_expression(code)


@functools.cache
def fixed_statement(code: str) -> cst.BaseStatement:
    """A fixed statement the rules write, parsed once."""
    return cst.parse_statement(code)


def dotted_name(node: cst.BaseExpression) -> str | None:
    """``a.b.C`` for a Name/Attribute chain, else None."""
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        base = dotted_name(node.value)
        return f"{base}.{node.attr.value}" if base else None
    return None


def last_name(node: cst.BaseExpression) -> str | None:
    """The last part of a call's name: ``AutoModel`` for ``transformers.AutoModel``, ``train`` for ``t.train``."""
    if isinstance(node, cst.Attribute):
        return node.attr.value
    if isinstance(node, cst.Name):
        return node.value
    return None


def is_name(node: cst.CSTNode | None, *values: str) -> bool:
    """A ``Name`` node, with one of ``values`` when given."""
    return isinstance(node, cst.Name) and (not values or node.value in values)


def is_attribute(node: cst.CSTNode | None, *attrs: str) -> bool:
    """An ``owner.attr`` node, with ``attr`` one of ``attrs`` when given."""
    return isinstance(node, cst.Attribute) and (not attrs or node.attr.value in attrs)


def is_dead_if(node: cst.CSTNode) -> bool:
    """``if False:`` / ``if 0:``: code a notebook keeps switched off."""
    if not isinstance(node, cst.If):
        return False
    return is_name(node.test, "False") or isinstance(node.test, cst.Integer) and node.test.value == "0"


def keyword(call: cst.Call, key: str) -> cst.Arg | None:
    return next((a for a in call.args if a.keyword is not None and a.keyword.value == key), None)


def has_keyword(call: cst.Call, key: str) -> bool:
    return keyword(call, key) is not None


def wrap_named_arguments(call: cst.Call, names: set[str], wrap: str, say_name: bool = False) -> tuple[cst.Call, list[str]]:
    """``call`` with each argument that is one of ``names`` (``f(x)``, ``f(k=x)``) passed through the function
    ``wrap`` names (``f(_nbddp.g(x))``; ``say_name``: ``f(_nbddp.g(x, name='x'))``), and the names it wrapped."""
    args, wrapped = [], []
    for arg in call.args:
        if not arg.star and is_name(arg.value) and arg.value.value in names:
            name = arg.value.value
            wrapped.append(name)
            inner = f"{wrap}({name}, name={name!r})" if say_name else f"{wrap}({name})"
            arg = arg.with_changes(value=cst.parse_expression(inner))
        args.append(arg)
    return call.with_changes(args=args), wrapped


def code_of(node: cst.CSTNode) -> str:
    return cst.Module([]).code_for_node(node)


def string_value(node: cst.BaseExpression) -> str | None:
    if isinstance(node, cst.SimpleString):
        value = node.evaluated_value
        return value if isinstance(value, str) else None
    return None


def set_keyword(call: cst.Call, key: str, value: cst.BaseExpression) -> tuple[cst.Call, str | None]:
    """Set ``key=value`` on a call; return the new call and the old value's source (None when absent).

    A new keyword goes last; in a call written one argument per line it gets a line of its own, and every
    comment stays on the line it was on (a comment after the last argument does not move to the new one).
    """
    args = list(call.args)
    for i, arg in enumerate(args):
        if arg.keyword is not None and arg.keyword.value == key:
            args[i] = arg.with_changes(value=value)
            return call.with_changes(args=args), code_of(arg.value)
    new_arg = cst.Arg(
        keyword=cst.Name(key),
        value=value,
        equal=cst.AssignEqual(whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace("")),
    )
    if args and (closing := _closing_line(args[-1])) is not None:
        return call.with_changes(args=_on_own_line(call, args, new_arg, closing)), None
    if args and isinstance(args[-1].comma, cst.Comma):  # f(a, ): the trailing comma stays last
        new_arg = new_arg.with_changes(comma=args[-1].comma)
        args[-1] = args[-1].with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
    elif args:
        args[-1] = args[-1].with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
    args.append(new_arg)
    return call.with_changes(args=args), None


def _closing_line(last: cst.Arg) -> cst.ParenthesizedWhitespace | None:
    """What follows a call's last argument when the closing parenthesis is on a line of its own: the rest of
    the argument's line (a comment), comment lines, the parenthesis' indentation. None otherwise."""
    after = last.comma.whitespace_after if isinstance(last.comma, cst.Comma) else last.whitespace_after_arg
    return after if isinstance(after, cst.ParenthesizedWhitespace) else None


def _on_own_line(call: cst.Call, args: list[cst.Arg], new_arg: cst.Arg, closing: cst.ParenthesizedWhitespace) -> list:
    """``args`` with ``new_arg`` on a line of its own after the last: the last argument keeps its line's
    comment and the comment lines below it; the new one ends its line with what the call's arguments
    end theirs with (a comma or not) and the parenthesis' indentation."""
    between = next((a.comma.whitespace_after for a in reversed(args[:-1]) if isinstance(a.comma, cst.Comma)
                    and isinstance(a.comma.whitespace_after, cst.ParenthesizedWhitespace)), None)
    if between is None:
        between = call.whitespace_before_args if isinstance(call.whitespace_before_args, cst.ParenthesizedWhitespace) else closing
    last = args[-1]
    trailing_comma = isinstance(last.comma, cst.Comma)
    kept = closing.with_changes(indent=between.indent, last_line=between.last_line)  # its comments stay here
    args[-1] = last.with_changes(
        comma=cst.Comma(whitespace_before=last.comma.whitespace_before if trailing_comma else cst.SimpleWhitespace(""),
                        whitespace_after=kept),
        whitespace_after_arg=last.whitespace_after_arg if trailing_comma else cst.SimpleWhitespace(""),
    )
    end = closing.with_changes(first_line=cst.TrailingWhitespace(), empty_lines=[])
    if trailing_comma:
        new_arg = new_arg.with_changes(comma=cst.Comma(whitespace_after=end))
    else:
        new_arg = new_arg.with_changes(whitespace_after_arg=end)
    return args + [new_arg]


def has_star_kwargs(call: cst.Call) -> bool:
    """``f(**kwargs)``: a keyword may be in them."""
    return any(arg.star == "**" for arg in call.args)


def walk(node: cst.CSTNode):
    """A node and every node inside it, in source order."""
    yield node
    for child in node.children:
        yield from walk(child)
