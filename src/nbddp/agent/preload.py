"""What torchrun's process imports once for the ranks it forks (``forked_ranks``), and why no more.

Only what a rank would import reading the same settings: what ``setup()`` imports before the notebook's first
line (``PRELOAD``), and torch's parts the script's ranks import later, unless the script sets a ``TORCH*``
variable that import would read (``LATER``, ``preload_for``, a stdlib ``ast`` read of the script: the agent
imports no converter). Never a notebook's own libraries: transformers or peft imported before the rank's
``setup()`` would bind functions nbddp's shims replace after it (the save shim's ``save_file``), and Unsloth
must come before them. ``load`` notes the exit handlers the imports register: a rank keeps those, and only
those, of the agent's.

On a machine with GPUs, nothing whose import initializes CUDA's driver (``INITIALIZES_CUDA``): a process forked
after that cannot use CUDA, and the ranks are forked from the agent's imports.
"""

from __future__ import annotations

#: What a rank imports in ``setup()``, before the notebook's first line: imported once in the agent.
PRELOAD = ("torch", "torch.distributed", "nbddp.runtime")
#: torch's parts a rank imports later and reads ``TORCH*`` settings of at import: ``torch._dynamo`` at the first
#: optimizer step, ``torch._inductor`` with bitsandbytes (peft, trl, transformers' Trainer). Preloaded only for
#: a script that sets no such variable itself (``preload_for``), which a later import in a fresh rank would read.
LATER = (("torch._dynamo", ()), ("torch._inductor.compile_fx", ("transformers", "peft", "trl", "bitsandbytes")))
#: Of ``LATER``, the imports that initialize CUDA's driver on a machine with GPUs (``torch._inductor`` asks the
#: devices as it is imported: seen on a 2× H200 host, ``benchmarks/results/gpu/forked_ranks.md``). There each rank
#: imports them itself.
INITIALIZES_CUDA = ("torch._inductor.compile_fx",)


def training_script(torchrun_argv: list[str]) -> str | None:
    """The script of torchrun's command line, as torchrun's own parser reads it."""
    try:
        from torch.distributed.run import get_args_parser

        return get_args_parser().parse_args(torchrun_argv).training_script
    except (ImportError, SystemExit, AttributeError):
        return None


def preload_for(script: str | None, gpus: bool | None = None) -> tuple[str, ...]:
    """Of ``LATER``, what this script's ranks would import with the settings the agent has: nothing where the
    script sets a ``TORCH*`` variable (or one whose name is not written out), or cannot be read; with ``gpus``
    (by default: whether this machine has them), none of ``INITIALIZES_CUDA``."""
    import ast

    try:
        with open(script or "", encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return ()
    imported, sets_torch = set(), False
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            imported.add(node.module.split(".")[0])
        elif _sets_environment(node):
            sets_torch = sets_torch or _names_torch(node)
    if sets_torch:
        return ()
    if gpus is None:
        from ..gpus import has_gpu_driver

        gpus = has_gpu_driver()
    leave = INITIALIZES_CUDA if gpus else ()
    return tuple(name for name, needs in LATER if (not needs or imported & set(needs)) and name not in leave)


def _sets_environment(node) -> bool:
    """``os.environ[k] = …`` (``%env``), ``os.environ |= …``, ``os.environ.update/setdefault(…)``, ``os.putenv(…)``."""
    import ast

    if isinstance(node, (ast.Assign, ast.AugAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        return any((isinstance(t, ast.Subscript) and _is_environ(t.value)) or _is_environ(t) for t in targets)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        return (node.func.attr in ("update", "setdefault", "__setitem__") and _is_environ(node.func.value)) or \
            node.func.attr == "putenv"
    return False


def _is_environ(node) -> bool:
    import ast

    return (isinstance(node, ast.Attribute) and node.attr == "environ") or \
        (isinstance(node, ast.Name) and node.id == "environ")


def _names_torch(node) -> bool:
    """Whether a setting of the environment may name a ``TORCH*`` variable: any key not written out counts."""
    import ast

    if isinstance(node, (ast.Assign, ast.AugAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        keys = [t.slice if isinstance(t, ast.Subscript) else None for t in targets]  # ``os.environ |= d``: unknown
    else:  # a call: its first argument (a dict's keys, or the name), then its keywords (``**d``: unknown)
        first = node.args[:1]
        keys = list(first[0].keys) if first and isinstance(first[0], ast.Dict) else list(first)
        keys += [ast.Constant(k.arg) if k.arg else None for k in node.keywords]
        keys = keys or [None]
    return any(not (isinstance(k, ast.Constant) and isinstance(k.value, str)) or _torch_name(k.value) for k in keys)


def _torch_name(name: str) -> bool:
    return name.upper().startswith(("TORCH", "PYTORCH"))


#: The exit handlers each module ``load`` imported registered, by name: a process forked from one that loaded
#: them (an agent from a warm start, ``agent/warm.py``) asks again and gets the same answer without an import.
_REGISTERED: dict[str, list[tuple]] = {}


def load(names) -> list[tuple]:
    """Import ``names``; the exit handlers their imports registered (a rank must have those, and only those,
    of the agent's), also for those this process loaded before."""
    import atexit
    import importlib

    registered: list[tuple] = []
    register = atexit.register

    def recording(func, *args, **kwargs):
        if recording.into is not None:
            recording.into.append((func, args, kwargs))
        return register(func, *args, **kwargs)

    recording.into = None
    atexit.register = recording
    try:
        for name in names:
            if name not in _REGISTERED:
                recording.into = _REGISTERED[name] = []
                try:
                    importlib.import_module(name)
                except Exception:  # a broken optional part: the rank meets it itself, as before
                    pass
                recording.into = None
            registered += _REGISTERED[name]
    finally:
        recording.into = None
        atexit.register = register
    return registered
