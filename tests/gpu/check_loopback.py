"""On a machine with GPUs, a single-machine job listens on loopback only: torchrun's stores, gloo's sockets and
NCCL's bootstrap socket (``agent/loopback.py``). The CPU lane's check (``tests/test_faults.py``) sees gloo's;
NCCL's is seen only where NCCL runs.

Runs ``nbddp run notebooks/quickstart.ipynb`` on every GPU and, while it runs, reads every listening TCP socket
of its process tree (psutil) every 0.2 s. PASS: sockets were seen, and none on a wildcard or outward address.
Exit 0 on PASS.

    python3 tests/gpu/check_loopback.py
"""

from __future__ import annotations

import ipaddress
import subprocess
import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]


def listening(root: psutil.Process) -> set[tuple[str, str, int]]:
    """(command, address, port) of every listening TCP socket held by ``root`` or its descendants."""
    seen = set()
    for process in [root, *root.children(recursive=True)]:
        try:
            for c in process.net_connections(kind="tcp"):
                if c.status == psutil.CONN_LISTEN:
                    seen.add((" ".join(process.cmdline()[:3]), c.laddr.ip, c.laddr.port))
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return seen


def main() -> int:
    job = subprocess.Popen([sys.executable, "-m", "nbddp.cli", "run", "notebooks/quickstart.ipynb",
                            "--skip-installs", "--runs-dir", "/tmp/gpu-runs-loopback"], cwd=ROOT)
    root, seen = psutil.Process(job.pid), set()
    while job.poll() is None:
        seen |= listening(root)
        time.sleep(0.2)
    for command, ip, port in sorted(seen):
        print(f"listening {ip}:{port}  ({command})")
    outward = [s for s in seen if not ipaddress.ip_address(s[1]).is_loopback]
    ok = job.returncode == 0 and seen and not outward
    print("PASS" if ok else f"FAIL: job exit {job.returncode}, {len(seen)} sockets seen, outward: {outward}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
