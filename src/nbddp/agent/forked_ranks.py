"""Ranks forked from torchrun's process, which imported torch once, in place of a fresh ``python -u script``.

Every rank of a job used to start a new interpreter and import torch again (2.4 CPU s here), then ``torch._dynamo``
at its first optimizer step (1.8 CPU s): on a 2-core machine, a third of a small job's CPU. torchrun's process
(``nbddp.agent``) has imported torch already. So the agent imports what every rank imports once
(``agent/preload.py``), and starts each rank with ``fork()`` where torchrun would ``Popen`` it: the rank begins with
those modules in memory, shared copy-on-write.

What the rank sees is what ``python -u script`` gives it (``run_rank``): a session of its own (torchrun stops ranks
by process group), torchrun's log files as stdout and stderr, unbuffered, the environment torchrun made for it,
``sys.argv`` and ``sys.path[0]`` of the script, default signal handlers, the warnings filters and root logger as
they were before torchrun ran, torch's thread count from ``OMP_NUM_THREADS``, numpy's global generator seeded
afresh, ``sitecustomize`` run again with the rank's environment, and ``__main__`` the script (``.pth`` files ran
once, in the agent). At its end, as Python's own exit does: non-daemon threads joined, exit handlers run, the
script's objects released (open files flushed), then ``os._exit`` — never back into torchrun's code, whose
``finally`` blocks belong to the agent.

Where a fork would not give that, torchrun's ``Popen`` runs as before: not Linux; a command that is not ``python
-u <script>`` (``--no-python``, ``-m``); CUDA's driver initialized by the agent's imports (a child forked after
that cannot use CUDA); a torch whose handler has no ``_popen``; or ``NBDDP_FORK_RANKS=0``.

On a machine with GPUs too. torchrun's agent initializes CUDA there before it starts the ranks, which is why ranks
were once started fresh wherever there were GPUs; but the process they are forked from (``forker``) is forked
before torchrun runs, when the agent has imported torch and left the driver alone (``preload`` imports nothing
that initializes it there, ``install`` checks), so each rank initializes CUDA itself, on its own GPU, as a fresh one
does. What it saves there: each rank's own import of torch, seconds before a prediction's first row
(``benchmarks/results/predict_speed_gpu_notes.md``).

What the agent imports for its ranks, and why no more: ``agent/preload.py``.

The ranks are not forked from torchrun's process itself, which runs threads (its store, its rendezvous
keep-alive, its log tailers): a lock one of them held at the fork would stay held in the rank (a rank hung so, in
glibc's resolver). The agent forks one process for that before torchrun runs (``agent/forker.py``), and that
process forks each rank; a rank's parent is that process. Measured: ``benchmarks/results/forked_ranks.md``.

Runs in torchrun's process (imported by ``nbddp.agent``); the ranks' own code is ``runtime``.
"""

from __future__ import annotations

import os
import sys

from . import forker, preload
from .ending import flush_standard_streams

#: What ``cuDeviceGetCount`` answers before ``cuInit``.
_CUDA_ERROR_NOT_INITIALIZED = 3

#: The switch: ``NBDDP_FORK_RANKS=0`` starts every rank as a fresh interpreter, as torchrun does.
SWITCH = "NBDDP_FORK_RANKS"


class _Before:
    """The interpreter's state a fresh rank would start from, taken before torchrun changes it."""

    def __init__(self, exit_handlers: list[tuple]):
        import logging
        import warnings

        root = logging.getLogger()
        self.filters = list(warnings.filters)
        self.root_handlers = list(root.handlers)
        self.root_level = root.level
        self.excepthook = sys.excepthook
        self.exit_handlers = exit_handlers


_before: _Before | None = None
#: In a rank, the agent's ``sitecustomize``/``usercustomize``, held so that nothing of theirs is finalized there.
_agents_customizations: list = []


def enabled(environ=None) -> bool:
    """Possible on this machine (``possible_here``) and not switched off in ``environ`` (this process's by
    default; the launcher asks of a job's environment before its agent exists)."""
    from ..runtime import settings

    environ = os.environ if environ is None else environ
    return possible_here() and settings.parse(settings.BY_NAME[SWITCH], environ.get(SWITCH)) is not False


def possible_here() -> bool:
    """Linux. On a machine with GPUs too: torchrun's agent initializes CUDA before it starts the ranks, but the
    forker was forked before that, from an agent whose imports left the driver uninitialized (``install`` checks;
    ``preload`` leaves out what would initialize it), so a rank forked from it takes its GPU as a fresh one does."""
    return sys.platform.startswith("linux")


