"""The folders a job writes into, seen from the launcher: read from the script before launch, checked to be
writable, claimed against another live job on this machine, and named when a rank finds the disk full.

``output_folders`` reads the converted script's ast (the code that runs) for targets whose value the code
itself says: a Trainer or TRL config's ``output_dir``, ``save_pretrained``/``save_model``/``torch.save``/
``save_file`` paths, given as literals, f-strings of literals, ``os.path.join``/``Path(…) / …`` of them, or a
top-level name bound once to such a value. Anything computed at run time is left alone: this is a check
before training, not a guarantee.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import hashlib
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import psutil

from .convert.script import Script
from .errors import LaunchError
from .preflight import unwritable_folder
from .launch.postmortem import RankFailure
from .runtime.io import atomic_write_text
from .runtime.records import Event, append_notice

#: Calls whose ``output_dir`` keyword names a folder the Trainer writes checkpoints into.
_CONFIG_CALL = re.compile(r"^(?:\w*TrainingArguments|\w*Config)$")
#: Methods whose first argument (or ``save_directory``/``output_dir``) is a folder written whole.
_FOLDER_SAVES = {"save_pretrained": "save_directory", "save_model": "output_dir"}
#: Functions whose second argument (or ``f``/``filename``) is a file: its folder is written.
_FILE_SAVES = {"save": "f", "save_file": "filename"}


@dataclass(frozen=True)
class OutputFolder:
    """A folder the notebook's code writes into, where the code says so (cell and line)."""

    path: Path
    cell: int
    line: int
    what: str  # "output_dir", "save_pretrained(...)", "torch.save(...)"


def output_folders(script: Script, cwd: str | os.PathLike) -> list[OutputFolder]:
    """Every output folder the script names with a value readable from the code, resolved against ``cwd``
    (where the ranks start); one entry per folder, at its first mention in the notebook."""
    try:
        tree = ast.parse(script.text)
    except SyntaxError:
        return []
    names = _constant_names(tree)
    found: dict[Path, OutputFolder] = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        target = _target(node, names)
        where = script.source_map.lookup(target[2].lineno) if target else None
        if target is None or where is None:
            continue
        path = Path(os.path.normpath(Path(cwd) / target[0]))
        folder = OutputFolder(path, where[0], where[1], target[1])
        if path not in found or (where < (found[path].cell, found[path].line)):
            found[path] = folder
    return sorted(found.values(), key=lambda f: (f.cell, f.line))


def _target(call: ast.Call, names: dict[str, str]) -> tuple[str, str, ast.expr] | None:
    """``(folder, what, the expression naming it)`` for a call that writes into a folder the code names."""
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    if _CONFIG_CALL.match(name):
        node = _keyword(call, "output_dir")
        what = f"{name}(output_dir=…)"
    elif isinstance(func, ast.Attribute) and name in _FOLDER_SAVES:
        node, what = _argument(call, 0, _FOLDER_SAVES[name]), f"{name}(…)"
    elif isinstance(func, ast.Attribute) and name in _FILE_SAVES and _module_name(func.value) in ("torch", "safetensors.torch"):
        node, what = _argument(call, 1, _FILE_SAVES[name]), f"{_module_name(func.value)}.{name}(…)"
    else:
        return None
    value = _fold(node, names) if node is not None else None
    if value is None:
        return None
    return (os.path.dirname(value) or "." if name in _FILE_SAVES else value), what, node


def _module_name(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_module_name(node.value)}.{node.attr}"
    return ""


def _keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _argument(call: ast.Call, position: int, keyword: str) -> ast.expr | None:
    if len(call.args) > position and not any(isinstance(a, ast.Starred) for a in call.args[: position + 1]):
        return call.args[position]
    return _keyword(call, keyword)


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
        func = _module_name(node.func)
        parts = [_fold(a, names) for a in node.args]
        if func in ("os.path.join", "Path", "pathlib.Path", "str") and parts and all(p is not None for p in parts):
            return os.path.join(*parts)
    return None


def check_writable(folders: list[OutputFolder]) -> None:
    """Refuse (``LaunchError``) the first folder that cannot be written or made, at its cell and line."""
    for folder in folders:
        reason = unwritable_folder(folder.path)
        if reason:
            raise LaunchError(
                f"cell {folder.cell}, line {folder.line}: {folder.what} writes to {folder.path}, which {reason}; "
                "the job would train and then fail to save: choose a folder you can write to"
            )


def _claims_dir() -> Path:
    """Where this machine's jobs say which folders they write: private to the user."""
    path = Path(tempfile.gettempdir()) / f"nbddp-claims-{os.getuid() if hasattr(os, 'getuid') else 'user'}"
    path.mkdir(mode=0o700, exist_ok=True)
    return path


