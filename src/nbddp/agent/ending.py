"""What torchrun's process and the ranks it forks share at their end: Python's exit, less the module teardown."""

from __future__ import annotations

import sys


def flush_standard_streams() -> None:
    """stdout and stderr flushed, whatever state they are in (closed, replaced, a broken pipe)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass
