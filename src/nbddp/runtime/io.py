"""Writes that never leave a half-written file: a temporary file in the same folder, then a rename.

A process killed mid-write (a rank stopped because another one died, Ctrl-C, the out-of-memory killer)
leaves at most a hidden ``.<name>.<random>`` temporary file; the target is either the old complete file or
the new complete one, never a truncated one.

The write lands where ``open(path, "w")`` would: a symlink is followed and its target written (the link stays a
link); a path naming a device or a FIFO is written in place, never renamed over (a rename would turn
``/dev/null`` into a regular file for the whole machine). ``not_a_file`` says what such a path is, for the
front ends that refuse it before anything is written (``nbddp convert -o``).
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from pathlib import Path
from typing import Iterator


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


#: Permissions a plain ``open(path, "w")`` would give a new file (temporary files start as 0600).
_DEFAULT_MODE = 0o666 & ~_umask()


#: What a path that is no regular file is, by its ``stat`` kind, as a message says it.
_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device"),
          (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"))


def write_target(path: str | os.PathLike) -> Path:
    """The path a write to ``path`` lands on: a symlink's final target (a dangling one's target is created, as
    ``open`` would), else ``path`` itself."""
    return Path(os.path.realpath(path)) if os.path.islink(path) else Path(path)


def not_a_file(path: str | os.PathLike) -> str | None:
    """What ``path`` (a symlink: its target) is when it exists and is not a regular file ("a device", "a FIFO
    (named pipe)", "a folder"); None for a regular file or a path not there yet."""
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return None
    return next((kind for is_kind, kind in _KINDS if is_kind(mode)), None if stat.S_ISREG(mode) else "not a file")


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, mode: int | None = None) -> Iterator[str]:
    """Yield a temporary path beside ``path``'s target; when the block ends without error, rename it there.

    A device or FIFO is yielded as it is: written in place, as a plain write would (there is no truncated file
    to guard against, and a rename would replace the node)."""
    path = write_target(path)
    if not_a_file(path) not in (None, "a folder"):  # a folder: the rename below fails, as it should
        yield str(path)
        return
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
