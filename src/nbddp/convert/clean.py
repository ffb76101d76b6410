"""IPython syntax → plain Python, with installs pulled out into a plan that runs once before launch.

A cell that Python's parser reads is Python as it stands, and most cells are: they cost one ``ast.parse``.
For the others, IPython's own ``TransformerManager`` turns ``!cmd``, ``%magic`` and ``x = !cmd`` into
``get_ipython().…`` calls; a libcst pass (``ipycalls.py``, over the statements holding those calls) then
replaces each call with what it means in a script run by every rank: installs leave the script (they run
once, before torchrun starts, unless they install local files an earlier cell may make), ``%time stmt``
becomes ``stmt``, ``%env`` becomes ``os.environ``, ``%cd`` ``_nbddp.cd``, other shell commands run through
``_nbddp.shell`` on one process per node while the others wait (``{expr}``/``$name`` expanded there, as
IPython's ``var_expand`` does), notebook-only magics are dropped. Cell magics (``%%capture``, ``%%time``,
``%%bash``, …) are handled before, from the cell's first line (after Colab's form lines). What each magic,
shell line and cell magic becomes is decided in ``ipython.py``; this module applies it. IPython and libcst
are imported only for cells that need them.
"""

from __future__ import annotations

import ast
import functools
import re
import shlex
import sys
from dataclasses import dataclass, field

from ..cells import Cell
from ..errors import CellError
from .ast_helpers import compound_bodies, is_compound, is_dead_if
from .code import CellCode, CodeError, group_lines
from .ipython import (
    FORM_LINE,
    PLACEHOLDER,
    CellMagic,
    Magics,
    automagic,
    cell_magic,
    installs_local_files,
    interpolates,
    is_install,
)
from .lines import align
from .newer_python import newer_python


@functools.cache
def _transformer():
    """IPython's input transformers (stateless between cells: one is enough), imported on first need."""
    from IPython.core.inputtransformer2 import TransformerManager

    return TransformerManager()


@dataclass(frozen=True)
class Install:
    """One install command pulled out of the notebook, to run once before launch."""

    cell: int
    line: int
    command: str
    #: the modules of a ``try:`` holding only imports, where the install sits in its ``except`` (``try: import x``
    #: / ``except ImportError: !pip install x``): the kernel ran it only where one of them did not import
    unless_importable: tuple[str, ...] = ()

    def argv(self) -> list[str]:
        """The command's words, less a trailing comment (``pip install x  # why``): the kernel's shell, which
        runs ``!pip``/``%pip`` lines, drops a word starting with ``#`` and all after it, quotes in it too
        (``# the version we're using``); a ``#`` inside a word (``git+https://…#egg=x``) or quotes stays."""
        try:
            return shlex.split(_without_comment(self.command))
        except ValueError as exc:  # an unclosed quote: the kernel's shell refuses it too
            raise CellError(f"cannot read this install line ({exc}): close its quote", cell=self.cell,
                            line=self.line, source=f"!{self.command}") from None


def _without_comment(command: str) -> str:
    """``command`` up to the ``#`` that starts a word outside quotes, as a POSIX shell reads it. By hand:
    ``shlex``'s own comments cut a ``#`` inside a word too (``…#egg=x``)."""
    quote, escaped, word_start = None, False, True
    for at, char in enumerate(command):
        starts = word_start
        word_start = False
        if escaped:
            escaped = False
        elif char == "\\" and quote != "'":
            escaped = True
        elif quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char.isspace():
            word_start = True
        elif char == "#" and starts:
            return command[:at]
    return command


@dataclass(frozen=True)
class Note:
    """Something the cleaner changed, at a line of the cell."""

    line: int
    message: str


@dataclass(frozen=True)
class CleanCell:
    """A cell as plain Python. ``line_map[i]`` is the 1-based cell line of code line ``i`` (0-based), or None.

    ``tree``: the code's ast, when cleaning parsed it anyway (the facts read it rather than parse again).
    """

    cell: Cell
    code: str
    line_map: tuple[int | None, ...]
    installs: tuple[Install, ...] = ()
    notes: tuple[Note, ...] = ()
    tree: ast.Module | None = field(default=None, compare=False, repr=False)
    #: ``(line, arguments)`` of a ``%%capture`` line: the script keeps the cell's output from the console
    capture: tuple[int, str] | None = None


