"""Where a job's cells come from: a notebook file read with nbformat, or sources handed over directly. A job
started from a kernel selects its cells in ``selection.py`` (what a selection is, ``%%ddp_setup``'s registry, the
notebook file the kernel runs) and ``kernel_cells.py`` (the saved notebook's cells as the kernel ran them, or the
kernel's history; ``executions.py`` records what the kernel ran)."""

from __future__ import annotations

import json
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

from .notebook_format import nbformat  # first: any nbformat import loads jsonschema, which it loads lazily

from nbformat.warnings import MissingIDFieldWarning  # noqa: E402

from .errors import NotebookError, printable

#: Cells carrying this tag are never part of a job: a template's launch cell, a plot, a note to self.
SKIP_TAG = "nbddp-skip"


@dataclass(frozen=True)
class Cell:
    """One code cell. ``index`` is its 1-based position among all the notebook's cells, as a person counts."""

    index: int
    source: str
    origin: str = "<cells>"


def read_notebook(path: str | Path) -> list[Cell]:
    """The code cells of the notebook at ``path``, less those tagged ``nbddp-skip`` (see ``load_notebook``)."""
    return load_notebook(path)[0]


def load_notebook(path: str | Path) -> tuple[list[Cell], tuple[str, ...]]:
    """The code cells of the notebook at ``path``, less those tagged ``nbddp-skip``, and notes on what was
    repaired to read it (see ``read_nbformat``). A Python script (``.py``) is read as cells too
    (``script_cells``), so ``nbddp run train.py`` takes a script as it takes a notebook."""
    if Path(path).suffix == ".py":
        return script_cells(path), ()
    nb, notes = read_nbformat(path)
    return notebook_cells(nb, origin=str(path)), notes


#: A cell marker of the percent format (VS Code, Spyder, jupytext): ``# %%`` starts a cell.
_PERCENT = re.compile(r"^# ?%%(?!%)")


def script_cells(path: str | Path) -> list[Cell]:
    """A Python script's cells: the parts between ``# %%`` markers where it has them (markdown parts,
    ``# %% [markdown]``, left out but counted, as a notebook counts its cells), else the whole file as one
    cell, so a failure maps to the script's own line where the file is one cell."""
    path = Path(path)
    try:
        text = path.read_bytes().decode("utf-8-sig")
    except FileNotFoundError:
        raise NotebookError(f"{path}: no such script") from None
    except OSError as exc:
        raise NotebookError(f"{path}: cannot read: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise NotebookError(f"{path}: not UTF-8 (byte {exc.start}); save the script as UTF-8") from None
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if _PERCENT.match(line)]
    if not starts:
        return [Cell(1, text, str(path))]
    parts = ([lines[: starts[0]]] if "\n".join(lines[: starts[0]]).strip() else []) + [
        lines[a:b] for a, b in zip(starts, starts[1:] + [len(lines)])
    ]
    cells = []
    for index, part in enumerate(parts, start=1):
        if part and _PERCENT.match(part[0]) and "[markdown]" in part[0]:
            continue
        body = part[1:] if part and _PERCENT.match(part[0]) else part
        cells.append(Cell(index, "\n".join(body), str(path)))
    return cells


def read_nbformat(path: str | Path) -> tuple[nbformat.NotebookNode, tuple[str, ...]]:
    """The notebook at ``path`` as nbformat reads it, and notes on what was repaired to read it.

    What Jupyter opens is read: a notebook that fails nbformat's schema is upgraded and normalised as nbformat
    can (``repair``), with a note. Raises ``NotebookError`` with a one-line reason for a missing file, bad
    encoding, invalid JSON, or a file with no cells Jupyter could show.
    """
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise NotebookError(f"{path}: no such notebook") from None
    except OSError as exc:
        raise NotebookError(f"{path}: cannot read: {exc.strerror}") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise NotebookError(f"{path}: not UTF-8 (byte {exc.start}); save the notebook as UTF-8") from None
    invalid: dict = {}  # nbformat validates while it reads; asked again it would validate twice
    try:
        with warnings.catch_warnings():  # cells without ids get them, as Jupyter gives them, without a word
            warnings.simplefilter("ignore", MissingIDFieldWarning)
            nb = nbformat.reads(text, as_version=4, capture_validation_error=invalid)
    except nbformat.reader.NotJSONError as exc:
        bad = exc.__cause__
        where = f"line {bad.lineno}, column {bad.colno}: {bad.msg}" if isinstance(bad, json.JSONDecodeError) else exc
        raise NotebookError(f"{path}: not valid JSON ({where})") from None
    except Exception as exc:  # nbformat raises several types for structurally wrong files
        raise NotebookError(f"{path}: not a notebook: {_what_is_wrong(json.loads(text)) or exc}") from None
    notes: tuple[str, ...] = ()
    if "ValidationError" in invalid:
        nb, notes = repair(nb, invalid["ValidationError"], path)
    return nb, notes


