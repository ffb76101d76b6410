"""IPython syntax → plain Python, with installs pulled out into a plan that runs once before launch.

IPython's own ``TransformerManager`` turns ``!cmd``, ``%magic`` and ``x = !cmd`` into
``get_ipython().…`` calls; a libcst pass then replaces each of those calls with what it means in a script
run by every rank: installs leave the script (they run once, before torchrun starts), ``%time stmt`` becomes
``stmt``, ``%env``/``%cd`` become ``os.environ``/``os.chdir``, other shell commands run through
``_nbddp.shell`` on one process per node while the others wait, display-only magics are dropped.
Cell magics (``%%capture``, ``%%time``, ``%%bash``, …) are handled before, from the cell's first line.
"""

from __future__ import annotations

import ast
import functools
import re
import shlex
from dataclasses import dataclass

import libcst as cst

from ..cells import Cell
from ..errors import CellError
from .lines import align
from .facts import is_attribute, is_dead_if, is_name

#: Line magics with no meaning in a script: dropped, with a note.
DROPPED_LINE_MAGICS = frozenset(
    "matplotlib load_ext reload_ext unload_ext autoreload aimport config pylab who whos who_ls pinfo pinfo2 "
    "psearch pdoc pdef psource pfile history recall rerun logstart logstop xmode colors precision "
    "reset reset_selective store alias unalias rehashx doctest_mode notebook qtconsole".split()
)
#: Line magics that wrap a statement: ``%time x = f()`` runs ``x = f()``.
STATEMENT_LINE_MAGICS = frozenset({"time", "timeit", "prun", "capture"})
#: Cell magics that wrap a body of Python: the body is kept, the wrapper dropped.
WRAPPER_CELL_MAGICS = frozenset({"capture", "time", "timeit", "prun"})
#: Cell magics whose body is shell.
SHELL_CELL_MAGICS = frozenset({"bash", "sh", "script", "system"})
#: Cell magics that only display something in the notebook.
DISPLAY_CELL_MAGICS = frozenset({"html", "HTML", "markdown", "javascript", "js", "latex", "svg"})



@functools.cache
def _transformer():
    """IPython's input transformers (stateless between cells: one is enough), imported on first need."""
    from IPython.core.inputtransformer2 import TransformerManager

    return TransformerManager()

_INSTALL = re.compile(
    r"^\s*(?:sudo\s+)?(?:(?:python[0-9.]*|py)\s+-m\s+)?(?:pip[0-9.]*|uv\s+pip|conda|mamba|micromamba|apt|apt-get)"
    r"\s+install\b"
)


def is_install(command: str) -> bool:
    """Whether a shell command installs packages (pip, uv pip, conda, mamba, apt)."""
    return bool(_INSTALL.match(command))


@dataclass(frozen=True)
class Install:
    """One install command pulled out of the notebook, to run once before launch."""

    cell: int
    line: int
    command: str

    def argv(self) -> list[str]:
        return shlex.split(self.command)


@dataclass(frozen=True)
class Note:
    """Something the cleaner changed, at a line of the cell."""

    line: int
    message: str


@dataclass(frozen=True)
class CleanCell:
    """A cell as plain Python. ``line_map[i]`` is the 1-based cell line of code line ``i`` (0-based), or None."""

    cell: Cell
    code: str
    line_map: tuple[int | None, ...]
    installs: tuple[Install, ...] = ()
    notes: tuple[Note, ...] = ()


def clean_cell(cell: Cell) -> CleanCell:
    """Turn one notebook cell into plain Python; raise ``CellError`` for a cell that does not parse."""
    lines = cell.source.splitlines()
    first = next((i for i, ln in enumerate(lines) if ln.strip()), None)
    notes: list[Note] = []
    if first is not None and lines[first].lstrip().startswith("%%"):
        head = lines[first].strip()[2:]
        name = head.split()[0] if head.split() else ""
        body, offset = lines[first + 1 :], first + 1
        if name in WRAPPER_CELL_MAGICS:
            notes.append(Note(first + 1, f"%%{name} dropped; the cell's code is kept"))
        elif name in SHELL_CELL_MAGICS:
            return _shell_cell(cell, body, offset, name)
        elif name == "writefile":
            return _writefile_cell(cell, head, body, offset)
        else:
            kind = "display-only" if name in DISPLAY_CELL_MAGICS else "not Python"
            notes.append(Note(first + 1, f"%%{name} cell left out ({kind})"))
            return CleanCell(cell, "", (), (), tuple(notes))
    else:
        body, offset = lines, 0

    body_src = "\n".join(body) + "\n"
    transformed, t_map = _python(body_src, body, cell, offset)
    try:
        if t_map is not None:
            ast.parse(transformed)  # CPython's parser points at the line a person would fix
        else:
            t_map = list(range(len(body)))
        module = cst.parse_module(transformed) if "get_ipython" in transformed else None
    except (SyntaxError, cst.ParserSyntaxError) as exc:
        raw = getattr(exc, "lineno", None) or getattr(exc, "raw_line", 1)
        src_line = _body_line(t_map, raw, offset)
        msg = exc.msg if isinstance(exc, SyntaxError) else exc.message
        raise CellError(f"not valid Python: {msg}", cell=cell.index, line=src_line, source=_line_at(lines, src_line)) from None

    if module is None:  # plain Python: nothing for the libcst pass to do
        line_map = tuple(None if j is None else j + 1 + offset for j in t_map)
        return CleanCell(cell, transformed, line_map, (), tuple(notes))
    rewriter = _IPythonCalls(cell, transformed.splitlines())
    try:
        new_code = _finish(module.visit(rewriter).code)
    except _MagicError as exc:  # raised at a line of the transformed code: point at the cell's line
        src_line = _body_line(t_map, exc.line, offset)
        raise CellError(exc.message, cell=cell.index, line=src_line, source=_line_at(lines, src_line)) from None
    # Every replacement is one line for one line, so new line k is transformed line k.
    line_map = tuple(None if j is None else j + 1 + offset for j in t_map)
    installs = tuple(Install(cell.index, _body_line(t_map, ln, offset), cmd) for ln, cmd in rewriter.installs)
    notes += [Note(_body_line(t_map, ln, offset), msg) for ln, msg in rewriter.notes]
    return CleanCell(cell, new_code, line_map, installs, tuple(notes))


