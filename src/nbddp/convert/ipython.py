"""What IPython's syntax means in a script every rank runs: the cleaner's knowledge of IPython, in one place.

Cell magics (``cell_magic``: what a ``%%name`` cell is), line magics and shell lines (``Magics``: what each
``get_ipython()`` statement IPython's transformers write becomes, an ``Action`` of a ``Kind``), and installs
(``is_install``; those that read local files or expand ``{expr}``/``$name`` keep their place). ``clean.py``
applies the answers as text, ``ipycalls.py`` with libcst; neither decides anything of its own.
"""

from __future__ import annotations

import enum
import functools
import re
from dataclasses import dataclass

from .code import CodeError

#: Line magics with no meaning in a script: dropped, with a note.
DROPPED_LINE_MAGICS = frozenset(
    "matplotlib load_ext reload_ext unload_ext autoreload aimport config pylab who whos who_ls pinfo pinfo2 "
    "psearch pdoc pdef psource pfile history recall rerun logstart logstop xmode colors precision "
    "reset reset_selective store alias unalias rehashx doctest_mode notebook qtconsole tensorboard autosave "
    "lsmagic magic quickref page pprint pdb wandb clear connect_info".split()
)
#: Line magics that wrap a statement: ``%time x = f()`` runs ``x = f()``.
STATEMENT_LINE_MAGICS = frozenset({"time", "timeit", "prun", "capture"})
#: Cell magics that wrap a body of Python: the body is kept, the wrapper dropped.
WRAPPER_CELL_MAGICS = frozenset({"capture", "time", "timeit", "prun"})
#: Cell magics whose body is shell.
SHELL_CELL_MAGICS = frozenset({"bash", "sh", "script", "system", "shell"})
#: Colab's form annotations (``#@title …``, ``#@markdown …``): a cell magic after them is the cell's magic.
FORM_LINE = re.compile(r"^\s*#\s*@(?:title|markdown|param)\b")
#: Cell magics that only display something in the notebook.
DISPLAY_CELL_MAGICS = frozenset({"html", "HTML", "markdown", "javascript", "js", "latex", "svg"})


class CellMagic(enum.Enum):
    """What a cell under a ``%%name`` cell magic is."""

    CAPTURE = enum.auto()  #: ``%%capture``: Python, whose printed output the script keeps from the console
    WRAPPER = enum.auto()  #: ``%%time`` and the like: Python, the magic dropped
    SHELL = enum.auto()  #: ``%%bash`` and the like: a shell script
    WRITEFILE = enum.auto()  #: ``%%writefile path``: a file written
    DISPLAY = enum.auto()  #: ``%%html`` and the like: shown in the notebook, left out
    OTHER = enum.auto()  #: anything else: not Python, left out


def cell_magic(name: str) -> CellMagic:
    """What a cell under ``%%name`` is."""
    if name == "capture":
        return CellMagic.CAPTURE
    if name in WRAPPER_CELL_MAGICS:
        return CellMagic.WRAPPER
    if name in SHELL_CELL_MAGICS:
        return CellMagic.SHELL
    if name == "writefile":
        return CellMagic.WRITEFILE
    return CellMagic.DISPLAY if name in DISPLAY_CELL_MAGICS else CellMagic.OTHER


#: The name a statement that leaves the script stands as until the cleaner makes it a comment.
PLACEHOLDER = "_NBDDPPLACEHOLDER_"


class Kind(enum.Enum):
    """What a ``get_ipython()`` statement becomes in the script."""

    KEEP = enum.auto()  #: left as it is
    SHELL = enum.auto()  #: ``_nbddp.shell(…)`` with the call's own arguments
    SHELL_COMMAND = enum.auto()  #: ``_nbddp.shell(command)``, the command being the action's ``value``
    DROPPED = enum.auto()  #: gone: a ``# nbddp: value`` comment (``pass  # nbddp: …`` where a block needs one)
    STATEMENT = enum.auto()  #: the action's ``value``, Python code of one line


