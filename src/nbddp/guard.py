"""One guard around nbddp's entry points: the CLI, the magics and the templates (``template.run_template``).

An exception in nbddp's own code (not a refusal, not a rank's failure) becomes one paragraph, an
``InternalError``: what nbddp was doing, the exception in one line, where its full traceback was saved (the
run directory when the job had one, else a temporary file) and how to report it; never a raw traceback.
What is meant for the user passes through as it is: an ``NbddpError`` (a refusal before launch, a rank's
failure: ``JobFailed`` with the notebook's cell and line), the exceptions a front end names (IPython's
``UsageError``), ``KeyboardInterrupt`` and ``SystemExit``.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Callable, Iterator

from .errors import NbddpError, printable

#: The run directory of the job under way, where an internal error's traceback is saved (``new_run_dir`` sets it).
_RUN_DIR: contextvars.ContextVar[Path | None] = contextvars.ContextVar("nbddp_run_dir", default=None)
#: The file an internal error's traceback is saved to in the run directory.
ERROR_FILE = "nbddp-internal-error.txt"
#: How to report one.
HOW_TO_REPORT = ("please report it on nbddp's issue tracker with that file attached (and the notebook, if you "
                 "can share it)")


class InternalError(NbddpError):
    """nbddp's own code failed: a bug in nbddp, not in the user's notebook. ``path`` holds the traceback."""

    def __init__(self, message: str, path: Path | None = None):
        super().__init__(message)
        self.path = path


def remember_run_dir(path: str | os.PathLike) -> None:
    """The job under way has this run directory: an internal error from here on saves its traceback there."""
    _RUN_DIR.set(Path(path))


@contextlib.contextmanager
def guarded(doing: str, passthrough: tuple[type[BaseException], ...] = ()) -> Iterator[None]:
    """Run the block; an exception that is not the user's (see the module's docstring) becomes an
    ``InternalError`` saying that nbddp was ``doing`` it ("converting nb.ipynb", "running %%ddp_train")."""
    token = _RUN_DIR.set(None)
    try:
        yield
    except (NbddpError, *passthrough):
        raise
    except MemoryError as exc:  # the machine's doing, not a bug: said as such, with no report to file
        raise out_of_memory(doing, exc) from None
    except Exception as exc:
        raise internal_error(doing, exc) from None
    finally:
        _RUN_DIR.reset(token)


def guard(doing: str, passthrough: tuple[type[BaseException], ...] = ()) -> Callable:
    """``guarded`` as a decorator (a magic, ``run_template``); the function's name and docstring are kept."""

    def decorate(func: Callable) -> Callable:
        @functools.wraps(func)
        def run(*args, **kwargs):
            with guarded(doing, passthrough):
                return func(*args, **kwargs)

        return run

    return decorate


def internal_error(doing: str, exc: BaseException) -> InternalError:
    """The paragraph a person reads for ``exc``, with its traceback saved first."""
    first = (printable(str(exc)).strip().splitlines() or [""])[0][:300]
    what = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    path, saved = _save(doing, exc)
    where = (f"The full traceback is in {path}; {HOW_TO_REPORT}." if path else
             f"Its traceback could not be saved ({saved}); {HOW_TO_REPORT.replace(' with that file attached', '')}.")
    return InternalError(f"internal error while {doing}: {what}. This is a bug in nbddp, not in your notebook. "
                         f"{where}", path)


def out_of_memory(doing: str, exc: MemoryError) -> NbddpError:
    """What a person reads when nbddp itself ran out of memory: where (nbddp's innermost frame) and how much
    memory the machine has left now (``MemoryError()`` carries no text of its own)."""
    frames = traceback.extract_tb(exc.__traceback__)
    ours = [f for f in frames if f"{os.sep}nbddp{os.sep}" in f.filename] or frames
    where = f" (in {Path(ours[-1].filename).name}, line {ours[-1].lineno})" if ours else ""
    text = printable(str(exc)).strip()
    left = _memory_available()
    return NbddpError(f"out of memory while {doing}{where}{': ' + text if text else ''}: the machine had no "
                      f"more memory to give{f' ({left} available now)' if left else ''}; close what else holds "
                      "memory (other kernels, jobs) and try again")


def _memory_available() -> str | None:
    """The machine's available memory as ``/proc/meminfo`` says it ("1.2 GiB"), or None where it cannot say."""
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            kib = next(int(line.split()[1]) for line in fh if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return None
    return f"{kib / 2**20:.1f} GiB"


def _save(doing: str, exc: BaseException) -> tuple[Path | None, str]:
    """Write the report: the run directory's ``ERROR_FILE`` where a job has one, else a temporary file."""
    from ._version import __version__

    text = "".join([
        f"nbddp {__version__} internal error while {doing}\n",
        f"time: {time.strftime('%Y-%m-%d %H:%M:%S')}\n",
        f"python {sys.version.split()[0]} on {platform.platform()}\n",
        f"argv: {sys.argv!r}\n\n",
        *traceback.format_exception(type(exc), exc, exc.__traceback__),
    ])
    run_dir = _RUN_DIR.get()
    try:
        if run_dir is not None and run_dir.is_dir():
            path = run_dir / ERROR_FILE
            path.write_text(text, encoding="utf-8", errors="backslashreplace")
            return path, ""
        fd, name = tempfile.mkstemp(prefix="nbddp-internal-error-", suffix=".txt")
        with os.fdopen(fd, "w", encoding="utf-8", errors="backslashreplace") as fh:
            fh.write(text)
        return Path(name), ""
    except OSError as err:  # a full disk, a read-only temporary folder: the paragraph is said all the same
        return None, err.strerror or str(err)
