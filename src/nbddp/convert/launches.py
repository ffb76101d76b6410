"""Where a notebook without a training call nbddp recognises seems to train: a command it launches.

Notebooks often start their training from a shell line (``!torchrun --nproc_per_node=2 train.py`` after a
``%%writefile train.py`` cell, ``!python scripts/run_sft.py …``, ``%%bash`` + ``torchrun …``, ``!deepspeed …``,
``!accelerate launch …``, ``!{sys.executable} -m torch.distributed.run …``, ``!python -m axolotl.cli.train cfg.yml``). A shell comment on the line (``!sleep 20  # then python run.py``) runs nothing. Running every cell of such a notebook on every rank would run the command once per
rank while the other ranks wait in a barrier, so ``job.run_job`` refuses it before launch and names the line
found here. Read from the cells as written (the cell's own line numbers), with a regular expression: a shell
line is text, not Python.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..cells import Cell

#: A command that trains: a launcher of N processes, or Python running a script or a module's launcher.
_COMMAND = re.compile(
    r"(?<![\w.-])(torchrun|accelerate\s+launch|deepspeed|axolotl\s+train|"
    r"(?:python[0-9.]*|\{sys\.executable\}|\$\{?PYTHON\}?)\s+(?:-\S+\s+)*"
    r"(?:-m\s+torch\.distributed\.(?:run|launch)|-m\s+accelerate\.commands\.launch|-m\s+axolotl\.cli\.train|"
    r"[\w./{}$-]+\.py))"
    r"(?![\w-])"
)
#: Cell magics whose body is shell text.
_SHELL_CELL = re.compile(r"^\s*%%(bash|sh|script\s+(ba)?sh|system)\b")
#: A line that hands its text to the shell: ``!cmd``, ``%sx``/``%system``, ``os.system(…)``, ``subprocess.…(…)``.
_SHELL_LINE = re.compile(r"^\s*(!|%sx\b|%system\b|.*\bos\.system\(|.*\bsubprocess\.\w+\(|.*=\s*!)")
#: An install line names packages, not commands (``pip install "deepspeed==0.8.0"``).
_INSTALL = re.compile(r"\b(pip3?|conda|mamba|uv\s+pip|apt(-get)?)\s+install\b")
#: ``%%writefile [-a] name.py``: the cell that writes a script a shell line may run.
_WRITEFILE = re.compile(r"^\s*%%writefile(?:\s+-a)?\s+(\S+\.py)\s*$")


@dataclass(frozen=True)
class Launch:
    """A shell line that seems to start the notebook's training, at its cell and line (1-based)."""

    cell: int
    line: int
    text: str
    #: the cell whose ``%%writefile`` wrote the script the line runs, or None; the script's name, and the
    #: cell line holding the script's line 1
    written_by: int | None = None
    script: str | None = None
    first_line: int = 2

    def __str__(self) -> str:
        where = f"cell {self.cell}, line {self.line}: {self.text.strip()}"
        return where + (f" (its script is written by cell {self.written_by}'s %%writefile)" if self.written_by else "")


def find_launches(cells: list[Cell] | tuple[Cell, ...]) -> tuple[Launch, ...]:
    """Every shell line of ``cells`` that launches a training command, in the notebook's order."""
    written = _written_scripts(cells)
    found = []
    for cell in cells:
        lines = cell.source.splitlines()
        if next((bool(_WRITEFILE.match(ln)) for ln in lines if ln.strip()), False):
            continue  # the script's own text: its `python` words are not commands
        shell_cell = bool(lines) and bool(_SHELL_CELL.match(lines[0]))
        for number, line in enumerate(lines, start=1):
            if line.lstrip().startswith("#") or not (shell_cell and number > 1 or _SHELL_LINE.match(line)):
                continue
            command = _without_shell_comment(line)
            match = None if _INSTALL.search(command) else _COMMAND.search(command)
            if match:
                script = next((name for name in written if name in line), None)
                cell_at, first = written.get(script, (None, 2))
                found.append(Launch(cell.index, number, line, cell_at, script, first))
    return tuple(found)


def _without_shell_comment(line: str) -> str:
    """``line`` up to its shell comment (``!sleep 20  # then python run.py``: a ``#`` after a space, outside
    quotes), which names commands without running them."""
    quote = None
    for i, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and i > 0 and line[i - 1].isspace():
            return line[:i]
    return line


#: A command that starts N processes itself: the likeliest training of a notebook with several commands.
_STARTS_PROCESSES = re.compile(
    r"(?<![\w.-])(torchrun|accelerate\s+launch|deepspeed|-m\s+torch\.distributed\.(?:run|launch))(?![\w-])"
)


def leading_launch(launches: tuple[Launch, ...]) -> Launch:
    """The launch a message names: the first that starts N processes (a notebook may run demo or preparation
    scripts with ``!python`` before its ``!torchrun`` training), else the first."""
    return next((launch for launch in launches if _STARTS_PROCESSES.search(launch.text)), launches[0])


def _written_scripts(cells) -> dict[str, tuple[int, int]]:
    """``{file name: (cell, cell line of the file's line 1)}`` of the ``.py`` files ``%%writefile`` cells
    write (the last writer of each)."""
    written = {}
    for cell in cells:
        lines = cell.source.splitlines()
        at = next((i for i, line in enumerate(lines) if line.strip()), None)
        match = _WRITEFILE.match(lines[at]) if at is not None else None
        if match:
            written[match.group(1).rsplit("/", 1)[-1]] = (cell.index, at + 2)
    return written


#: A line that looks like training nbddp does not recognise: ``.fit(``, ``train(``, ``optimizer.step(``.
_SEEMS = re.compile(r"\.fit\(|\btrain\w*\(|\.step\(|\bepochs?\b")


def seems_to_train(cells) -> str | None:
    """The first line of ``cells`` that looks like training (for a refusal: where to look), or None."""
    for cell in cells:
        for number, line in enumerate(cell.source.splitlines(), start=1):
            if not line.lstrip().startswith("#") and _SEEMS.search(line):
                return f"cell {cell.index}, line {number}: {line.strip()[:80]}"
    return None
