"""After a job: what it left (``RunResult``), its root failure and where each rank was, mapped to notebook cells.

Read from the records the ranks and torchrun's agent wrote (formats in ``runtime.records``), never from
torchrun's printed text; script lines become cells and lines through the script's source map
(``runtime.sourcemap``).
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass
from pathlib import Path

from ..runtime import records
from ..runtime.sourcemap import SourceMap, read_source_map
from .planning import find_rank_log, newest_attempt


@dataclass(frozen=True)
class RankFailure:
    """The rank whose failure ended the job: where, why, and its traceback with script lines mapped to cells.

    ``signal`` is set when the rank was killed by a signal (it then has no Python traceback; its cell and
    line, when known, come from the stack ``faulthandler`` dumped, e.g. on a segfault).
    """

    rank: int
    message: str
    traceback: str
    cell: int | None = None
    line: int | None = None
    source: str = ""
    exitcode: int | None = None
    signal: int | None = None
    launched: bool = False  # a rank of the command the notebook launched (``nbddp.launched``), not of the job

    @property
    def who(self) -> str:
        return f"launched rank {self.rank}" if self.launched else f"rank {self.rank}"

    def __str__(self) -> str:
        where = f" in cell {self.cell}, line {self.line}" if self.cell else ""
        src = f"\n    {self.source.strip()}" if self.source.strip() else ""
        what = f"was killed (signal {self.signal})" if self.signal else "failed"
        return f"{self.who} {what}{where}: {self.message}{src}"


@dataclass(frozen=True)
class RankStack:
    """Where a rank was when it was stopped or crashed: its innermost notebook line and its stack dump."""

    rank: int
    cell: int | None
    line: int | None
    source: str
    stack: str

    def __str__(self) -> str:
        if self.cell is None:
            return f"rank {self.rank} was outside the notebook's code (see its stack in the run directory)"
        src = f": {self.source.strip()}" if self.source.strip() else ""
        return f"rank {self.rank} was at cell {self.cell}, line {self.line}{src}"


@dataclass(frozen=True)
class RunResult:
    """What a finished job left: exit code, where its files are, rank 0's training log."""

    returncode: int
    run_dir: Path
    script: Path
    duration_s: float
    log_history: tuple[dict, ...] = ()
    failure: RankFailure | None = None
    interrupted: bool = False
    timed_out: bool = False
    stacks: tuple[RankStack, ...] = ()  # where each stopped rank was, when the job did not finish by itself
    stopped_by: int | None = None  # SIGTERM or SIGHUP that stopped the launcher (then ``interrupted`` too)
    process: object | None = None  # torchrun's ``Popen``, left running for a kept job (``launch(until=…)``)

    @property
    def ok(self) -> bool:
        """Finished by itself with exit code 0 (a job that was stopped may still have exited 0)."""
        return self.returncode == 0 and not self.interrupted and not self.timed_out

    @property
    def losses(self) -> list[float]:
        return [float(h["loss"]) for h in self.log_history if h.get("event") == records.Event.LOG and "loss" in h]

    @property
    def last_step(self) -> tuple[int, int] | None:
        """The last Trainer step rank 0 reported, with the planned total: ``(step, max_steps)``."""
        steps = [h for h in self.log_history if "step" in h]
        return (int(steps[-1]["step"]), int(steps[-1].get("max_steps") or 0)) if steps else None

    def rank_log(self, rank: int, stream: str = "stdout") -> Path | None:
        return find_rank_log(self.run_dir / "logs", rank, stream)


#: Free bytes under which the disk of a run directory counts as full (a filesystem's last blocks go in bursts).
FULL_BELOW_BYTES = 1 << 20


