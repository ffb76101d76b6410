"""A failed launched command, said by nbddp first and cleanly (``nbddp.launched``): read from the failed rank's
``stderr.log`` (``read_rank_error``: the exception line, the traceback less runpy's, torchrun's and nbddp's frames),
at the ``%%writefile`` cell and line that wrote its script, else at the shell line that launched it
(``launch_line``); recorded for the job's result (``record_failure``, ``failure_of``, ``with_launched_failure``).
"""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

#: The commands a shell line may launch a script with (``launched.TOOLS``).
_TOOLS = frozenset(("torchrun", "accelerate", "deepspeed", "python", "python3"))


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


#: torch's ``[rank1]: `` before each line a rank logs, and torchrun's ``[default0]:`` before each teed line.
_RANK_PREFIX = re.compile(r"^(?:\[default\d+\]:)?(?:\[(?:default)?rank\d+\]: ?)?")
_TRACEBACK = "Traceback (most recent call last):"
_FRAME = re.compile(r'^  File "(?P<file>[^"]+)", line (?P<line>\d+)(?P<rest>.*)$')
#: argparse's last words before it exits with status 2 (``train.py: error: unrecognized arguments: --x``).
_PARSE_ERROR = re.compile(r"^\S+: error: .+")
_PACKAGE = Path(__file__).resolve().parent
#: a line torch or glog logs (``[W1128 04:44:50…]``, ``W1128 04:44:50…``): not the exception's message
_LOGGED = re.compile(r"^\[?[WEIF]\d{4} ")


@dataclass(frozen=True)
class RankError:
    """What a failed rank's ``stderr.log`` says: the exception line (or argparse's error line), its traceback
    less torchrun's and nbddp's frames, and its innermost frame in the user's code (file, line)."""

    message: str
    traceback: str = ""
    frame: tuple[str, int] | None = None
    parse_error: bool = False


def read_rank_error(text: str) -> RankError | None:
    """The error a rank's stderr ends with: the last traceback's exception line (not the last line of a
    multi-line message, nor a warning printed after it), or argparse's ``error:`` line; None when neither."""
    lines = [_RANK_PREFIX.sub("", ln) for ln in text.splitlines()]
    starts = [i for i, ln in enumerate(lines) if ln.rstrip() == _TRACEBACK and not _quoted(lines, i)]
    if not starts:
        parse = next((ln.strip() for ln in reversed(lines) if _PARSE_ERROR.match(ln)), None)
        return RankError(parse, parse_error=True) if parse else None
    last = starts[-1]
    end = next((i for i in range(last + 1, len(lines)) if lines[i] and not lines[i][0].isspace()), len(lines) - 1)
    message = lines[end].strip()
    kept, frame, skipping = [], None, False
    for ln in lines[_chain_start(lines, starts):end + 1]:
        m = _FRAME.match(ln)
        if m:
            skipping = _is_internal(m.group("file"))
            if not skipping:
                kept.append(ln)
                frame = (m.group("file"), int(m.group("line")))
            continue
        if skipping and ln.startswith("    "):
            continue  # the hidden frame's code line and its ^^^ markers
        skipping = False
        kept.append(ln)
    for ln in lines[end + 1:]:  # the rest of a multi-line message, up to what torch or glog logs after it
        if _LOGGED.match(ln):
            break
        kept.append(ln)
    return RankError(message, "\n".join(kept).rstrip(), frame)


def _quoted(lines: list[str], i: int) -> bool:
    """Whether the traceback at ``i`` is text inside another exception's message (a ``RemoteTraceback``'s)."""
    return i > 0 and lines[i - 1].strip() in ('"""', "'''")


def _chain_start(lines: list[str], starts: list[int]) -> int:
    """Where the chain of tracebacks ending the log begins: each one after the first follows Python's words
    linking it to the one before."""
    first = starts[-1]
    for i in reversed(starts[:-1]):
        between = "\n".join(lines[i:first])
        if "During handling of the above exception" not in between and "direct cause of the following" not in between:
            break
        first = i
    return first


def _is_internal(file: str) -> bool:
    """A frame of Python's runpy, torchrun's or nbddp's (its agent starting the rank): not the user's code."""
    if file.startswith("<frozen "):
        return True
    return _PACKAGE in Path(file).parents or "torch/distributed/elastic" in file or file.endswith("torch/distributed/run.py")


