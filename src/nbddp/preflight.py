"""What a job's options ask of this machine, checked before anything converts or starts: the processes against
the GPUs torch sees (or the CPU cores), the nodes of a multi-node job, a ``--master-port`` given to torchrun, and
the paths the options name.

Each refusal is one ``NbddpError`` line naming the option, the value and what to do; the front ends call these
as soon as their options are parsed. Light on purpose: no converter, no launcher; torch only to count GPUs,
which it does without a CUDA context (NVML), so a kernel that asks stays fork-safe.
"""

from __future__ import annotations

import os
import re
import socket
import tempfile
from pathlib import Path

from .errors import LaunchError, NbddpError, printable
from .gpus import GPU_COUNT_ENV, GPU_DEVICE_FILES, read_machine  # noqa: F401 (the names others read here)

def gpu_count() -> int:
    """GPUs torch sees here (``CUDA_VISIBLE_DEVICES`` applied), without initialising CUDA; 0 without torch.
    ``NBDDP_GPU_COUNT`` overrides it (``gpus.read_machine``, the count alone)."""
    return read_machine(memory=False).gpus


def cpu_cores() -> int:
    """The CPU cores this process may run on (its affinity, as a container or ``taskset`` limits it)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def check_processes(nproc: int | None, gpus: int | None = None, cores: int | None = None) -> list[str]:
    """Refuse more processes than the GPUs torch sees (each rank takes one GPU: the ones past the last would
    fail with CUDA's "invalid device ordinal"); on a machine without GPUs ``--nproc`` is a number of CPU
    processes, and more than its cores is only slow: returned as a warning (their memory:
    ``check_cpu_memory``). ``None`` (auto) always fits."""
    if nproc is None:
        return []
    gpus = gpu_count() if gpus is None else gpus
    if gpus and nproc > gpus:
        raise NbddpError(
            f"--nproc {nproc} asks for {nproc} processes, one per GPU, but torch sees {gpus} GPU(s) here: use "
            f"--nproc {gpus} (or leave --nproc out: one process per GPU), or run on a machine with more GPUs "
            "(on Kaggle: Settings > Accelerator > GPU T4 x2; check CUDA_VISIBLE_DEVICES)")
    cores = cpu_cores() if cores is None else cores
    if not gpus and nproc > cores:
        return [f"--nproc {nproc} starts {nproc} CPU processes (no GPU here) on {cores} CPU core(s): they share the "
                f"cores and each step slows down; --nproc {max(cores, 1)} or fewer runs faster"]
    return []


#: What one CPU rank holds besides its model: torch imported, a gloo process group, the interpreter (a rank
#: forked from an agent that imported torch shares some of it; one started fresh holds it all).
RANK_BYTES_LEAST = 300 * 2**20
RANK_BYTES_MOST = 500 * 2**20


def available_memory() -> int:
    """Bytes this machine can give new processes without swapping (psutil's ``available``)."""
    import psutil  # only where CPU ranks are counted

    return psutil.virtual_memory().available


def check_cpu_memory(nproc: int, model_bytes: int = 0, available: int | None = None) -> list[str]:
    """Refuse CPU ranks that plainly cannot fit this machine's available memory (each holds torch's own
    ``RANK_BYTES_LEAST`` and a copy of the model, ``model_bytes`` where known); warn where they might not."""
    available = available_memory() if available is None else available
    least, most = nproc * (RANK_BYTES_LEAST + model_bytes), nproc * (RANK_BYTES_MOST + model_bytes)
    each = f"{_gb(RANK_BYTES_LEAST + model_bytes)} to {_gb(RANK_BYTES_MOST + model_bytes)} each" + (
        " (torch alone)" if not model_bytes else " (torch and the model)")
    fits = max(1, available // (RANK_BYTES_MOST + model_bytes))
    if least > available:
        raise NbddpError(f"--nproc {nproc} starts {nproc} CPU processes of {each}, at least {_gb(least)} in all, "
                         f"but this machine has {_gb(available)} of memory available: use --nproc {fits} or fewer")
    if most > available:
        return [f"--nproc {nproc} starts {nproc} CPU processes of {each}, up to {_gb(most)} in all, with "
                f"{_gb(available)} of memory available: they may run out of memory; --nproc {fits} or fewer fits"]
    return []


def _gb(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


_NODES = re.compile(r"(\d+)(?::(\d+))?")


def check_nodes(nnodes: str | int | None, node_rank: int | None, rdzv_endpoint: str | None) -> None:
    """``--nnodes N`` or ``MIN:MAX`` (at least 1, MIN not above MAX), ``--node-rank`` from 0 to below the
    nodes, ``--rdzv-endpoint HOST[:PORT]``: what torchrun would otherwise refuse with a traceback."""
    most = None
    if nnodes is not None:
        m = _NODES.fullmatch(str(nnodes).strip())
        low, high = (int(m.group(1)), int(m.group(2) or m.group(1))) if m else (0, 0)
        if not m or low < 1 or low > high:
            raise NbddpError(f"--nnodes takes a number of machines of at least 1, or MIN:MAX, not {str(nnodes)!r}")
        most = high
    if node_rank is not None and node_rank < 0:
        raise NbddpError(f"--node-rank takes this machine's rank among the nodes, from 0 or more, not {node_rank}")
    if node_rank is not None and most is not None and node_rank >= most:
        raise NbddpError(f"--node-rank takes this machine's rank among the nodes, from 0 to {most - 1}, "
                         f"not {node_rank}")
    if rdzv_endpoint is not None:
        host, colon, port = str(rdzv_endpoint).rpartition(":") if ":" in str(rdzv_endpoint) else (rdzv_endpoint, "", "")
        bad_port = colon and not (port.isdigit() and 0 < int(port) < 65536)
        if not host.strip() or any(c.isspace() for c in host) or bad_port:
            raise NbddpError(f"--rdzv-endpoint takes HOST:PORT (a port from 1 to 65535), not {str(rdzv_endpoint)!r}")


def check_torchrun_args(torchrun_args: list[str]) -> None:
    """The same checks on what is passed to torchrun after ``--`` (``-- --nnodes=0``), and its
    ``--max-restarts``: torchrun would otherwise refuse them with its own traceback."""
    node_rank = torchrun_option(torchrun_args, "node-rank")
    if node_rank is not None and not node_rank.lstrip("-").isdigit():
        raise NbddpError(f"--node-rank takes this machine's rank among the nodes, not {node_rank!r}")
    check_nodes(torchrun_option(torchrun_args, "nnodes"), int(node_rank) if node_rank is not None else None,
                torchrun_option(torchrun_args, "rdzv-endpoint"))
    check_rendezvous(torchrun_args)
    restarts = torchrun_option(torchrun_args, "max-restarts")
    if restarts is not None and not restarts.isdigit():
        raise NbddpError(f"--max-restarts takes a number of restarts of 0 or more, not {restarts!r}")


def check_rendezvous(torchrun_args: list[str]) -> None:
    """A job's machines must find each other: more than one node needs a meeting point (``--rdzv-endpoint``, or
    torchrun's static ``--master-addr``/``--master-port``, which the master node gives alone), else torchrun waits
    on this machine for nodes that cannot reach it; one node has only node rank 0. ``torchrun_args`` are all of
    torchrun's (the options' and those after ``--``)."""
    nnodes, node_rank = torchrun_option(torchrun_args, "nnodes"), torchrun_option(torchrun_args, "node-rank")
    m = _NODES.fullmatch(str(nnodes or "1").strip())
    most = int(m.group(2) or m.group(1)) if m else 1
    if most == 1 and node_rank is not None and node_rank.isdigit() and int(node_rank) > 0:
        raise NbddpError(f"--node-rank {node_rank} needs a job of more than one machine, but it runs on one (no "
                         "--nnodes): leave --node-rank out, or give --nnodes N and --rdzv-endpoint HOST:PORT")
    endpoint = any(torchrun_option(torchrun_args, name) for name in ("rdzv-endpoint", "master-addr", "master-port"))
    if most > 1 and not endpoint:
        raise NbddpError(f"--nnodes {nnodes} needs --rdzv-endpoint HOST:PORT (one machine's address and a free port, "
                         "the same on every machine): without it this machine waits for nodes that cannot find it")


def check_shims(flag: str, names: tuple[str, ...], known: tuple[str, ...]) -> None:
    """``--shim``/``--no-shim`` take the name of a shim or of a switchable feature; any other name would set a
    variable no rank reads."""
    for name in names:
        if str(name).lower() not in known:
            raise NbddpError(f"{flag} takes one of {', '.join(known)}, not {name!r}")


def check_master_port(torchrun_args: list[str]) -> None:
    """Refuse a user-chosen ``--master-port`` that is no port number, or that something on this machine
    already listens on (a ``LaunchError`` rather than a rendezvous that fails or hangs later).

    Busy is checked only for a single-node job: across nodes the port is on the master's host, not
    necessarily this one.
    """
    port = torchrun_option(torchrun_args, "master-port")
    if port is not None and not (port.isdigit() and 1 <= int(port) <= 65535):
        raise LaunchError(f"--master-port takes a port number from 1 to 65535, not {port!r}")
    if torchrun_option(torchrun_args, "nnodes") not in (None, "1", "1:1"):
        return
    if port and not port_is_free(int(port)):
        raise LaunchError(
            f"port {port} (--master-port) is already in use on this machine; "
            "leave --master-port out and torchrun picks a free port"
        )


def port_is_free(port: int) -> bool:
    """True when a server could listen on ``port`` on every interface, as torchrun's TCPStore does."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("", port))
        except OSError:
            return False
    return True


def check_output_file(path: str | os.PathLike | None, flag: str) -> None:
    """A file path an option names to write (``nbddp convert -o``, ``%%ddp_train --save``): not empty, not a
    folder, in a folder that is or can be made and written. Tried, not inferred: nothing is left behind."""
    if path is None:
        return
    if not str(path).strip():
        raise NbddpError(f"{flag} takes a file path, not {str(path)!r}")
    _no_nul(path, flag)
    target = Path(path)
    try:
        is_dir = target.is_dir()
    except (OSError, ValueError) as exc:  # a NUL byte, a name too long
        raise NbddpError(f"{flag} {str(path)!r} is not a path this system can write ({_why(exc)})") from None
    if is_dir:
        raise NbddpError(f"{flag} {path} is a folder; give a file path, e.g. {target / 'train.py'}")
    _a_file_or_new(target, flag)
    reason = unwritable_folder(target.parent if str(target.parent) else Path("."))
    if reason:
        raise NbddpError(f"{flag} {path} cannot be written: its folder {target.parent} {reason}")


def check_folder(path: str | os.PathLike | None, flag: str) -> None:
    """A folder an option names to write into (``--runs-dir``): not empty, and made or writable."""
    if path is None:
        return
    if not str(path).strip():
        raise NbddpError(f"{flag} takes a folder, not {str(path)!r}")
    _no_nul(path, flag)
    try:
        reason = unwritable_folder(Path(path))
    except (OSError, ValueError) as exc:
        raise NbddpError(f"{flag} {str(path)!r} is not a path this system can write ({_why(exc)})") from None
    if reason:
        raise NbddpError(f"{flag} {path} {reason}: choose a folder you can write to")


def _why(exc: Exception) -> str:
    return exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)


def _a_file_or_new(target: Path, flag: str) -> None:
    """A path to write is a regular file or none yet (a symlink: its target), never a device or a FIFO: the
    write would replace the node with a file (``-o /dev/null`` as root: the machine's ``/dev/null``)."""
    from .runtime.io import not_a_file

    what = not_a_file(target)
    if what:
        shown = f"{target} (a link to {os.path.realpath(target)})" if target.is_symlink() else str(target)
        raise NbddpError(f"{flag} {shown} is {what}, not a file: give the path of a file to write "
                         "(to check that a notebook converts, leave -o out: the script goes to stdout)")


def _no_nul(path: str | os.PathLike, flag: str) -> None:
    """No file name holds a NUL byte (``pathlib`` calls such a path missing rather than refuse it)."""
    if "\x00" in str(path):
        raise NbddpError(f"{flag} '{printable(str(path))}' cannot be a path: it holds a NUL byte")


def unwritable_folder(path: Path) -> str | None:
    """Why files cannot be made in ``path`` (made first if missing), or None when they can.

    Tried, not inferred from permission bits: root ignores those, a read-only mount (``/proc``) does not.
    The try is a temporary file in the nearest folder that exists, removed at once: nothing is made.
    """
    existing = path
    while not existing.exists():
        if existing.is_symlink() or existing.parent == existing:
            return "cannot be made"
        existing = existing.parent
    if not existing.is_dir():
        return f"cannot be made: {existing} is a file" if existing != path else "is a file, not a folder"
    try:
        fd, probe = tempfile.mkstemp(prefix=".nbddp-probe-", dir=existing)
    except OSError as exc:
        what = "is not writable" if existing == path else f"cannot be made in {existing}"
        return f"{what} ({exc.strerror})"
    os.close(fd)
    os.unlink(probe)
    return None


def torchrun_option(args: list[str], name: str) -> str | None:
    """The last value of a torchrun option, given as ``--name=v`` or ``--name v`` (``-`` or ``_`` inside)."""
    pattern = re.compile("--" + re.escape(name).replace("\\-", "[-_]") + r"(?:=(.*))?")
    value = None
    for i, a in enumerate(args):
        m = pattern.fullmatch(a)
        if m:
            value = m.group(1) if m.group(1) is not None else (args[i + 1] if i + 1 < len(args) else None)
    return value