def full_disk(run_dir: Path) -> str | None:
    """The line that says the disk of ``run_dir`` is full, or None. Said at the job's end: the ranks drop the
    logs and records the disk refuses (``runtime.records.append_line``, ``runtime.streams``) and go on, and
    a warning of theirs would be dropped too, so it is the launcher that says which folder is full."""
    import shutil

    try:
        free = shutil.disk_usage(run_dir).free
    except OSError:
        return None
    if free >= FULL_BELOW_BYTES:
        return None
    return (f"\nnbddp: warning: the disk of the run directory {run_dir} is full ({free // 1024} KiB free): what the "
            "ranks printed and nbddp's records of this job were dropped where the disk refused them (the steps and "
            "losses shown may stop short). Free space there, or have run directories made elsewhere (--runs-dir "
            "DIR, or NBDDP_RUNS)\n")


def where_ranks_were(result: RunResult) -> list[str]:
    """Lines saying where each stopped rank was in the notebook and the last Trainer step, for a failure or a
    timeout. Ranks stopped outside the notebook's code (starting up, shutting down) are left out."""
    lines = [str(st) for st in result.stacks if st.cell is not None]
    if result.last_step:
        step, total = result.last_step
        lines.append(f"last Trainer step: {step}" + (f" of {total}" if total else ""))
    return lines


#: A frame in a Python traceback: ``  File "…", line N, in func``.
_FRAME = re.compile(r'^(\s*)File "(?P<file>[^"]+)", line (?P<line>\d+)(?P<rest>.*)$')
#: A frame in a ``faulthandler`` dump: ``  File "…", line N in func`` (no comma before "in").
_DUMP_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>.*)$')

#: A death by signal is stamped by torch elastic in whole seconds when its agent notices it (every 0.1 s).
#: It is taken as this much earlier than its stamp, so that an exception another rank raised within that
#: second — most often its consequence, a collective whose peer vanished — does not pass for the cause.
_SIGNAL_LEAD_S = 0.2

#: What a signal most likely means, for the ones a training job meets.
_SIGNAL_HINTS = {
    signal.SIGKILL: "killed outright, most often by the system running out of memory (the OOM killer)",
    signal.SIGSEGV: "crashed (segmentation fault) in native code",
    signal.SIGABRT: "aborted by native code: a failed check in a C++ or CUDA library, or NCCL's watchdog "
                    "ending a collective that timed out (the rank's log says which)",
    signal.SIGTERM: "stopped from outside the job",
    signal.SIGBUS: "crashed (bus error), often shared memory (/dev/shm) running out",
}


def read_failure(log_dir: Path, script: Path, failures: Path | None = None) -> RankFailure | None:
    """The root-cause failure of the newest attempt, its traceback mapped to notebook cells.

    Candidates are every rank's ``error.json`` (an exception) and, from torch elastic's failure record
    (``failures``, written by ``nbddp.agent``), every rank that ended without one: killed by a signal, or
    exited non-zero without a Python traceback. The earliest is the root cause, but a rank ended by SIGTERM
    without an error file comes after all others: that is how torchrun stops the survivors.
    """
    smap = read_source_map(script)
    candidates: dict[int, dict] = {}
    for path in newest_attempt(log_dir, records.ERROR_FILE):
        error = records.read_error(path)
        if error:
            candidates[error.rank] = dict(time=error.time, message=error.message, callstack=error.callstack)
    for rec in records.read_failures(failures):
        if rec.rank in candidates:
            candidates[rec.rank]["exitcode"] = rec.exitcode
            continue
        exitcode = int(rec.exitcode)
        candidates[rec.rank] = dict(time=rec.timestamp - _SIGNAL_LEAD_S, exitcode=exitcode, callstack="",
                                    signal=-exitcode if exitcode < 0 else None, local_rank=rec.local_rank)
    if not candidates:
        return None
    # torchrun stops the other ranks with SIGTERM once one fails: such deaths come last
    rank = min(candidates, key=lambda r: (candidates[r].get("signal") == signal.SIGTERM, candidates[r]["time"], r))
    c = candidates[rank]
    if c.get("signal"):
        return _signal_failure(rank, c, log_dir, script, smap)
    if not c.get("message"):
        message = f"exited with code {c['exitcode']} without a Python traceback (sys.exit or os._exit?)"
        return RankFailure(rank=rank, message=message, traceback="", exitcode=c["exitcode"])
    mapped, cell, line = map_traceback(c["callstack"], script, smap)
    source = _cell_line_text(script, smap, cell, line)
    return RankFailure(rank=rank, message=c["message"].strip(), traceback=mapped, cell=cell, line=line,
                       source=source, exitcode=c.get("exitcode"))


