"""Writes that never leave a half-written file: a temporary file in the same folder, then a rename.

A process killed mid-write (a rank stopped because another one died, Ctrl-C, the out-of-memory killer)
leaves at most a hidden ``.<name>.<random>`` temporary file; the target is either the old complete file or
the new complete one, never a truncated one.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Iterator


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


#: Permissions a plain ``open(path, "w")`` would give a new file (temporary files start as 0600).
_DEFAULT_MODE = 0o666 & ~_umask()


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, mode: int | None = None) -> Iterator[str]:
    """Yield a temporary path beside ``path``; when the block ends without error, rename it to ``path``."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        yield tmp
        os.chmod(tmp, _DEFAULT_MODE if mode is None else mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_text(path: str | os.PathLike, text: str, mode: int | None = None) -> Path:
    """Write ``text`` to ``path`` atomically (and durably: flushed to disk before the rename), making its folder."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path, mode) as tmp:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
    return Path(path)
