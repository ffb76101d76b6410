"""What a person reads when a job ends: a summary, or the failure mapped to the notebook."""

from __future__ import annotations

from .launch import RankFailure, RunResult


def summary(result: RunResult) -> str:
    """One paragraph: outcome, steps, time, loss first → last, where the files are."""
    steps = max((int(h.get("step", 0)) for h in result.log_history), default=0)
    losses = result.losses
    parts = [f"{'finished' if result.ok else 'failed'} in {result.duration_s:.1f} s"]
    if steps:
        parts.append(f"{steps} steps")
    if losses:
        parts.append(f"loss {losses[0]:.3f} → {losses[-1]:.3f}")
    lines = ["nbddp: " + " · ".join(parts), f"nbddp: run directory {result.run_dir} (script.py, logs/)"]
    return "\n".join(lines)


def failure_report(failure: RankFailure) -> str:
    """The failing rank, the notebook cell and line, and its traceback with script lines mapped."""
    return f"nbddp: {failure}\n\n{failure.traceback.rstrip()}\n"
