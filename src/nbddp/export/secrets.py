"""Find credentials written into notebook cells before an export publishes them.

A Kaggle kernel's code is readable by whoever can open the kernel (by everyone once it is public), so a
token pasted into a cell leaks with it. ``find_secrets`` looks at each cell's raw source, line by line, for
the token formats of the services a fine-tune talks to (Hugging Face, Weights & Biases, Kaggle, OpenAI-style
``sk-…`` keys, GitHub, AWS) and for long literal values assigned to names such as ``*_token``,
``api_key`` or ``password``. A value the code computes from constants (``"hf_aBc" + "DeF…"``, adjacent
literals, ``"".join([…])``, ``%``, ``.format``, f-strings, through names bound in any earlier cell) is folded
from the cells' ast (``folding.py``) and checked as if written whole, at the line that builds it.
``check_secrets`` turns the first finding into a ``SecretError`` at its cell and line, with the way Kaggle
keeps secrets out of code.
``find_leftovers`` names what the export does not publish but the notebook file still holds: tokens in
markdown, in outputs, in metadata and in cells tagged ``nbddp-skip``.
"""

from __future__ import annotations

import ast
import os
import re
from dataclasses import dataclass
from typing import Iterator

from ..cells import SKIP_TAG, Cell
from ..errors import NbddpError, SecretError
from ..notebook_format import nbformat
from .folding import StringFolder

_QUOTED = r"""["']([^"'\s]{16,})["']"""

#: (what it is, pattern); group 1, when present, is the secret itself, else the whole match.
PATTERNS: tuple[tuple[str, re.Pattern], ...] = (
    ("Hugging Face token", re.compile(r"\bhf_[A-Za-z0-9]{30,}")),
    ("OpenAI-style API key", re.compile(r"\bsk-(?:[A-Za-z0-9]+-)*[A-Za-z0-9_-]{20,}")),
    ("GitHub token", re.compile(r"\b(?:gh[pousr]_[A-Za-z0-9]{36,}|github_pat_[A-Za-z0-9_]{40,})")),
    ("AWS access key id", re.compile(r"\bAKIA[0-9A-Z]{16}\b")),
    ("Kaggle API token", re.compile(r"\bKGAT_[A-Za-z0-9]{20,}")),
    # A W&B key is 40 hex digits, a Kaggle key 32: only recognisable next to the service's name.
    ("Weights & Biases API key", re.compile(r"(?i)wandb.*?[\"'=\s]([0-9a-f]{40})\b")),
    ("Kaggle API key", re.compile(r"(?i)\bkaggle.*?[\"'=\s]([0-9a-f]{32})\b")),
    # name = "long literal", name: "…" in a dict, os.environ["NAME"] = "…", %env NAME=value
    (
        "credential",
        re.compile(
            r"(?i)\b\w*(?:token|api_?key|secret|passw(?:or)?d)\b[\"']?\]?\s*[:=]\s*" + _QUOTED
            + r"|%(?:set_)?env\s+\w*(?:token|api_?key|secret|passw(?:or)?d)\w*[=\s]+([^\s\"']{16,})"
        ),
    ),
)

#: The Kaggle secret a finding would usually be stored as.
_SECRET_NAMES = {
    "Hugging Face token": "HF_TOKEN",
    "Weights & Biases API key": "WANDB_API_KEY",
    "OpenAI-style API key": "OPENAI_API_KEY",
    "Kaggle API token": "KAGGLE_KEY",
    "Kaggle API key": "KAGGLE_KEY",
    "GitHub token": "GITHUB_TOKEN",
    "AWS access key id": "AWS_ACCESS_KEY_ID",
}


@dataclass(frozen=True)
class Finding:
    """One credential-looking value at a cell and line; ``masked`` is the line with the value cut short."""

    cell: int
    line: int
    kind: str
    masked: str


def _looks_random(value: str) -> bool:
    """Keeps ``model_name = "meta-llama/Llama-3.2-1B"``-like values out of the generic rule: letters and digits."""
    return bool(re.search(r"[0-9]", value) and re.search(r"[A-Za-z]", value)) and "/" not in value and "<" not in value


def _scan(text: str) -> tuple[str, str] | None:
    """The first credential in one line of text: ``(kind, the line with the value cut short)``."""
    for kind, pattern in PATTERNS:
        match = pattern.search(text)
        if not match:
            continue
        secret = next((g for g in match.groups() if g), match.group(0))
        if kind == "credential" and not _looks_random(secret):
            continue
        return kind, text.replace(secret, secret[:6] + "…").strip()
    return None


