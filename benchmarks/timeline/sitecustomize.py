"""Benchmark-only: a timeline of every Python process of a job (launcher, torchrun's agent, ranks).

``benchmarks/job_overhead.py`` puts this folder first on ``PYTHONPATH`` with ``NBDDP_BENCH_TIMELINE`` naming a
JSON-lines file. Each process appends when it was created (from ``/proc``), when Python reached this module
and when it exits (with its CPU seconds so far) (this ``atexit`` handler runs last); the user code appends its own marks (``mark``). In a
rank, with ``NBDDP_BENCH_PROFILE`` naming a folder, nbddp's ``setup()`` and ``cleanup()`` run under
cProfile and their seconds are marked; in the launcher, ``launch`` is marked. Nothing of nbddp's product code knows about it.
"""

import atexit
import json
import os
import sys
import time

_PATH = os.environ.get("NBDDP_BENCH_TIMELINE")


def _created() -> float | None:
    """This process's start, in epoch seconds (Linux: /proc, 10 ms ticks)."""
    try:
        with open(f"/proc/{os.getpid()}/stat") as fh:
            ticks = int(fh.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as fh:
            boot = next(int(line.split()[1]) for line in fh if line.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, StopIteration):
        return None


def _role() -> str:
    argv = " ".join(sys.argv)
    if "RANK" in os.environ and "LOCAL_RANK" in os.environ and "GROUP_RANK" in os.environ:
        return f"rank{os.environ['RANK']}"
    if any(a.startswith("--nproc_per_node") for a in sys.argv):  # torchrun, or nbddp.agent (argv[0] is "-m")
        return "agent"
    if ".ipynb" in argv:
        return "launcher"
    return "other"


def mark(what: str, **extra) -> None:
    """Append one timestamped mark of this process to the timeline."""
    if _PATH:
        with open(_PATH, "a") as fh:
            fh.write(json.dumps({"pid": os.getpid(), "role": ROLE, "what": what, "t": time.time(),
                                 "cpu": time.process_time(), **extra}) + "\n")


def _profiled(fn, name: str):
    def wrapper(*args, **kwargs):
        import cProfile

        folder = os.environ.get("NBDDP_BENCH_PROFILE")
        profiler = cProfile.Profile() if folder else None
        mark(f"{name} start")
        try:
            return profiler.runcall(fn, *args, **kwargs) if profiler else fn(*args, **kwargs)
        finally:
            mark(f"{name} end")
            if profiler:
                os.makedirs(folder, exist_ok=True)
                profiler.dump_stats(os.path.join(folder, f"{ROLE}-{name}.prof"))

    return wrapper


def _wrap_runtime(module) -> None:
    for name in ("setup", "cleanup"):
        setattr(module, name, _profiled(getattr(module, name), name))


def _wrap_launch(module) -> None:
    """The launcher's ``launch``: from just before torchrun starts to the run's result."""
    launch = module.launch

    def wrapper(*args, **kwargs):
        mark("launch start")
        try:
            return launch(*args, **kwargs)
        finally:
            mark("launch end")

    module.launch = wrapper


ROLE = _role()
if _PATH:
    mark("created", t_created=_created())
    mark("site")
    atexit.register(mark, "exit")
if _PATH or os.environ.get("NBDDP_BENCH_PROFILE"):
    if ROLE.startswith("rank") or ROLE == "launcher":
        try:
            import wrapt

            if ROLE == "launcher":
                wrapt.register_post_import_hook(_wrap_launch, "nbddp.launch.supervise")
            else:
                wrapt.register_post_import_hook(_wrap_runtime, "nbddp.runtime")
        except ImportError:
            pass