def _signal_failure(rank: int, c: dict, log_dir: Path, script: Path, smap: SourceMap | None) -> RankFailure:
    """A rank killed by a signal: what the signal most likely means, and its stack when it could dump one."""
    number = c["signal"]
    try:
        name = signal.Signals(number).name
        hint = _SIGNAL_HINTS.get(signal.Signals(number), "")
    except ValueError:
        name, hint = f"signal {number}", ""
    message = name + (f": {hint}" if hint else "")
    stack = next((st for st in read_stacks(log_dir, script, smap) if st.rank == rank), None)
    if stack is None:
        return RankFailure(rank=rank, message=message, traceback="", exitcode=c["exitcode"], signal=number)
    return RankFailure(rank=rank, message=message, traceback=stack.stack, cell=stack.cell, line=stack.line,
                       source=stack.source, exitcode=c["exitcode"], signal=number)


def read_stacks(log_dir: Path, script: Path, smap: SourceMap | None) -> tuple[RankStack, ...]:
    """Each rank's ``faulthandler`` dump of the newest attempt, its innermost notebook frame located.

    Only the first dump of a file counts (the one the launcher asked for before stopping the job, or the one
    written when the rank was stopped or crashed). Of its threads, the one running the script's
    module-level code is the rank's main thread.
    """
    stacks = []
    for _, header, dump in records.read_stacks_files(newest_attempt(log_dir, records.STACKS_FILE)):
        if not dump.strip() or header is None:
            continue
        threads = re.split(r"\n(?=(?:Current thread|Thread) 0x)", dump.strip())
        main = next((t for t in threads if _script_frames(t, script) and "in <module>" in t), threads[0])
        mapped, cell, line = _map_dump(main, script, smap)
        stacks.append(RankStack(rank=header.rank, cell=cell, line=line,
                                source=_cell_line_text(script, smap, cell, line), stack=mapped))
    return tuple(sorted(stacks, key=lambda st: st.rank))


def _script_frames(dump: str, script: Path) -> list[re.Match]:
    found = (_DUMP_FRAME.match(text) for text in dump.splitlines())
    return [m for m in found if m and Path(m.group("file")).resolve() == script.resolve()]


def _map_dump(dump: str, script: Path, smap: SourceMap | None) -> tuple[str, int | None, int | None]:
    """Like ``map_traceback`` for a ``faulthandler`` dump, where the innermost frame comes first."""
    cell = line = None
    out = []
    for text in dump.splitlines():
        m = _DUMP_FRAME.match(text)
        hit = smap.lookup(int(m.group("line"))) if m and smap and Path(m.group("file")).resolve() == script.resolve() else None
        if hit:
            if cell is None:
                cell, line = hit
            text = f'  File "{smap.origin}", cell {hit[0]}, line {hit[1]} in {m.group("func")}'
        out.append(text)
    return "\n".join(out), cell, line


def map_traceback(traceback: str, script: Path, smap: SourceMap | None) -> tuple[str, int | None, int | None]:
    """Rewrite frames in the script as ``File "<notebook>", cell N, line L``; return the innermost such frame."""
    cell = line = None
    out = []
    for text in traceback.splitlines():
        m = _FRAME.match(text)
        if m and smap and Path(m.group("file")).resolve() == script.resolve():
            hit = smap.lookup(int(m.group("line")))
            if hit:
                cell, line = hit
                text = f'{m.group(1)}File "{smap.origin}", cell {cell}, line {line}{m.group("rest")}'
        out.append(text)
    return "\n".join(out), cell, line


def _cell_line_text(script: Path, smap: SourceMap | None, cell: int | None, line: int | None) -> str:
    if not smap or cell is None:
        return ""
    for n, (c, ln) in smap.lines.items():
        if (c, ln) == (cell, line):
            lines = script.read_text().splitlines()
            return lines[n - 1] if n <= len(lines) else ""
    return ""
