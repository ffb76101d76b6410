"""Start torchrun on a script, stream rank 0 live, keep every rank's log, and report failures by cell and line.

Three rooms: ``planning`` (the run directory, torchrun's command line and environment, ports, installs),
``supervise`` (the processes and their streams: ``launch`` runs a plan to its end and leaves no process
behind; ``warm_start`` forks its agent from a warm process of the launcher's where it can) and ``postmortem`` (what a job left: ``RunResult``, the root failure and each rank's stack, mapped
to notebook cells). The records they read are written in the ranks and by torchrun's agent; their formats
live in ``runtime.records``, the source map in ``runtime.sourcemap``: the launcher needs nothing from the
converter.
"""

from .planning import (
    LaunchPlan,
    Sink,
    default_nproc,
    find_rank_log,
    new_run_dir,
    plan,
    run_installs,
    stdout_sink,
)
from .postmortem import RankFailure, RankStack, RunResult, map_traceback, read_failure, read_stacks, where_ranks_were
from .supervise import (
    STOP_SIGNALS,
    JobStopped,
    ask_for_stacks,
    launch,
    raise_job_stopped,
    terminate_tree,
)

#: The name ``job.run_script`` knows the default sink by.

__all__ = [
    "STOP_SIGNALS",
    "JobStopped",
    "LaunchPlan",
    "RankFailure",
    "RankStack",
    "RunResult",
    "Sink",
    "ask_for_stacks",
    "default_nproc",
    "find_rank_log",
    "launch",
    "map_traceback",
    "new_run_dir",
    "plan",
    "raise_job_stopped",
    "read_failure",
    "read_stacks",
    "run_installs",
    "stdout_sink",
    "terminate_tree",
    "where_ranks_were",
]