def clean_cell(cell: Cell, bound: set[str] | None = None) -> CleanCell:
    """Turn one notebook cell into plain Python; raise ``CellError`` for a cell that does not parse.

    ``bound``: the names the notebook's earlier cells bind, where known. A one-line cell that Python reads
    but IPython's automagic runs as a magic (``cd /kaggle/working``, ``ls``) is read as IPython reads it only
    then: a name the kernel holds would keep it Python."""
    lines = cell.source.splitlines()
    _say_when_long(cell, len(lines))
    first = next((i for i, ln in enumerate(lines) if ln.strip() and not FORM_LINE.match(ln)), None)
    if first is not None and lines[first].lstrip().startswith("%%"):
        return _magic_cell(cell, lines, first, bound)
    return _python_cell(cell, lines, lines, 0, bound=bound)


def bound_names(tree: ast.Module | None) -> set[str]:
    """The names a cell's top-level statements bind (assignments, imports, functions, classes): what shadows
    a magic's name for IPython's automagic in a later cell."""
    names: set[str] = set()
    for node in tree.body if tree is not None else ():
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.For, ast.With)):
            names.update(n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store))
    return names


def _magic_cell(cell: Cell, lines: list[str], first: int, bound: set[str] | None = None) -> CleanCell:
    """A cell under a cell magic (on line ``first``, 0-based), as ``ipython.cell_magic`` says it is."""
    head = lines[first].strip()[2:]
    name = head.split()[0] if head.split() else ""
    body, offset = lines[first + 1 :], first + 1
    kind = cell_magic(name)
    if kind is CellMagic.CAPTURE:
        note = Note(offset, "%%capture: the cell's printed output is kept from the console, as in the kernel")
        return _python_cell(cell, lines, body, offset, [note], capture=(offset, head[len("capture") :].strip()),
                            bound=bound)
    if kind is CellMagic.WRAPPER:
        return _python_cell(cell, lines, body, offset, [Note(offset, f"%%{name} dropped; the cell's code is kept")],
                            bound=bound)
    if kind is CellMagic.SHELL:
        return _shell_cell(cell, body, offset, name, head)
    if kind is CellMagic.WRITEFILE:
        return _writefile_cell(cell, head, body, offset)
    what = "display-only" if kind is CellMagic.DISPLAY else "not Python"
    return CleanCell(cell, "", (), (), (Note(offset, f"%%{name} cell left out ({what})"),))


def _python_cell(cell: Cell, lines: list[str], body: list[str], offset: int, notes: list[Note] | None = None,
                 capture: tuple[int, str] | None = None, bound: set[str] | None = None) -> CleanCell:
    """The cell's ``body`` (its lines from ``offset``, 0-based) as Python: IPython's syntax rewritten."""
    notes = list(notes or [])
    body_src = "\n".join(body) + "\n"
    transformed, t_map, tree = _python(body_src, body, cell, offset, lines, bound)
    if t_map is None:
        t_map = list(range(len(body)))
    line_map = tuple(None if j is None else j + 1 + offset for j in t_map)
    if "login(" in transformed or "input(" in transformed:
        notes += [Note(_body_line(t_map, ln, offset), msg) for ln, msg in _interactive_calls(tree)]
    if "get_ipython" not in transformed:  # plain Python: nothing for the libcst pass to do
        return CleanCell(cell, transformed, line_map, (), tuple(notes), tree, capture)

    magics = Magics(transformed.splitlines())
    try:
        new_code, new_tree = _ipython_calls(transformed, tree, magics)
    except CodeError as exc:  # raised at a line of the transformed code: point at the cell's line
        src_line = _body_line(t_map, exc.line, offset)
        raise CellError(exc.message, cell=cell.index, line=src_line, source=_line_at(lines, src_line)) from None
    # Every replacement is one line for one line, so new line k is transformed line k.
    guards = _import_guards(tree if tree is not None else ast.parse(transformed)) if magics.installs else {}
    installs = tuple(Install(cell.index, _body_line(t_map, ln, offset), cmd, guards.get(ln, ()))
                     for ln, cmd in magics.installs)
    notes += [Note(_body_line(t_map, ln, offset), msg) for ln, msg in magics.notes]
    return CleanCell(cell, new_code, line_map, installs, tuple(notes), new_tree, capture)