def repair(nb: nbformat.NotebookNode, error, path: Path) -> tuple[nbformat.NotebookNode, tuple[str, ...]]:
    """A notebook that fails nbformat's schema, made valid where nbformat can, and what was done.

    Cell ids under ``nbformat_minor`` < 5 are what nbformat's v4 upgrade adds: the notebook becomes 4.5,
    keeping the ids it has. Unknown keys and metadata are dropped (``nbformat.validator.normalize``).
    Whatever is still invalid is noted; only a notebook without readable code cells is refused, as Jupyter
    shows nothing of it either.
    """
    from nbformat.v4.nbbase import random_cell_id

    problem = shape_problem(nb)
    if problem:  # before nbformat's validator, which fails with a Python error on these (a number + "_cell")
        raise NotebookError(f"{path}: not a notebook: {problem}")
    cells = nb.get("cells")
    if not isinstance(cells, list):
        raise NotebookError(f"{path}: invalid notebook: {error.message}")
    done = []
    if nb.get("nbformat_minor", 0) < 5 and any("id" in c for c in cells):
        for cell in cells:
            cell.setdefault("id", random_cell_id())
        nb.nbformat_minor = 5
        done.append("cell ids: read as nbformat 4.5")
    _, fixed = nbformat.validator.normalize(nb, 4, nb.nbformat_minor, relax_add_props=True, strip_invalid_metadata=True)
    nb = nbformat.from_dict(fixed)
    if any(not isinstance(c.get("source", ""), str) for c in nb.cells):
        raise NotebookError(f"{path}: invalid notebook: {error.message}")
    still = next(nbformat.validator.iter_validate(nb), None)
    if still is not None:
        done.append(f"still {still.message}")
    note = f"{path.name} is not valid nbformat ({error.message}); read as Jupyter reads it"
    return nb, (note + (f" ({'; '.join(done)})" if done else ""),)


def shape_problem(nb: object) -> str | None:
    """What keeps a file's JSON from having a notebook's shape, said so a person can fix it (naming the cell), or
    None. nbformat's reader and validator assume this much: an object, a list of cells, each an object with a
    text ``cell_type`` and a text ``source``; given less they fail with a Python error (``'list' object has no
    attribute 'get'``, ``unsupported operand type(s) for +: 'int' and 'str'``)."""
    if not isinstance(nb, dict):
        return f'the file holds a JSON {_json_kind(nb)}, not a notebook (an object with "cells")'
    if "cells" not in nb:
        return None  # nbformat 3's worksheets, or no cells at all: nbformat's own word on it
    if not isinstance(nb["cells"], list):
        return f'"cells" is a JSON {_json_kind(nb["cells"])}, not a list of cells'
    for index, cell in enumerate(nb["cells"], start=1):
        if not isinstance(cell, dict):
            return f'cell {index} is a JSON {_json_kind(cell)}, not a cell (an object with "cell_type" and "source")'
        if "cell_type" not in cell:
            return f'cell {index} has no "cell_type" ("code", "markdown" or "raw")'
        if not isinstance(cell["cell_type"], str):
            return f'cell {index}: "cell_type" is a JSON {_json_kind(cell["cell_type"])}, not "code", "markdown" or "raw"'
        source = cell.get("source", "")
        if not (isinstance(source, str) or isinstance(source, list) and all(isinstance(s, str) for s in source)):
            return f'cell {index}: "source" is a JSON {_json_kind(source)}, not text (a string or a list of strings)'
    return None