@dataclass(frozen=True)
class Action:
    """What one ``get_ipython()`` statement becomes: a ``Kind``, and the command, note or code it needs."""

    kind: Kind
    value: str | None = None

    def text(self, args: str) -> str | None:
        """The replacing statement's code, ``args`` being the call's arguments as written; None: kept as is."""
        if self.kind is Kind.KEEP:
            return None
        if self.kind is Kind.SHELL:
            return f"_nbddp.shell({args})"
        if self.kind is Kind.SHELL_COMMAND:
            return f"_nbddp.shell({self.value!r})"
        if self.kind is Kind.DROPPED:
            return f"{PLACEHOLDER}  # nbddp: {self.value}"
        return self.value


_INSTALL = re.compile(
    r"^\s*(?:sudo\s+)?(?:(?:python[0-9.]*|py)\s+-m\s+)?(?:pip[0-9.]*|uv\s+pip|conda|mamba|micromamba|apt|apt-get)"
    r"\s+(?:un)?install\b"
)


def is_install(command: str) -> bool:
    """Whether a shell command installs or uninstalls packages (pip, uv pip, conda, mamba, apt). An uninstall is
    one too: run in the ranks it would come after the installs run before launch (``pip uninstall -y protobuf``
    then ``pip install protobuf==…`` would end with protobuf removed); with them, the notebook's order holds."""
    return bool(_INSTALL.match(command))


#: An install that reads files: ``-e``/``-r``/``-c``, or a path (``.``, ``./repo[extra]``, ``/x.whl``, ``~/pkg``,
#: ``file:``). Such files are often made by an earlier cell (a clone, ``%%writefile``, ``%cd``): the install
#: keeps its place in the notebook's order rather than running before launch.
_LOCAL_INSTALL = re.compile(r"(?:^|\s)(?:-e|--editable|-r|--requirement)\b|(?:^|\s)['\"]?(?:\.{1,2}(?:/|\[|['\"]?(?:\s|$))|/|~|file:)")


def installs_local_files(command: str) -> bool:
    """Whether an install reads local files (an editable or path install, a requirements file)."""
    return bool(_LOCAL_INSTALL.search(command.split(" install", 1)[-1]))


def interpolates(command: str) -> bool:
    """IPython expands ``{expr}`` and ``$name`` in shell lines from the kernel's namespace."""
    return bool(re.search(r"\{[^}]*\}|\$[A-Za-z_]", command))


@functools.cache
def _automagic_names() -> tuple[frozenset[str], dict[str, str]]:
    """The line magics and shell aliases a fresh IPython shell knows: what its automagic may run without a
    ``%``. From IPython's own tables (``BUILTIN_LAZY_MAGICS`` since 9, else its magic classes) and its default
    aliases (``ls``, ``mkdir``, ``cp`` …, each with the command it runs)."""
    from IPython.core import magics
    from IPython.core.alias import default_aliases

    table = getattr(magics, "BUILTIN_LAZY_MAGICS", None)
    if table is not None:
        names = set(table["line"])
    else:  # IPython 8: the classes InteractiveShell.init_magics registers
        names = {name for kind in dir(magics) if kind.endswith("Magics")
                 for name in getattr(getattr(magics, kind), "magics", {}).get("line", ())}
    aliases = dict(default_aliases())
    return frozenset(names | set(aliases)), aliases


def automagic(line: str, bound: frozenset[str] | set[str] = frozenset()) -> str | None:
    """A one-line cell as IPython's automagic reads it: ``pip install x`` → ``get_ipython().run_line_magic(
    'pip', 'install x')``; None where IPython would run it as Python.

    IPython applies its prefilter (``InteractiveShell.transform_cell``) only to a cell that is one line after
    its input transformers: there ``AssignmentChecker`` keeps ``pip = 1`` Python and ``AutoMagicChecker``
    runs a line whose first word is a magic or an alias as that magic, unless a keyword or a builtin shadows
    it, or a name the kernel's namespace holds (``bound``: the names the notebook's earlier cells bind). The
    split of the line (``LineInfo``) and the call written (``MagicHandler.handle``, which reads nothing but
    the line) are IPython's own."""
    import builtins
    import keyword

    from IPython.core.prefilter import MagicHandler
    from IPython.core.splitinput import LineInfo

    info = LineInfo(line.rstrip("\n"))
    head = info.ifun.split(".", 1)[0]
    if info.esc or info.ifun not in _automagic_names()[0] or info.the_rest[:1] in ("=", ","):
        return None
    if keyword.iskeyword(head) or hasattr(builtins, head) or head in bound:
        return None
    return MagicHandler.handle(None, info)  # a plain function of the line: no shell needed