def _python(body_src: str, body: list[str], cell: Cell, offset: int) -> tuple[str, list[int | None] | None]:
    """The cell body as Python, and which body line each of its lines comes from (None: one for one).

    A body that already parses is Python as it stands: IPython's transformers would leave it as it is, and
    skipping them keeps conversion fast. Anything else goes through ``TransformerManager``.
    """
    try:
        ast.parse(body_src)
        return body_src, None
    except SyntaxError:
        pass
    try:
        transformed = _transformer().transform_cell(body_src)
    except SyntaxError as exc:  # TransformerManager raises on some malformed magics
        raise CellError(f"cannot read IPython syntax: {exc.msg}", cell=cell.index, line=offset + (exc.lineno or 1)) from None
    return transformed, align(body, transformed.splitlines())


def _body_line(t_map: list[int | None], transformed_line: int, offset: int) -> int:
    j = t_map[transformed_line - 1] if 0 < transformed_line <= len(t_map) else None
    return (j if j is not None else transformed_line - 1) + 1 + offset


_DROPPED = "_NBDDP_DROPPED_"
_DROPPED_LINE = re.compile(rf"^(\s*){_DROPPED}  # (.*)$", re.M)


def _dropped(what: str) -> cst.SimpleStatementLine:
    """A placeholder for a statement that leaves the script; ``_finish`` turns it into a comment."""
    return cst.SimpleStatementLine(
        [cst.Expr(cst.Name(_DROPPED))],
        trailing_whitespace=cst.TrailingWhitespace(
            whitespace=cst.SimpleWhitespace("  "), comment=cst.Comment(f"# nbddp: {what}")
        ),
    )


def _finish(code: str) -> str:
    """Placeholders become comments, or ``pass  # …`` where a block would be left empty."""
    as_comments = _DROPPED_LINE.sub(r"\1# \2", code)
    try:
        ast.parse(as_comments)
        return as_comments
    except SyntaxError:
        return _DROPPED_LINE.sub(r"\1pass  # \2", code)


def _line_at(lines: list[str], line: int) -> str:
    return lines[line - 1] if 0 < line <= len(lines) else ""


def _shell_cell(cell: Cell, body: list[str], offset: int, name: str) -> CleanCell:
    """A ``%%bash`` cell: install lines go to the plan, the rest runs through ``_nbddp.shell``."""
    installs, code, line_map, notes = [], [], [], []
    for i, text in enumerate(body, start=offset + 1):
        if not text.strip() or text.lstrip().startswith("#"):
            continue
        if is_install(text):
            installs.append(Install(cell.index, i, text.strip()))
        else:
            code.append(f"_nbddp.shell({text.strip()!r})")
            line_map.append(i)
    notes.append(Note(offset, f"%%{name} cell: installs run before launch, other lines once per node"))
    return CleanCell(cell, "\n".join(code) + ("\n" if code else ""), tuple(line_map), tuple(installs), tuple(notes))


def _writefile_cell(cell: Cell, head: str, body: list[str], offset: int) -> CleanCell:
    """``%%writefile [-a] path``: written once per node, before the other processes read it."""
    args = shlex.split(head)[1:]
    append = any(a in ("-a", "--append") for a in args)
    paths = [a for a in args if not a.startswith("-")]
    if not paths:
        raise CellError("%%writefile needs a file name", cell=cell.index, line=offset)
    text = "\n".join(body) + "\n"
    code = f"_nbddp.write_file({paths[0]!r}, {text!r}, append={append})\n"
    return CleanCell(cell, code, (offset,), (), (Note(offset, f"%%writefile {paths[0]} written once per node"),))


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


