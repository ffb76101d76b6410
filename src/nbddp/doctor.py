"""Pre-flight checks before training on several GPUs: what the ranks will see, and what tends to go wrong.

``run()`` gives a ``Report`` of ``Check``s: the GPUs and the precisions they support, memory the kernel itself
holds on them, ``/dev/shm`` (NCCL's shared-memory transport fails when it is small), an all-reduce across
every GPU (gloo across 2 processes without GPUs) bounded by a timeout, and — in a notebook kernel that sees
several GPUs — the DataParallel trap of training in the kernel. The GPU facts come from the ranks of the
all-reduce probe (``runtime/probe.py``), so the kernel never initialises CUDA to answer.
``%ddp_doctor`` and ``nbddp doctor`` both print ``Report.text()``.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from . import launch
from .gpus import read_machine
from .options import RunOptions, check_nproc

GiB = 2**30
#: Below this, NCCL's shared-memory transport between GPUs of one machine can fail to allocate.
MIN_SHM_BYTES = 1 * GiB
#: Seconds the all-reduce probe may take, start-up included.
DEFAULT_TIMEOUT_S = 90.0

NCCL_HINTS = (
    "NCCL_P2P_DISABLE=1 where GPUs cannot reach each other directly (common on PCIe machines such as "
    "Kaggle's 2×T4), NCCL_SHM_DISABLE=1 when /dev/shm is small; NCCL_DEBUG=INFO shows where it stops. "
    "Pass them with %%ddp_train --env NAME=VALUE"
)


@dataclass(frozen=True)
class Check:
    """One finding: ``status`` is ``ok``, ``info``, ``warn`` or ``fail``; ``hint`` says what to do."""

    name: str
    status: str
    detail: str
    hint: str = ""


@dataclass(frozen=True)
class Report:
    checks: tuple[Check, ...]

    @property
    def ok(self) -> bool:
        return all(c.status != "fail" for c in self.checks)

    def text(self) -> str:
        width = max((len(c.name) for c in self.checks), default=0)
        return "\n".join(["nbddp doctor", *(check_lines(c, width) for c in self.checks)])


#: The width of a check's name when checks are shown one by one, before all the names are known.
NAME_WIDTH = len("kernel memory")


def check_lines(c: Check, width: int = NAME_WIDTH) -> str:
    """``  ok    /dev/shm  64 GiB``, and the hint on a line below."""
    line = f"  {c.status:<4}  {c.name:<{width}}  {c.detail}"
    return line + (f"\n        {'':<{width}}  → {c.hint}" if c.hint else "")


def run(*, in_kernel: bool = False, nproc: int | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
        show: Callable[[str], None] | None = None, script_text: str | None = None, cwd=None) -> Report:
    """Every check. ``in_kernel`` adds the checks about the notebook kernel this runs in; ``script_text``
    (a notebook's converted script, its ranks starting in ``cwd``) adds the memory estimate ``auto`` would
    choose its strategy from, against the GPUs the probe found.

    ``show`` gets the report's lines as the checks are done, the quick ones first and a line saying the
    all-reduce probe is under way (a notebook cell shows each check as it comes, not all after the probe).
    """
    check_nproc(nproc)  # before any check: a probe of 0 processes would fail as a broken link would
    RunOptions(timeout_s=timeout_s)  # the same refusal of a timeout as a job's
    show = show or (lambda text: None)
    show("nbddp doctor")
    machine = read_machine(memory=False)  # read once: the GPUs' count and the probe's processes
    n_gpus, nproc = machine.gpus, machine.processes(nproc)
    local = [kernel_memory_check()] if in_kernel else []
    local.append(shm_check())
    for check in local:
        show(check_lines(check))
    show(f"  ...   {'all-reduce':<{NAME_WIDTH}}  starting {nproc} processes "
         f"(up to {timeout_s:.0f} s)")
    probe = all_reduce_probe(nproc=nproc, timeout_s=timeout_s)
    found = [gpus_check(probe.devices, n_gpus), precision_check(probe.devices), probe.check]
    if in_kernel and n_gpus > 1:
        found.append(data_parallel_check(n_gpus))
    if script_text is not None:
        found.append(memory_check(script_text, cwd, probe.devices))
    for check in found:
        show(check_lines(check))
    gpus, precision, *rest = found
    return Report((gpus, precision, *local, *rest))


def gpus_check(devices: list[dict], n_gpus: int) -> Check:
    gpus = [d for d in devices if d.get("name")]
    if not gpus:
        if n_gpus:
            return Check("GPUs", "fail", f"{n_gpus} visible here, but the ranks could not report on them")
        return Check("GPUs", "info", "none visible: the ranks run on CPU with gloo (fine for trying, slow to train)")
    parts = [
        f"cuda:{d['local_rank']} {d['name']} (sm {d['capability']}, {d['total_bytes'] / GiB:.1f} GiB, "
        f"{d['free_bytes'] / GiB:.1f} free)"
        for d in gpus
    ]
    return Check("GPUs", "ok", f"{len(gpus)}: " + "; ".join(parts))


def precision_check(devices: list[dict]) -> Check:
    gpus = [d for d in devices if d.get("name")]
    if not gpus:
        return Check("precision", "info", "CPU: float32")
    if all(d.get("bf16") for d in gpus):
        return Check("precision", "ok", "bf16 and fp16")
    names = sorted({d["name"] for d in gpus if not d.get("bf16")})
    return Check("precision", "warn", f"no bf16 on {', '.join(names)}: fp16 only",
                 "train with fp16=True, bf16=False (and load 4-bit models with bnb_4bit_compute_dtype=torch.float16)")


def kernel_gpu_memory() -> dict[int, int]:
    """Bytes PyTorch holds on each GPU in this process. Empty unless torch is already imported here and has
    used CUDA: looking never initialises CUDA (which would itself take memory on GPU 0)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return {}
    held = {i: torch.cuda.memory_reserved(i) for i in range(torch.cuda.device_count())}
    return {i: n for i, n in held.items() if n}


def kernel_memory_warning(held: dict[int, int] | None = None) -> str | None:
    """A warning for a kernel that holds GPU memory the ranks will need, saying how to free it."""
    held = kernel_gpu_memory() if held is None else held
    if not held:
        return None
    where = ", ".join(f"cuda:{i} {n / GiB:.1f} GiB" for i, n in sorted(held.items()))
    return (
        f"this kernel holds GPU memory the ranks will need ({where}, plus its CUDA context). Free it first: "
        "del model, trainer; import gc; gc.collect(); torch.cuda.empty_cache() — or restart the kernel and "
        "mark the cells that load the model %%ddp_setup, so they run only in the ranks"
    )


def kernel_memory_check() -> Check:
    warning = kernel_memory_warning()
    if warning:
        return Check("kernel memory", "warn", warning)
    return Check("kernel memory", "ok", "the kernel holds no GPU memory")


def shm_check(path: str = "/dev/shm", minimum: int = MIN_SHM_BYTES) -> Check:
    try:
        usage = shutil.disk_usage(path)
    except OSError:
        return Check("/dev/shm", "info", f"{path} not found (not Linux?): NCCL will not use shared memory")
    detail = f"{usage.total / GiB:.2f} GiB ({usage.free / GiB:.2f} free)"
    if usage.total < minimum:
        return Check("/dev/shm", "warn", detail + ": too small for NCCL's shared-memory transport",
                     "train with NCCL_SHM_DISABLE=1 (%%ddp_train --env NCCL_SHM_DISABLE=1), or give the "
                     "container more (docker run --shm-size=2g)")
    return Check("/dev/shm", "ok", detail)


def data_parallel_check(n_gpus: int) -> Check:
    return Check(
        "in-kernel training", "warn",
        f"this kernel sees {n_gpus} GPUs: a Trainer run here wraps the model in DataParallel, which crashes with "
        "gradient checkpointing (CheckpointError: Recomputed values … have different metadata) or scales poorly",
        "train with %%ddp_train (one process per GPU), or set CUDA_VISIBLE_DEVICES=0 before importing torch "
        "to train in the kernel on one GPU",
    )


def memory_check(script_text: str, cwd, devices: list[dict]) -> Check:
    """What one rank of this notebook needs and the strategy ``--strategy auto`` picks (``choose_strategy.decide``)."""
    from . import choose_strategy
    from .errors import NbddpError

    free = tuple(int(d["free_bytes"]) for d in devices if d.get("name"))
    try:
        decision = choose_strategy.decide(script_text, cwd, "auto", gpu_free=free)
    except NbddpError as exc:
        return Check("memory", "warn", str(exc))
    detail = decision.summary().replace("nbddp: ", "").replace("\n", "; ")
    return Check("memory", "ok" if decision.strategy == "ddp" else "info", detail)


@dataclass(frozen=True)
class Probe:
    """What the all-reduce probe found: each rank's device and the all-reduce check."""

    devices: list[dict]
    check: Check


#: The script each rank runs: the probe's ranks, as ``runtime/probe.py`` defines them.
PROBE_SCRIPT = "from nbddp.runtime.probe import main\n\nmain()\n"


def all_reduce_probe(nproc: int | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> Probe:
    """Start ``runtime/probe.py`` under torchrun on every GPU (2 processes on CPU) and read what it wrote.

    The process group and the launcher both give up after ``timeout_s``. The probe's files are removed when it
    succeeds and kept, with every rank's log, when it does not.
    """
    run_dir = Path(tempfile.mkdtemp(prefix="nbddp-doctor-"))
    script = run_dir / "probe.py"
    script.write_text(PROBE_SCRIPT)
    plan = launch.plan(script, run_dir, RunOptions(timeout_s=timeout_s), nproc=nproc, cwd=run_dir,
                       env={"NBDDP_TIMEOUT": str(int(timeout_s))})
    output: list[str] = []
    result = launch.launch(plan, sink=lambda stream, text: output.append(text))
    devices = [json.loads(p.read_text()) for p in sorted(run_dir.glob("device-*.json"))]
    found = run_dir / "allreduce.json"
    data = json.loads(found.read_text()) if found.exists() else None
    name = "all-reduce"
    if result.ok and data and data["correct"]:
        shutil.rmtree(run_dir, ignore_errors=True)
        bandwidth = f", {data['bus_bytes_per_s'] / 1e9:.2f} GB/s bus bandwidth" if data["bus_bytes_per_s"] else ""
        detail = (f"{data['world_size']} processes over {data['backend']}: correct, "
                  f"{data['bytes'] / 2**20:.0f} MiB in {data['seconds'] * 1e3:.1f} ms{bandwidth}")
        return Probe(devices, Check(name, "ok", detail))
    if data and not data["correct"]:
        detail = f"wrong sum: {data['value']} instead of {data['expected']}"
    elif result.timed_out:
        detail = f"no answer within {timeout_s:.0f} s (ranks stopped)"
    elif result.failure:
        detail = f"rank {result.failure.rank}: {result.failure.message}"
    else:
        tail = "".join(output).strip().splitlines()[-1:] or [f"torchrun exited with {result.returncode}"]
        detail = tail[0]
    return Probe(devices, Check(name, "fail", f"{detail}; logs in {run_dir}", NCCL_HINTS))