#: What an ``except`` around imports catches when one of them fails.
_IMPORT_FAILURES = frozenset({"ImportError", "ModuleNotFoundError", "Exception", "BaseException"})


def _import_guards(tree: ast.Module) -> dict[int, tuple[str, ...]]:
    """Line → the modules a ``try:`` of imports imports, for each line of its ``except`` that catches their
    failure (``except ImportError:``, a bare ``except:``): an install there ran only where an import failed."""
    guards: dict[int, tuple[str, ...]] = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Try) or not all(isinstance(s, (ast.Import, ast.ImportFrom)) for s in node.body):
            continue
        modules = tuple(dict.fromkeys(
            name.split(".")[0] for s in node.body
            for name in ([a.name for a in s.names] if isinstance(s, ast.Import) else [s.module] if not s.level else [])
            if name))
        for handler in node.handlers:
            caught = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
            if modules and any(t is None or isinstance(t, ast.Name) and t.id in _IMPORT_FAILURES for t in caught):
                guards.update(dict.fromkeys(range(handler.body[0].lineno, handler.end_lineno + 1), modules))
    return guards


def _ipython_calls(code: str, tree: ast.Module, magics: Magics) -> tuple[str, ast.Module]:
    """``code`` with its ``get_ipython()`` calls rewritten, statement by statement, in order; and its ast.

    A statement as IPython's transformers write it (``get_ipython().system('pip install x')`` alone on its
    line) is rewritten as text; any other goes through libcst (``ipycalls.py``), parsed on its own and put
    back at its indentation. Either way ``Magics`` decides what it becomes, and the rest of the cell stays as
    it is. A cell with such a call where no statement can be taken alone (a loop's header, a decorator) is
    parsed whole. Raises ``CodeError`` where libcst cannot parse the code, and for a magic with no meaning in a
    script.
    """
    cell = CellCode.read(code, tree)
    found = _ipython_statements(cell.tree.body, cell, False)
    if found is None:
        from .ipycalls import rewrite_module

        new_code = rewrite_module(code, magics)
    else:
        lines = list(cell.lines)
        for group, dead in found:
            first, last = group[0].lineno, group[-1].end_lineno
            indent = lines[first - 1][: len(lines[first - 1]) - len(lines[first - 1].lstrip())]
            new = _as_text(group, lines[first - 1], indent, magics, dead)
            if new is None:
                from .ipycalls import rewrite_statement

                new = rewrite_statement(lines[first - 1][len(indent) :] + "".join(lines[first:last]), magics, dead, first)
            lines[first - 1 : last] = [indent + new] + [""] * (last - first)
        new_code = "".join(lines)
    if PLACEHOLDER in new_code:
        return _finish(new_code)
    return new_code, (tree if new_code == code else ast.parse(new_code))