def find_secrets(cells: list[Cell]) -> list[Finding]:
    """Every line of every cell that holds something credential-shaped, written whole or computed from
    constants (in pieces, through names bound in earlier cells), in cell and line order."""
    found = []
    folder = StringFolder()  # one for the notebook: a name bound in a cell is known in the cells after it
    for cell in cells:
        lines = dict(enumerate(cell.source.splitlines(), start=1))
        for n, text in _built_strings(cell, folder):
            if not _scan(lines.get(n, "")):
                lines[n] = text
        for n, text in sorted(lines.items()):
            hit = _scan(text)
            if hit:
                found.append(Finding(cell.index, n, *hit))
    return found


def _built_strings(cell: Cell, folder: StringFolder) -> Iterator[tuple[int, str]]:
    """``(cell line, that line with the built value in place of the code building it)`` for each string the
    cell computes from constants: ``"a" + "b"``, adjacent literals over several lines, ``"".join([...])``,
    ``%``, ``.format``, f-strings, names bound to constant strings (``folding.py``)."""
    from ..convert.clean import clean_cell  # only a cell that is exported is cleaned

    try:
        clean = clean_cell(cell)  # IPython syntax (magics, ``!cmd``) made Python: the ast reads every cell
        tree = clean.tree or ast.parse(clean.code)
        built = list(folder.built(tree))
    except (NbddpError, SyntaxError, RecursionError):  # code nested too deep for ast: the converter says so
        return
    code = clean.code.splitlines()
    for node, value in built:
        line = clean.line_map[node.lineno - 1] if node.lineno <= len(clean.line_map) else None
        if line is not None:
            name = f"{node.target.id} = " if isinstance(node, ast.AugAssign) else ""  # ``tok += …`` read whole
            yield line, f'{code[node.lineno - 1][:node.col_offset]}{name}"{value}"'


def find_leftovers(path: str | os.PathLike) -> list[str]:
    """Warnings for credentials the notebook file holds where the export does not look (so does not
    publish): markdown and raw cells, cells tagged ``nbddp-skip``, outputs, cell and notebook metadata."""
    nb = nbformat.read(str(path), as_version=4)
    places: list[tuple[str, list[str], bool]] = []  # (where, its texts, whether its lines are cell lines)
    for i, cell in enumerate(nb.cells, start=1):
        if cell.cell_type != "code":
            places.append((f"cell {i} ({cell.cell_type})", [cell.source], True))
        elif SKIP_TAG in cell.metadata.get("tags", []):
            places.append((f"cell {i} (tagged {SKIP_TAG})", [cell.source], True))
        places.append((f"cell {i} (its output)", list(_strings(cell.get("outputs", []))), False))
        places.append((f"cell {i} (its metadata)", list(_strings(cell.metadata)), False))
    places.append(("the notebook's metadata", list(_strings(nb.metadata)), False))
    warnings = []
    for where, texts, numbered in places:
        hit = _first_in(texts)
        if hit:
            line, kind, masked = hit
            at = f"{where}, line {line}" if numbered else where
            warnings.append(f"{at}: {_article(kind)} {kind} is in the notebook file ({masked}); it is not exported, "
                            "but anyone given the notebook can read it: remove it there too")
    return warnings


def _first_in(texts: list[str]) -> tuple[int, str, str] | None:
    """``(line, kind, masked line)`` of the first credential in any of ``texts``."""
    for text in texts:
        for n, line in enumerate(text.splitlines(), start=1):
            hit = _scan(line)
            if hit:
                return n, *hit
    return None


def _strings(value) -> Iterator[str]:
    """Every string inside nested dicts and lists (an output's text, a metadata value)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


def _article(kind: str) -> str:
    return "an" if kind[0] in "AEIOU" else "a"


def check_secrets(cells: list[Cell]) -> None:
    """Raise ``SecretError`` at the first credential found, naming every other place too."""
    found = find_secrets(cells)
    if not found:
        return
    first = found[0]
    name = _SECRET_NAMES.get(first.kind, "MY_SECRET")
    others = "".join(f"\n  also cell {f.cell}, line {f.line}: {f.kind}" for f in found[1:])
    article = _article(first.kind)
    message = (
        f"{article} {first.kind} is written in the notebook; the export would publish it with the kernel's code:\n"
        f"    {first.masked}{others}\n"
        f"Store it as a Kaggle secret (notebook editor → Add-ons → Secrets, name {name}) and read it at run time:\n"
        f"    from kaggle_secrets import UserSecretsClient\n"
        f"    os.environ[\"{name}\"] = UserSecretsClient().get_secret(\"{name}\")\n"
        f"or export anyway with --allow-secrets."
    )
    raise SecretError(message, cell=first.cell, line=first.line)