def install() -> bool:
    """In the agent, before anything imports torch: import what the ranks will (``preload``), fork the process
    the ranks will be forked from (``forker``) and make torchrun ask it for its ranks.
    False (and torchrun unchanged) where that cannot be done."""
    global _before
    if not enabled():
        return False
    exit_handlers = preload.load(preload.PRELOAD)
    exit_handlers += preload.load(preload.preload_for(preload.training_script(sys.argv[1:])))
    _before = _Before(exit_handlers)  # as a rank that imported them would be, before torchrun changes it
    try:
        from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler
    except ImportError:
        return False
    handler = subprocess_handler.SubprocessHandler
    if not callable(getattr(handler, "_popen", None)) or cuda_driver_initialized():
        return False
    popen = handler._popen
    try:
        ranks_forker = forker.start(become_rank)
    except OSError:
        return False
    import atexit

    atexit.register(ranks_forker.close)  # the agent's own exit waits for it: no process of the job outlives it

    def _popen(self, args, env):
        script_args = _script_args(args)
        pid = None
        if script_args is not None:
            pid = ranks_forker.fork((script_args, env, _working_folder()), self._stdout, self._stderr)
        if pid is None:
            return popen(self, args, env)
        return forker.ReportedChild(pid, args, ranks_forker)

    handler._popen = _popen
    return True


def _working_folder() -> str | None:
    """Where torchrun's ``Popen`` would start the rank: this process's working folder (None if it vanished: the
    rank then stays where the forker is)."""
    try:
        return os.getcwd()
    except OSError:
        return None


def _script_args(args: tuple) -> list[str] | None:
    """``[script, *args]`` of ``(python, -u, script, *args)``; None for any other command."""
    if len(args) >= 3 and args[0] == sys.executable and args[1] == "-u" and not str(args[2]).startswith("-"):
        return [str(a) for a in args[2:]]
    return None