def alias_command(name: str, arg: str) -> str | None:
    """The shell command IPython's default alias ``name`` runs with ``arg`` (``ls data`` → ``ls -F --color
    data``), as ``Alias.__call__`` writes it; None for a name that is no alias."""
    command = _automagic_names()[1].get(name)
    if command is None:
        return None
    return command.replace("%l", arg) if "%l" in command else f"{command} {arg}".strip()


class Magics:
    """What each ``get_ipython()`` statement of a cell becomes, and the installs and notes that go with it.

    Asked by both ways a statement is rewritten (as text in ``clean.py``, or with libcst in ``ipycalls.py``),
    one statement at a time in the order they come; the answer is an ``Action``.
    """

    def __init__(self, lines: list[str]):
        self.lines = [ln.strip() for ln in lines]
        self._next = 0  # statements come in order: where to look for the next one's line
        self.installs: list[tuple[int, str]] = []
        self.notes: list[tuple[int, str]] = []

    def line_of(self, text: str) -> int:
        """The line of a one-line statement in the transformed cell: the next line with its text.

        (libcst's positions would generate the cell's source once more; a ``get_ipython()`` statement is one
        line, and statements are asked about in the order they come.)
        """
        for k in range(self._next, len(self.lines)):
            if self.lines[k] == text:
                self._next = k + 1
                return k + 1
        return self._next or 1

    @staticmethod
    def _pulls_out(command: str, dead: bool) -> bool:
        return is_install(command) and not interpolates(command) and not dead and not installs_local_files(command)

    def statement(self, method: str, first: str | None, second: str | None, text: str, dead: bool) -> Action:
        """``get_ipython().method(first, second)``, a statement of its own whose code is ``text``.

        ``first``/``second``: its string arguments (None where absent or not a string); ``dead``: it sits in
        ``if False:`` (nothing is pulled out; the block stays as written).
        """
        line = self.line_of(text)
        if method == "system":
            if first is not None and self._pulls_out(first, dead):
                self.installs.append((line, first.strip()))
                return Action(Kind.DROPPED, f"`{first.strip()}` runs once before launch")
            return Action(Kind.SHELL)
        if method == "run_line_magic":
            return self._line_magic(first, second or "", line, dead)
        return Action(Kind.KEEP)

    def _line_magic(self, name: str | None, arg: str, line: int, dead: bool) -> Action:
        if name in ("pip", "conda", "mamba", "uv"):
            command = f"{name} {arg}".strip() if name != "uv" else f"uv {arg}"
            if self._pulls_out(command, dead):
                self.installs.append((line, command))
                return Action(Kind.DROPPED, f"`{command}` runs once before launch")
            return Action(Kind.SHELL_COMMAND, command)
        if name in STATEMENT_LINE_MAGICS:
            import libcst as cst  # what libcst reads as one statement is what the script can hold

            try:
                stmt = cst.parse_statement(arg + "\n")
            except cst.ParserSyntaxError:
                raise CodeError(f"%{name} wraps code that is not valid Python", line) from None
            self.notes.append((line, f"%{name} dropped; its statement is kept"))
            return Action(Kind.STATEMENT, cst.Module([]).code_for_node(stmt).rstrip("\n"))
        if name == "env":
            key, _, value = arg.replace("=", " ", 1).partition(" ")
            if not key or not value.strip():
                self.notes.append((line, "%env without a value dropped"))
                return Action(Kind.DROPPED, f"%env {arg} dropped")
            value = f"_nbddp.expand({value.strip()!r})" if interpolates(value) else repr(value.strip())
            return Action(Kind.STATEMENT, f"os.environ[{key!r}] = {value}")
        if name == "cd":
            return Action(Kind.STATEMENT, f"_nbddp.cd({arg.strip()!r})")
        if name is not None and (command := alias_command(name, arg.strip())) is not None:
            return Action(Kind.SHELL_COMMAND, command)  # ``ls``, ``mkdir x``: IPython's aliases run a shell
        if name in DROPPED_LINE_MAGICS or name is None:
            self.notes.append((line, f"%{name} dropped (notebook-only)"))
            return Action(Kind.DROPPED, f"%{name} {arg}".rstrip() + " dropped (notebook-only)")
        raise CodeError(f"%{name} has no meaning in a training script; remove it or move it to a cell after %%ddp_train", line)