@contextlib.contextmanager
def claimed(folders: list[OutputFolder], run_dir: Path) -> Iterator[list[str]]:
    """Claim ``folders`` for this process while the block runs; yields a warning for each folder another
    live job on this machine writes into too (its pid and run directory), and tells that job the same through
    its run directory's notices (``records.append_notice``, which its launcher streams): both are warned.
    Claims of dead jobs are taken over."""
    me = psutil.Process()
    mine = {"pid": me.pid, "started": me.create_time(), "run_dir": str(run_dir)}
    warnings, taken = [], []
    try:
        claims = _claims_dir() if folders else None
    except OSError:  # no temporary folder to claim in: the job runs unclaimed
        folders = []
    for folder in folders:
        claim = claims / (hashlib.sha256(str(folder.path).encode()).hexdigest()[:24] + ".json")
        other = _live_claim(claim)
        if other and other["pid"] != me.pid:
            clash = "their checkpoints and saves will overwrite each other"
            warnings.append(f"another job (pid {other['pid']}, run directory {other['run_dir']}) is writing to "
                            f"{folder.path} too (cell {folder.cell}, line {folder.line}): {clash}")
            with contextlib.suppress(OSError, TypeError):  # its run directory gone: nobody left to tell
                append_notice(other["run_dir"], f"nbddp: warning: another job (pid {me.pid}, run directory {run_dir}) "
                                                f"started writing to {folder.path} too: {clash}")
            continue
        with contextlib.suppress(OSError):
            atomic_write_text(claim, json.dumps({**mine, "folder": str(folder.path)}))
            taken.append(claim)
    try:
        yield warnings
    finally:
        for claim in taken:
            with contextlib.suppress(OSError):
                if json.loads(claim.read_text()).get("pid") == me.pid:
                    claim.unlink()


def _live_claim(claim: Path) -> dict | None:
    """The claim's content when the process that wrote it still runs (the same process, not a reused pid)."""
    try:
        data = json.loads(claim.read_text())
        proc = psutil.Process(int(data["pid"]))
        if abs(proc.create_time() - float(data["started"])) < 1.0 and proc.is_running():
            return data
    except (OSError, ValueError, KeyError, TypeError, psutil.Error):
        pass
    return None


#: The weights file an adapter folder holds once PEFT saved it (safetensors by default, else a pickle).
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")


def saved_whole(folder: Path, names: list[str]) -> bool:
    """Whether the adapter in ``folder`` (whose file ``names`` are given) was saved whole: its weights are there,
    no save into it was cut short (the hidden temporary file ``runtime.io`` leaves), and a Trainer checkpoint
    (``checkpoint-N``) is complete as ``--resume`` counts it (``runtime.resume.is_complete``). A full disk in
    the middle of ``checkpoint-30`` leaves its config and some files: that is not a saved adapter."""
    from .runtime import resume

    if not any(name in names for name in ADAPTER_WEIGHTS) or any(resume.cut_short(name) for name in names):
        return False
    return not resume.is_checkpoint(folder.name) or resume.is_complete(str(folder))


#: What a rank's failure says when the disk filled under it: errno 28, or torch's zip writer's own words.
_NO_SPACE = re.compile(r"No space left on device|\[Errno 28\]|inline_container\.cc.*unexpected pos|file write failed")
_WRITING = re.compile(r"^nbddp: while writing (.+)$", re.MULTILINE)
_ERRNO_PATH = re.compile(r"No space left on device: '([^']+)'")


def explain_no_space(failure: RankFailure | None, cwd: Path, records: list[dict] = ()) -> RankFailure | None:
    """A failure caused by a full disk, said so: ``No space left on device: writing to FOLDER (N free)``,
    then the rank's own message. The folder is the save's (noted by ``runtime.saves``), the path in the
    error, else the Trainer's ``output_dir``, else where the ranks ran. Any other failure is returned as is."""
    if failure is None or not _NO_SPACE.search(f"{failure.message}\n{failure.traceback}"):
        return failure
    written = _WRITING.search(failure.traceback) or _ERRNO_PATH.search(failure.message)
    begin = next((r for r in records if r.get("event") == Event.BEGIN and r.get("output_dir")), None)
    if written:
        folder = (cwd / written.group(1)).parent
    else:
        folder = cwd / begin["output_dir"] if begin else cwd
    message = f"No space left on device: writing to {folder} ({_free(folder)} free); {failure.message}"
    return dataclasses.replace(failure, message=message)


def _free(folder: Path) -> str:
    """The free space of the disk holding ``folder`` (or its nearest existing parent), for a person."""
    while not folder.exists() and folder.parent != folder:
        folder = folder.parent
    try:
        free = float(shutil.disk_usage(folder).free)
    except OSError:
        return "unknown space"
    for unit in ("bytes", "kB", "MB", "GB"):
        if free < 1000:
            return f"{free:.0f} {unit}" if unit == "bytes" else f"{free:.1f} {unit}"
        free /= 1000
    return f"{free:.1f} TB"