def _say_failure(argv: list[str], code: int) -> None:
    """The first failed rank's exception, at the ``%%writefile`` cell and line where its script came from, or
    at the shell line that launched it: read from its ``stderr.log`` (a plain script writes no ``error.json``)."""
    log_dir = next((a.partition("=")[2] for a in argv if a.startswith("--log-dir=")), None)
    written = json.loads(os.environ.get("NBDDP_WRITTEN") or "{}")
    folder = Path(os.environ.get("NBDDP_LAUNCHED_DIR", "nbddp_launched"))
    logs = sorted(Path(log_dir).glob("*/attempt_*/*/stderr.log"), key=lambda p: p.stat().st_mtime) if log_dir else []
    launch = launch_line(folder.parent / "script.py", argv)
    for log in logs:
        error = read_rank_error(log.read_text(errors="replace"))
        if error is not None:
            _say_rank_error(folder, int(log.parent.name), error, code, written, launch, log)
            return
    where = f" in cell {launch[0]}, line {launch[1]}" if launch else ""
    _say(f"nbddp: the launched command{where} exited with code {code}")
    record_failure(folder, rank=0, message=f"the launched command exited with code {code}", traceback="",
                   exitcode=code, **(dict(cell=launch[0], line=launch[1], source=launch[2]) if launch else {}))


def _say_rank_error(folder: Path, rank: int, error: RankError, code: int, written: dict,
                    launch: tuple[int, int, str] | None, log: Path) -> None:
    """Say and record a failed rank: at its ``%%writefile`` cell and line, else at its launch line (and always
    there for an argument-parse error: the fix is on the command line)."""
    fields = dict(rank=rank, message=error.message, traceback=_map_written(error.traceback, written), exitcode=code)
    name = Path(error.frame[0]).name if error.frame else None
    there = f" ({name}, line {error.frame[1]})" if error.frame else ""
    if name in written and not error.parse_error:
        cell, first = written[name]
        line = first + error.frame[1] - 1
        _say(f"nbddp: launched rank {rank} failed in cell {cell}, line {line}{there}: {error.message}")
        record_failure(folder, **fields, cell=cell, line=line, source=_line_of(*error.frame))
    elif launch is not None:
        cell, line, source = launch
        _say(f"nbddp: launched rank {rank} failed; launched from cell {cell}, line {line}{there}: {error.message}")
        record_failure(folder, **fields, cell=cell, line=line, source=source)
    else:
        _say(f"nbddp: launched rank {rank} failed{there}: {error.message} (its log: {log})")
        record_failure(folder, **fields)


def _map_written(traceback: str, written: dict) -> str:
    """The traceback's frames in a script a ``%%writefile`` cell wrote, said with that cell and line too."""
    def cell_of(m: re.Match) -> str:
        name = Path(m.group("file")).name
        if name not in written:
            return m.group(0)
        cell, first = written[name]
        return (f'  File "{m.group("file")}", line {m.group("line")} (cell {cell}, line '
                f'{first + int(m.group("line")) - 1}){m.group("rest")}')

    return "\n".join(_FRAME.sub(cell_of, ln) for ln in traceback.splitlines())


def launch_line(script: Path, argv: list[str]) -> tuple[int, int, str] | None:
    """The notebook's shell line that ran this launch (cell, line, its text): the one ``_nbddp.shell`` call of
    the job's script whose command names the launched script; None where none or several do."""
    from .runtime.sourcemap import read_source_map

    target = next((Path(a).name.removeprefix("converted-") for a in argv if a.endswith(".py")), None)
    try:
        tree = ast.parse(script.read_text())
    except (OSError, SyntaxError, ValueError):
        return None
    smap = read_source_map(script)
    found = set()
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "shell"
                and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            command = node.args[0].value
            words = {Path(w).name for w in command.replace(";", " ").split()}
            where = smap.lookup(node.lineno) if smap else None
            if where and (target in words if target else bool(words & _TOOLS)):
                found.add((*where, f"!{command}"))
    return found.pop() if len(found) == 1 else None


def _line_of(file: str, line: str) -> str:
    try:
        return Path(file).read_text(errors="replace").splitlines()[int(line) - 1]
    except (OSError, IndexError):
        return ""


#: The failures of the notebook's training launches, one JSON line each, under ``NBDDP_LAUNCHED_DIR``.
FAILURES = "failures.jsonl"


def record_failure(folder: Path, **fields) -> None:
    """Keep a failed launch for the job's result: the notebook goes on, as in the kernel, but the job failed."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / FAILURES, "a") as fh:
        fh.write(json.dumps(fields) + "\n")


def failure_of(folder: Path):
    """The first failed training launch recorded under ``folder``, as a ``RankFailure``; None when none failed."""
    from .launch.postmortem import RankFailure

    try:
        first = (folder / FAILURES).read_text().splitlines()[0]
    except (OSError, IndexError):
        return None
    return RankFailure(**json.loads(first), launched=True)


def with_launched_failure(result, folder: Path):
    """``result`` (the job's ``RunResult``) failed where a training launch under ``folder`` failed: that launch
    is the root cause, also where a later cell then failed too (its model never written, say), unless the job
    was stopped (a timeout, an interrupt: no rank failure of its own)."""
    if not result.ok and result.failure is None:
        return result
    failure = failure_of(folder)
    if failure is None:
        return result
    return dataclasses.replace(result, returncode=result.returncode or 1, failure=failure)
