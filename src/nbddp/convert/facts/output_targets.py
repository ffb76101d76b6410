"""The folders a converted script writes into, read once by the converter (``Script.output_targets``) for the
launcher (``outputs.output_folders``, which resolves them where the ranks start).

Targets whose value the code itself says: a Trainer or TRL config's ``output_dir``, ``save_pretrained``/
``save_model``/``torch.save``/``save_file`` paths, given as literals, f-strings of literals, ``os.path.join``/
``Path(…) / …`` of them, or a top-level name bound once to such a value. Anything computed at run time is left
alone: this is a check before training, not a guarantee.
"""

from __future__ import annotations

import ast
import os
import re
from dataclasses import dataclass

from ...runtime.sourcemap import SourceMap
from ..ast_helpers import dotted_name, keyword

#: Calls whose ``output_dir`` keyword names a folder the Trainer writes checkpoints into.
_CONFIG_CALL = re.compile(r"^(?:\w*TrainingArguments|\w*Config)$")
#: Methods whose first argument (or ``save_directory``/``output_dir``) is a folder written whole.
_FOLDER_SAVES = {"save_pretrained": "save_directory", "save_model": "output_dir"}
#: Functions whose second argument (or ``f``/``filename``) is a file: its folder is written.
_FILE_SAVES = {"save": "f", "save_file": "filename"}


@dataclass(frozen=True)
class OutputTarget:
    """A folder the code names (as written, not yet resolved), where the notebook says so (cell and line)."""

    folder: str
    cell: int
    line: int
    what: str  # "output_dir", "save_pretrained(...)", "torch.save(...)"


def output_targets(tree: ast.Module, source_map: SourceMap) -> tuple[OutputTarget, ...]:
    """Every folder ``tree`` (the script's ast) names with a value readable from the code, in the order an
    ``ast.walk`` meets its calls, each at the notebook's cell and line (a call the map does not place is left out)."""
    names = _constant_names(tree)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        target = _target(node, names)
        where = source_map.lookup(target[2].lineno) if target else None
        if target is not None and where is not None:
            found.append(OutputTarget(target[0], where[0], where[1], target[1]))
    return tuple(found)


def _target(call: ast.Call, names: dict[str, str]) -> tuple[str, str, ast.expr] | None:
    """``(folder, what, the expression naming it)`` for a call that writes into a folder the code names."""
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    if _CONFIG_CALL.match(name):
        node = _keyword_value(call, "output_dir")
        what = f"{name}(output_dir=…)"
    elif isinstance(func, ast.Attribute) and name in _FOLDER_SAVES:
        node, what = _argument(call, 0, _FOLDER_SAVES[name]), f"{name}(…)"
    elif isinstance(func, ast.Attribute) and name in _FILE_SAVES and _dotted(func.value) in ("torch", "safetensors.torch"):
        node, what = _argument(call, 1, _FILE_SAVES[name]), f"{_dotted(func.value)}.{name}(…)"
    else:
        return None
    value = _fold(node, names) if node is not None else None
    if value is None:
        return None
    return (os.path.dirname(value) or "." if name in _FILE_SAVES else value), what, node


def _argument(call: ast.Call, position: int, keyword: str) -> ast.expr | None:
    if len(call.args) > position and not any(isinstance(a, ast.Starred) for a in call.args[: position + 1]):
        return call.args[position]
    return _keyword_value(call, keyword)


def _constant_names(tree: ast.Module) -> dict[str, str]:
    """Top-level names bound exactly once in the whole script, to a value ``_fold`` reads."""
    bound: dict[str, int] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            bound[node.id] = bound.get(node.id, 0) + 1
    names: dict[str, str] = {}
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
            name = stmt.targets[0].id
            value = _fold(stmt.value, names)
            if bound.get(name) == 1 and value is not None:
                names[name] = value
    return names


def _fold(node: ast.expr, names: dict[str, str]) -> str | None:
    """The path string ``node`` always evaluates to, when the code says it plainly; else None."""
    if isinstance(node, ast.Constant):
        return node.value if isinstance(node.value, str) and node.value else None
    if isinstance(node, ast.Name):
        return names.get(node.id)
    if isinstance(node, ast.JoinedStr):
        parts = [_fold(v.value if isinstance(v, ast.FormattedValue) and not v.format_spec else v, names)
                 for v in node.values]
        return "".join(parts) if all(p is not None for p in parts) else None
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Div)):
        left, right = _fold(node.left, names), _fold(node.right, names)
        if left is None or right is None:
            return None
        return left + right if isinstance(node.op, ast.Add) else os.path.join(left, right)
    if isinstance(node, ast.Call) and not node.keywords:
        func = _dotted(node.func)
        parts = [_fold(a, names) for a in node.args]
        if func in ("os.path.join", "Path", "pathlib.Path", "str") and parts and all(p is not None for p in parts):
            return os.path.join(*parts)
    return None


def _dotted(node: ast.expr) -> str:
    return dotted_name(node) or ""


def _keyword_value(call: ast.Call, name: str) -> ast.expr | None:
    found = keyword(call, name)
    return found.value if found is not None else None