class _MagicError(Exception):
    """A magic that cannot be converted, at a line of the transformed cell (``clean_cell`` maps it back)."""

    def __init__(self, message: str, line: int):
        super().__init__(message)
        self.message, self.line = message, line


class _IPythonCalls(cst.CSTTransformer):
    """Replace the ``get_ipython()`` calls that TransformerManager produced."""

    def __init__(self, cell: Cell, lines: list[str]):
        super().__init__()
        self.cell, self.lines = cell, [ln.strip() for ln in lines]
        self._next = 0  # statements come in order: where to look for the next one's line
        self.installs: list[tuple[int, str]] = []
        self.notes: list[tuple[int, str]] = []
        self._dead = 0  # inside ``if False:``: nothing is pulled out, the block stays as written

    def visit_If(self, node: cst.If) -> None:
        self._dead += is_dead_if(node)

    def leave_If(self, original, updated):
        self._dead -= is_dead_if(original)
        return updated

    def _pulls_out(self, command: str) -> bool:
        return is_install(command) and not _interpolates(command) and not self._dead

    def _line(self, node: cst.SimpleStatementLine) -> int:
        """The line of a one-line statement in the transformed cell: the next line with its text.

        (libcst's positions would generate the cell's source once more; a ``get_ipython()`` statement is one
        line, and statements are left in the order they come.)
        """
        text = cst.Module([]).code_for_node(node.with_changes(leading_lines=[])).strip()
        for k in range(self._next, len(self.lines)):
            if self.lines[k] == text:
                self._next = k + 1
                return k + 1
        return self._next or 1

    def leave_SimpleStatementLine(self, original, updated):
        """Statements made only of a ``get_ipython()`` call become what they mean, or go."""
        if len(updated.body) != 1 or not isinstance(updated.body[0], cst.Expr) or not _ipython_call(updated.body[0].value):
            return updated
        call = updated.body[0].value
        method = call.func.attr.value
        line = self._line(original)
        if method == "system":
            command = _string_arg(call, 0)
            if command is not None and self._pulls_out(command):
                self.installs.append((line, command.strip()))
                return _dropped(f"`{command.strip()}` runs once before launch").with_changes(
                    leading_lines=original.leading_lines
                )
            return updated.with_changes(body=[cst.Expr(_nbddp_call("shell", call.args))])
        if method == "run_line_magic":
            name, arg = _string_arg(call, 0), _string_arg(call, 1) or ""
            # the comments and blank lines above the magic stay: one line for one line
            new = self._line_magic(original, updated, name, arg, line)
            return new.with_changes(leading_lines=original.leading_lines)
        return updated

    def _line_magic(self, original, updated, name, arg, line):
        if name in ("pip", "conda", "mamba", "uv"):
            command = f"{name} {arg}".strip() if name != "uv" else f"uv {arg}"
            if self._pulls_out(command):
                self.installs.append((line, command))
                return _dropped(f"`{command}` runs once before launch")
            return updated.with_changes(body=[cst.Expr(_nbddp_call("shell", [cst.Arg(cst.SimpleString(repr(command)))]))])
        if name in STATEMENT_LINE_MAGICS:
            try:
                stmt = cst.parse_statement(arg + "\n")
            except cst.ParserSyntaxError:
                raise _MagicError(f"%{name} wraps code that is not valid Python", line) from None
            self.notes.append((line, f"%{name} dropped; its statement is kept"))
            return stmt
        if name == "env":
            key, _, value = arg.replace("=", " ", 1).partition(" ")
            if not key or not value.strip():
                self.notes.append((line, "%env without a value dropped"))
                return _dropped(f"%env {arg} dropped")
            return cst.parse_statement(f"os.environ[{key!r}] = {value.strip()!r}\n")
        if name == "cd":
            return cst.parse_statement(f"os.chdir(os.path.expanduser({arg.strip()!r}))\n")
        if name in DROPPED_LINE_MAGICS or name is None:
            self.notes.append((line, f"%{name} dropped (notebook-only)"))
            return _dropped(f"%{name} {arg}".rstrip() + " dropped (notebook-only)")
        raise _MagicError(f"%{name} has no meaning in a training script; remove it or move it to a cell after %%ddp_train", line)

    def leave_Call(self, original, updated):
        """``x = !cmd`` → ``x = _nbddp.getoutput("cmd")``; ``x = %magic`` in expressions likewise."""
        if _ipython_call(updated, "getoutput"):
            return _nbddp_call("getoutput", updated.args)
        return updated


def _interpolates(command: str) -> bool:
    """IPython expands ``{expr}`` and ``$name`` in shell lines from the kernel's namespace."""
    return bool(re.search(r"\{[^}]*\}|\$[A-Za-z_]", command))


def _nbddp_call(name: str, args) -> cst.Call:
    return cst.Call(func=cst.Attribute(value=cst.Name("_nbddp"), attr=cst.Name(name)), args=list(args))