def _as_text(group: list[ast.stmt], line: str, indent: str, magics: Magics, dead: bool) -> str | None:
    """A statement as IPython's transformers write it, rewritten as text (None for any other statement).

    That is ``get_ipython().method('…', …)`` alone on its line, or ``x = get_ipython().getoutput('…')``,
    with string arguments written as ``repr`` writes them: exactly what the libcst pass would give.
    """
    if len(group) != 1:
        return None
    node = group[0]
    if isinstance(node, ast.Expr):
        call, prefix = node.value, ""
    elif isinstance(node, ast.Assign) and all(isinstance(t, ast.Name) for t in node.targets):
        call, prefix = node.value, "".join(f"{t.id} = " for t in node.targets)
    else:
        return None
    if not isinstance(call, ast.Call) or call.keywords or not isinstance(call.func, ast.Attribute):
        return None
    owner, method = call.func.value, call.func.attr
    if not (isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "get_ipython"
            and not owner.args and not owner.keywords):
        return None
    values = [a.value for a in call.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
    args = ", ".join(map(repr, values))
    if len(values) != len(call.args) or any("\n" in v or "\r" in v for v in values):
        return None
    if line != f"{indent}{prefix}get_ipython().{method}({args})\n":
        return None
    if method == "getoutput":
        return f"{prefix}_nbddp.getoutput({args})\n"
    if prefix:  # ``x = %magic``: left as it is
        return line[len(indent) :]
    action = magics.statement(method, values[0] if values else None, values[1] if len(values) > 1 else None,
                              line.strip(), dead)
    new = action.text(args)
    return line[len(indent) :] if new is None else new + "\n"


#: Calls that wait for a person in a notebook (``runtime/interactive.py`` stops them in a rank).
_LOGINS = frozenset({"notebook_login", "login", "interpreter_login"})


def _interactive_calls(tree: ast.Module) -> list[tuple[int, str]]:
    """``(line, note)`` for each ``input()`` and each Hugging Face login without a token in the cell."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
        if name == "input" and isinstance(node.func, ast.Name):
            found.append((node.lineno, "input() waits for a person: in a rank it stops the job here; set the value "
                                       "in the cell or read it from os.environ"))
        elif name in _LOGINS and not node.args and not any(k.arg == "token" for k in node.keywords):
            found.append((node.lineno, f"{name}() without a token: every rank uses HF_TOKEN or the login saved "
                                       "before launch, and stops here without one"))
    return sorted(found)


def _ipython_statements(body: list[ast.stmt], cell: CellCode, dead: bool):
    """The line-statements holding a ``get_ipython().…(…)`` call, each with whether it sits in ``if False:``.

    None when such a call sits anywhere libcst could not take one statement at a time: in a compound
    statement's header, or in statements that share a line with a block's header (``if x: !ls``).
    """
    found = []
    for group in group_lines(body, cell):
        node = group[0]
        if is_compound(node):
            inner = dead or is_dead_if(node)
            bodies = compound_bodies(node)
            header = [n for n in ast.iter_child_nodes(node) if not isinstance(n, (ast.stmt, ast.excepthandler, ast.match_case))]
            header += [h.type for h in getattr(node, "handlers", ()) if h.type is not None]
            header += [n for c in getattr(node, "cases", ()) for n in (c.pattern, c.guard) if n is not None]
            if any(_has_ipython_call(n) for n in header):
                return None
            for sub in bodies:
                more = _ipython_statements(sub, cell, inner)
                if more is None:
                    return None
                found += more
        elif "get_ipython" in "".join(cell.lines[node.lineno - 1 : group[-1].end_lineno]) and any(
            _has_ipython_call(n) for n in group
        ):
            line = cell.lines[node.lineno - 1]
            if len(line.encode()) - len(line.lstrip().encode()) != node.col_offset:
                return None
            found.append((group, dead))
    return found


def _has_ipython_call(node: ast.AST) -> bool:
    for n in ast.walk(node):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "get_ipython":
            return True
    return False


def _python(body_src: str, body: list[str], cell: Cell, offset: int, lines: list[str], bound: set[str] | None = None):
    """The cell body as Python, which body line each of its lines comes from (None: one for one), its ast.

    A body that already parses is Python as it stands: IPython's transformers would leave it as it is, and
    skipping them keeps conversion fast. Anything else goes through ``TransformerManager``; what it gives
    must then parse (``CellError`` at the cell's line, as CPython's parser points at the line a person would
    fix).
    """
    try:
        tree = ast.parse(body_src)
    except SyntaxError:
        pass
    else:
        if bound is None or not _one_expression(tree, body):
            return body_src, None, tree
        at = next(i for i, line in enumerate(body) if line.strip())
        magic = automagic(body[at], bound)  # ``cd /kaggle/working``, ``ls``: Python reads them, IPython runs them
        if magic is None:
            return body_src, None, tree
        new_src = "\n".join([*body[:at], magic, *body[at + 1 :]]) + "\n"
        return new_src, None, ast.parse(new_src)
    if (by_line := _transform_escape_lines(body)) is not None:
        transformed, tree = by_line
        lines_out = transformed.splitlines()
        return transformed, _line_for_line(body, lines_out) or align(body, lines_out), tree
    try:
        transformed = _transformer().transform_cell(body_src)
    except SyntaxError as exc:  # TransformerManager raises on some malformed magics
        newer = newer_python(body)
        if newer:
            raise CellError(newer[1], cell=cell.index, line=offset + newer[0], source=body[newer[0] - 1]) from None
        raise CellError(f"cannot read IPython syntax: {exc.msg}", cell=cell.index, line=offset + (exc.lineno or 1)) from None
    if len(transformed.splitlines()) == 1:  # IPython's automagic: ``pip install x`` runs as %pip
        transformed = (automagic(transformed, bound or frozenset()) or transformed.rstrip("\n")) + "\n"
    t_map = align(body, transformed.splitlines())
    try:
        return transformed, t_map, ast.parse(transformed)
    except SyntaxError as exc:
        newer = newer_python(body)
        if newer:
            raise CellError(newer[1], cell=cell.index, line=offset + newer[0], source=body[newer[0] - 1]) from None
        src_line = _body_line(t_map, exc.lineno or 1, offset)
        raise CellError(f"not valid Python: {exc.msg}", cell=cell.index, line=src_line, source=_line_at(lines, src_line)) from None


def _one_expression(tree: ast.Module, body: list[str]) -> bool:
    """A cell of one line holding one expression: where IPython's automagic may read a magic Python reads too."""
    return len(tree.body) == 1 and isinstance(tree.body[0], ast.Expr) and sum(1 for ln in body if ln.strip()) == 1


#: A line IPython's token transformers may rewrite: an escape first (``!cmd``, ``%magic``, ``?obj``),
#: ``x = !cmd`` / ``x = %magic``, or ``obj?`` last.
_ESCAPE_LINE = re.compile(r"^\s*[!%?]|=\s*[!%]|\?\s*$")
#: What only a transform of the whole cell reads right: a cell magic below the first line, the autocall
#: escapes (``/f x``, ``,f a b``, ``;f a``: at a line's start they may also continue a bracket), prompts of
#: pasted sessions (``>>>``, ``...``, ``In [1]:``, ``...:``), and a first line that is indented.
_WHOLE_CELL = re.compile(r"^\s*(?:%%|[/,;]|>>>|\.\.\.|In \[\d+\]:)|\A[ \t]+\S", re.M)


def _transform_escape_lines(body: list[str]) -> tuple[str, ast.Module] | None:
    """The body with IPython's transformers run on its escape lines alone, and its ast; None where unsure.

    IPython's token transformers each rewrite one logical line (``!pip install x`` →
    ``get_ipython().system('pip install x')``), but ``TransformerManager.transform_cell`` tokenizes the
    whole cell again for every line it rewrites. Here each line that may hold an escape (with the lines a
    trailing backslash continues) goes through the transformer IPython would apply first
    (``do_one_token_transform``) on its own, at no indentation, and gets its indentation back (a line still
    holding an escape after that would not parse: the whole cell goes through then); the other lines stay, as IPython would leave them (leading blank lines dropped,
    whitespace-only lines emptied, as its ``leading_empty_lines`` and ``leading_indent`` do). The result
    counts only if it parses and every line IPython rewrote is a ``get_ipython()`` call there (a line inside a
    multi-line string is not); otherwise, and for anything in ``_WHOLE_CELL``, the caller transforms the
    whole cell.
    """
    start = next((i for i, line in enumerate(body) if line.strip()), len(body))
    text = "\n".join(body[start:])
    if _WHOLE_CELL.search(text):
        return None
    out: list[str] = []
    rewritten: list[int] = []  # 1-based lines of ``out`` that IPython rewrote
    i = start
    while i < len(body):
        line = body[i]
        if not _ESCAPE_LINE.search(line) or line.lstrip().startswith("#"):
            out.append(line if line.strip() else "")
            i += 1
            continue
        j = i
        while body[j].rstrip().endswith("\\") and j + 1 < len(body):
            j += 1
        indent = line[: len(line) - len(line.lstrip())]
        group = [line[len(indent) :]] + body[i + 1 : j + 1]
        changed, new = _transformer().do_one_token_transform([text + "\n" for text in group])
        new = [text.rstrip("\n") for text in new]
        if changed and new != group:
            if len(new) != 1:
                return None
            rewritten.append(len(out) + 1)
            group = new
        out += [indent + group[0]] + group[1:]
        i = j + 1
    code = "\n".join(out) + "\n"
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return None
    calls = {n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
             and n.func.id == "get_ipython"}
    return (code, tree) if calls.issuperset(rewritten) else None


def _line_for_line(body: list[str], transformed: list[str]) -> list[int | None] | None:
    """The line map of ``_transform_escape_lines``'s result where it kept one line for each body line (its
    leading blank lines dropped), known without a diff; None where a continued escape became one line."""
    start = next((i for i, line in enumerate(body) if line.strip()), len(body))
    return list(range(start, len(body))) if len(transformed) == len(body) - start else None


#: Lines from which a cell's conversion is said before it starts: the converter's passes are linear, but a cell
#: of 873,000 lines (a pasted data file) still takes tens of seconds, which would otherwise pass in silence.
LONG_CELL_LINES = 100_000


def _say_when_long(cell: Cell, count: int) -> None:
    """One line on stderr before a very long cell converts, so the wait is not taken for a hang."""
    if count >= LONG_CELL_LINES:
        print(f"nbddp: cell {cell.index} holds {count:,} lines: converting it takes a while (about 30 s a million "
              "lines); code that long is usually data, which a file the notebook reads keeps out of the script",
              file=sys.stderr, flush=True)


def _body_line(t_map: list[int | None], transformed_line: int, offset: int) -> int:
    j = t_map[transformed_line - 1] if 0 < transformed_line <= len(t_map) else None
    return (j if j is not None else transformed_line - 1) + 1 + offset


_PLACEHOLDER_LINE = re.compile(rf"^(\s*){PLACEHOLDER}  # (.*)$", re.M)


def _finish(code: str) -> tuple[str, ast.Module]:
    """Placeholders become comments, or ``pass  # …`` where a block would be left empty; and the code's ast."""
    as_comments = _PLACEHOLDER_LINE.sub(r"\1# \2", code)
    try:
        return as_comments, ast.parse(as_comments)
    except SyntaxError:
        code = _PLACEHOLDER_LINE.sub(r"\1pass  # \2", code)
    try:
        return code, ast.parse(code)
    except SyntaxError as exc:
        raise CodeError(f"not valid Python: {exc.msg}", exc.lineno or 1) from None


def _line_at(lines: list[str], line: int) -> str:
    return lines[line - 1] if 0 < line <= len(lines) else ""


#: The program a shell cell magic runs its cell with (``%%script PROGRAM`` names its own).
_SHELL_PROGRAMS = {"shell": "bash", "system": "sh"}


def _shell_cell(cell: Cell, body: list[str], offset: int, name: str, head: str) -> CleanCell:
    """A ``%%bash``/``%%sh``/``%%script PROGRAM`` cell: one script, run once per node by ``_nbddp.shell_cell``
    (shell variables, ``cd`` and ``\\`` continuations hold across its lines, as in the kernel). A cell of
    nothing but installs joins the install plan instead."""
    lines = [(i, text.strip()) for i, text in enumerate(body, start=offset + 1)
             if text.strip() and not text.lstrip().startswith("#")]
    if lines and all(is_install(text) and not interpolates(text) and not installs_local_files(text)
                     and not text.endswith("\\") for _, text in lines):
        installs = tuple(Install(cell.index, i, text) for i, text in lines)
        return CleanCell(cell, "", (), installs, (Note(offset, f"%%{name} cell of installs: they run before launch"),))
    options = head[len(name) :].strip()
    program = options if name == "script" else f"{_SHELL_PROGRAMS.get(name, name)} {options}".strip()
    if not program:
        raise CellError("%%script needs a program to run the cell with (%%script bash)", cell=cell.index, line=offset)
    script = "\n".join(body) + "\n"
    code = f"_nbddp.shell_cell({program!r}, {script!r})\n"
    note = Note(offset, f"%%{name} cell runs as one script, once per node")
    return CleanCell(cell, code, (offset,), (), (note,))


def _writefile_cell(cell: Cell, head: str, body: list[str], offset: int) -> CleanCell:
    """``%%writefile [-a] path``: written once per node, before the other processes read it."""
    try:
        args = shlex.split(head)[1:]  # as IPython's magic_arguments splits it
    except ValueError as exc:  # "No closing quotation": the kernel refuses the cell with the same words
        raise CellError(f"%%writefile's line cannot be read: {str(exc).lower()}; close the quote around the file "
                        "name", cell=cell.index, line=offset, source=f"%%{head}") from None
    append = any(a in ("-a", "--append") for a in args)
    paths = [a for a in args if not a.startswith("-")]
    if not paths:
        raise CellError("%%writefile needs a file name", cell=cell.index, line=offset)
    text = "\n".join(body) + "\n"
    code = f"_nbddp.write_file({paths[0]!r}, {text!r}, append={append})\n"
    return CleanCell(cell, code, (offset,), (), (Note(offset, f"%%writefile {paths[0]} written once per node"),))


