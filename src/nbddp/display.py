"""What a person reads when a job ends: a summary, or the failure mapped to the notebook."""

from __future__ import annotations

from typing import Iterable

from .launch import RankFailure, RunResult


def summary(result: RunResult) -> str:
    """One paragraph: outcome, steps, time, loss first → last, where the files are."""
    steps = max((int(h.get("step", 0)) for h in result.log_history), default=0)
    losses = result.losses
    outcome = ("finished" if result.ok else "interrupted" if result.interrupted
               else "timed out" if result.timed_out else "failed")
    parts = [f"{outcome} in {result.duration_s:.1f} s"]
    if steps:
        parts.append(f"{steps} steps")
    if losses:
        parts.append(f"loss {losses[0]:.3f} → {losses[-1]:.3f}")
    lines = ["nbddp: " + " · ".join(parts), f"nbddp: run directory {result.run_dir} (script.py, logs/)"]
    return "\n".join(lines)


def failure_report(failure: RankFailure, others: Iterable[str] = ()) -> str:
    """The failing rank, the notebook cell and line, its traceback with script lines mapped, then ``others``:
    lines on where the other ranks were when stopped (``launch.where_ranks_were``)."""
    tb = f"\n\n{failure.traceback.rstrip()}\n" if failure.traceback.strip() else "\n"
    rest = "".join(f"nbddp:   {line}\n" for line in others)
    return f"nbddp: {failure}{tb}" + (f"nbddp: when the job stopped:\n{rest}" if rest else "")
