"""The folders a job writes into, seen from the launcher: read from the script before launch, checked to be
writable, claimed against another live job on this machine, and named when a rank finds the disk full.

``output_folders`` reads the converted script's ast (the code that runs) for targets whose value the code
itself says: a Trainer or TRL config's ``output_dir``, ``save_pretrained``/``save_model``/``torch.save``/
``save_file`` paths, given as literals, f-strings of literals, ``os.path.join``/``Path(…) / …`` of them, or a
top-level name bound once to such a value. Anything computed at run time is left alone: this is a check
before training, not a guarantee.
"""

from __future__ import annotations

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

@dataclass(frozen=True)
class OutputFolder:
    """A folder the notebook's code writes into, where the code says so (cell and line)."""

    path: Path
    cell: int
    line: int
    what: str  # "output_dir", "save_pretrained(...)", "torch.save(...)"


def output_folders(script: Script, cwd: str | os.PathLike) -> list[OutputFolder]:
    """Every output folder the script names with a value readable from the code (the converter's
    ``Script.output_targets``), resolved against ``cwd`` (where the ranks start); one entry per folder, at its
    first mention in the notebook."""
    found: dict[Path, OutputFolder] = {}
    for target in script.output_targets:
        path = Path(os.path.normpath(Path(cwd) / target.folder))
        folder = OutputFolder(path, target.cell, target.line, target.what)
        if path not in found or ((target.cell, target.line) < (found[path].cell, found[path].line)):
            found[path] = folder
    return sorted(found.values(), key=lambda f: (f.cell, f.line))


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