def cuda_driver_initialized() -> bool:
    """Whether CUDA's driver was initialized in this process (``cuInit``): a forked child cannot use CUDA
    after that. Asked without initializing it: ``cuDeviceGetCount`` answers CUDA_ERROR_NOT_INITIALIZED (3)
    before ``cuInit``. A driver never loaded was never initialized; one that cannot be asked counts as
    initialized."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            if not any("libcuda.so" in line for line in maps):
                return False
        import ctypes

        count = ctypes.c_int(0)
        return ctypes.CDLL("libcuda.so.1").cuDeviceGetCount(ctypes.byref(count)) != _CUDA_ERROR_NOT_INITIALIZED
    except (OSError, AttributeError):
        return True


def become_rank(script_args: list[str], env: dict[str, str], cwd: str | None, stdout: int | None,
                stderr: int | None) -> None:
    """In the child the forker just forked: run ``script_args`` with ``env`` in ``cwd``, its output in the files
    torchrun opened (``stdout``/``stderr`` descriptors; None: the forker's own), then end the process."""
    code = 1
    try:
        os.setsid()
        if cwd is not None:
            os.chdir(cwd)
        for fd, target in ((1, stdout), (2, stderr)):
            if target is not None and target != fd:
                os.dup2(target, fd)
                os.close(target)
        code = run_rank(script_args, env)
    except BaseException:  # noqa: BLE001 - whatever happens, this process ends here
        try:
            import traceback

            traceback.print_exc()
            sys.stderr.flush()
        except BaseException:  # noqa: BLE001
            pass
    finally:
        if code < 0:
            import signal

            signal.signal(-code, signal.SIG_DFL)
            os.kill(os.getpid(), -code)
        os._exit(code & 0xFF)


def run_rank(script_args: list[str], env: dict[str, str]) -> int:
    """Run the script as ``python -u`` would in this fresh child; its exit code."""
    as_a_fresh_interpreter(script_args, env, os.path.dirname(os.path.realpath(script_args[0])))
    import runpy

    code = 0
    namespace = None
    try:
        namespace = runpy.run_path(script_args[0], run_name="__main__")
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except KeyboardInterrupt:
        _report_uncaught(script_args[0])
        code = -2  # Python ends by SIGINT itself then (``become_rank`` re-raises it)
    except BaseException:  # noqa: BLE001 - an uncaught error: reported as Python reports it
        _report_uncaught(script_args[0])
        code = 1
    finally:
        sys.last_type = sys.last_value = sys.last_traceback = None
    return _finish(code, namespace)


def _report_uncaught(script: str) -> None:
    """The error being handled, said by ``sys.excepthook`` from the script's first frame on, as ``python
    script.py`` says it: this module's and runpy's frames, which started the script, are not the user's."""
    kind, error, whole = sys.exc_info()
    tb = whole
    while tb is not None and tb.tb_frame.f_code.co_filename != script:
        tb = tb.tb_next
    tb = tb if tb is not None or isinstance(error, SyntaxError) else whole  # none of the script's: keep all
    sys.excepthook(kind, error.with_traceback(tb), tb)


def as_a_fresh_interpreter(argv: list[str], env: dict[str, str], path0: str) -> None:
    """This forked child as ``python`` started afresh with ``argv`` and ``env`` would be, ``path0`` the first
    entry of its ``sys.path`` (a script's folder, links resolved, or the working folder under ``-m``); its
    stdout and stderr are whatever files 1 and 2 are now."""
    import io
    import logging
    import signal
    import warnings

    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = list(argv)
    sys.path[0] = path0
    for fd, name in ((1, "stdout"), (2, "stderr")):
        old = getattr(sys, name)
        setattr(sys, name, io.TextIOWrapper(
            io.FileIO(fd, "w", closefd=False), encoding=getattr(old, "encoding", None) or "utf-8",
            errors="backslashreplace" if name == "stderr" else getattr(old, "errors", None),
            line_buffering=False, write_through=True))
    _torch_threads(env)
    _numpy_seeded_afresh()
    if _before is not None:
        warnings.filters[:] = _before.filters
        warnings._filters_mutated()
        root = logging.getLogger()
        root.handlers[:] = _before.root_handlers
        root.setLevel(_before.root_level)
        sys.excepthook = _before.excepthook
        _only_these_exit_handlers(_before.exit_handlers)
    _customize_again()


def _only_these_exit_handlers(handlers: list[tuple]) -> None:
    """The agent's exit handlers are not the rank's: keep those the preloaded modules registered."""
    import atexit

    atexit._clear()
    for func, args, kwargs in handlers:
        atexit.register(func, *args, **kwargs)


def _customize_again() -> None:
    """Run ``sitecustomize`` and ``usercustomize`` again, now with the rank's environment, as a fresh
    interpreter runs them at its start (a customization that reads ``RANK`` sees it)."""
    import importlib

    for name in ("sitecustomize", "usercustomize"):
        if getattr(sys.modules.get(name), "__file__", None):
            _agents_customizations.append(sys.modules.pop(name))  # kept: its objects are the agent's
            try:
                importlib.import_module(name)
            except Exception as exc:  # as site.py says it at a fresh start
                print(f"Error in {name}; set PYTHONVERBOSE for traceback:\n{type(exc).__name__}: {exc}",
                      file=sys.stderr)


def _torch_threads(env: dict[str, str]) -> None:
    """torch sizes its thread pool once per process; the agent's was sized before torchrun set
    ``OMP_NUM_THREADS`` for the ranks, which a fresh rank's torch would have read."""
    torch = sys.modules.get("torch")
    try:
        threads = int(env.get("OMP_NUM_THREADS", ""))
    except ValueError:
        return
    if torch is not None and threads > 0:
        torch.set_num_threads(threads)


def _numpy_seeded_afresh() -> None:
    """numpy's global generator, seeded from the OS when the agent imported it, as a fresh rank's would be
    (Python's ``random`` reseeds itself after a fork; numpy's does not)."""
    random = sys.modules.get("numpy.random")
    if random is not None:
        random.seed()


def _exit_code(code) -> int:
    """``sys.exit(code)`` as the interpreter turns it into an exit status."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _finish(code: int, namespace: dict | None) -> int:
    """What Python does at exit, less the teardown of its modules: threads joined, exit handlers run, the
    script's objects released (files it left open are flushed and closed), output flushed."""
    import atexit
    import gc
    import threading

    try:
        threading._shutdown()
    except BaseException:  # noqa: BLE001 - a thread's error is its own; exit goes on as Python's does
        pass
    atexit._run_exitfuncs()
    if namespace is not None:
        namespace.clear()
    gc.collect()
    flush_standard_streams()
    return code