def _what_is_wrong(data: object) -> str | None:
    """Why a file's JSON, which nbformat's reader failed on, is no notebook: its shape (``shape_problem``), else,
    for an nbformat 4 file, the first place it breaks the schema (``schema_problem``)."""
    problem = shape_problem(data)
    if problem or not (isinstance(data, dict) and data.get("nbformat") == 4):
        return problem
    minor = data.get("nbformat_minor")
    return schema_problem(data, minor if isinstance(minor, int) and 0 <= minor <= 5 else 5)


#: The keys that say which schema a cell or an output follows (one branch of the schema's ``oneOf``).
_KIND_KEYS = ("cell_type", "output_type")


def schema_problem(data: dict, minor: int = 5) -> str | None:
    """The first place ``data`` breaks nbformat 4's schema, said where (cell N, the key in it) and what, or None.

    jsonschema's own message quotes the whole value (a cell, its outputs); where a cell or an output matches
    none of the schema's kinds, the errors of the kind it names are the ones that say what is wrong."""
    from jsonschema.exceptions import best_match
    from nbformat.validator import get_validator

    error = best_match(get_validator(4, minor, name="jsonschema").iter_errors(data))
    while error is not None and error.validator in ("oneOf", "anyOf") and error.context:
        branches: dict = {}
        for sub in error.context:
            branches.setdefault(sub.relative_schema_path[0], []).append(sub)
        named = [errs for errs in branches.values()  # the kind the value names: its cell_type passed
                 if not any(e.relative_path and e.relative_path[-1] in _KIND_KEYS for e in errs)]
        if not named:
            break
        error = best_match(named[0])
    if error is None:
        return None
    place = _schema_place(list(error.absolute_path))
    kind_key = next((k for k in _KIND_KEYS if isinstance(error.instance, dict) and k in error.instance), None)
    if error.validator == "oneOf" and kind_key:  # no schema has this cell or output kind
        place = _schema_place([*error.absolute_path, kind_key])
        return f"{place}is {json.dumps(error.instance[kind_key])[:60]}, a kind nbformat does not know"
    return f"{place}{_schema_message(error)}"


def _schema_place(path: list) -> str:
    """``['cells', 2, 'outputs', 0, 'data']`` as "cell 3: outputs[0].data: " (cells counted from 1)."""
    where = ""
    if len(path) >= 2 and path[0] == "cells" and isinstance(path[1], int):
        where, path = f"cell {path[1] + 1}: ", path[2:]
    dotted = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")
    return where + (f'"{dotted}" ' if dotted else "")


#: A JSON schema's type names as a message says them.
_SCHEMA_TYPES = {"object": "an object", "array": "a list", "string": "a string", "integer": "a whole number",
                 "number": "a number", "boolean": "true or false", "null": "null"}


def _schema_message(error) -> str:
    """One schema error in words, quoting no more of the value than a short one."""
    if error.validator == "type":
        wanted = error.validator_value if isinstance(error.validator_value, list) else [error.validator_value]
        return f"is a JSON {_json_kind(error.instance)}, not {' or '.join(_SCHEMA_TYPES.get(w, w) for w in wanted)}"
    shown = json.dumps(error.instance)
    if error.validator == "enum":
        return f"is {shown[:60]}, not one of {', '.join(json.dumps(v) for v in error.validator_value)}"
    message = error.message if len(shown) < 80 else error.message.replace(repr(error.instance), "the value")
    return printable(message)[:200]


def _json_kind(value: object) -> str:
    """A JSON value's kind as JSON names it ("list", not Python's "list"; "object", not "dict")."""
    if isinstance(value, bool):
        return "boolean"
    kinds = ((dict, "object"), (list, "array (list)"), (str, "string"), ((int, float), "number"), (type(None), "null"))
    return next(name for types, name in kinds if isinstance(value, types))


def notebook_cells(nb: nbformat.NotebookNode, origin: str = "<notebook>") -> list[Cell]:
    """The code cells of a notebook already in memory, less those tagged ``nbddp-skip``."""
    return [
        Cell(index=i, source=cell.get("source", ""), origin=origin)
        for i, cell in enumerate(nb.cells, start=1)
        if cell.cell_type == "code" and SKIP_TAG not in cell.get("metadata", {}).get("tags", [])
    ]


def cells_from_sources(sources: list[str], origin: str = "<cells>") -> list[Cell]:
    """Cells from plain source strings, numbered 1, 2, …"""
    return [Cell(index=i, source=src, origin=origin) for i, src in enumerate(sources, start=1)]

