"""Wait for every rank in a way that cannot abort the process when it exits.

Why not ``dist.barrier()``: a rank whose work was done used to abort at interpreter exit ("terminate called
without an active exception", SIGABRT), about one job in twenty with DDP wrappers at module level and gloo.
A core dump of it shows the chain:

1. Every collective's work snapshots the thread-local state of the thread that starts it
   (``at::ThreadLocalState``), Python objects included: torch-function and dispatch modes (an active
   ``torch.set_default_device``), and the ``contextvars`` context that torch's autograd engine keeps in
   thread-local storage during every backward (so the all-reduces DDP's reducer starts there hold one).
2. gloo's ``barrier`` keeps weak references to every work still queued or in progress, and a c10 object is
   deleted when its last weak reference goes: the barrier's work can end up deleting an earlier all-reduce.
3. The main thread returns from the barrier as soon as the work is marked complete; the gloo worker thread
   drops the work a moment later. When the main thread has reached interpreter finalisation by then, freeing
   the snapshot's Python object needs the GIL, Python ends a thread asking for the GIL during finalisation
   (``pthread_exit``), and that unwinding through a ``noexcept`` destructor calls ``std::terminate``.

The same end comes from the all-reduce's own tensor: a tensor made in Python has a Python object, and in
torch 2.13 a worker thread dropping the last C++ reference but one calls ``decref_pyobject``, which needs
the GIL. Seen in a core dump too, with the main thread in ``Py_FinalizeEx`` deallocating the process group.

So the ranks wait for each other with an all-reduce (no weak references to earlier works) started with no
Python object in the thread-local state, and then, GIL released, until gloo's worker has let go of the
all-reduce's tensor: its Python reference count is back where it was (the C++ side holds one Python
reference while it holds the tensor). The worker that ran it has then finished every work before it too.
"""

from __future__ import annotations

import contextlib
import sys
import time

#: The key under which torch's autograd engine keeps the ``contextvars`` context during a backward.
_AUTOGRAD_CONTEXT_KEY = "context"
#: The longest a rank waits for gloo's worker to let go of the all-reduce's tensor (normally microseconds).
_RELEASE_WAIT_S = 5.0
#: How long the process group's threads get, GIL released, after it is destroyed.
_SETTLE_S = 0.02


@contextlib.contextmanager
def no_python_thread_state():
    """Inside: this thread's torch-function and dispatch modes and torch's stashed objects set aside.

    A collective started inside snapshots no Python object, so whichever thread frees its work needs no GIL.
    Everything set aside is restored in order on the way out.
    """
    import torch

    c = torch._C
    function_modes = _pop_all(getattr(c, "_len_torch_function_stack", None), getattr(c, "_pop_torch_function_stack", None))
    dispatch_modes = _pop_all(getattr(c, "_len_torch_dispatch_stack", None), getattr(c, "_pop_torch_dispatch_stack", None))
    stashed = None
    if hasattr(c, "_is_key_in_tls") and c._is_key_in_tls(_AUTOGRAD_CONTEXT_KEY):
        stashed = c._get_obj_in_tls(_AUTOGRAD_CONTEXT_KEY)
        c._remove_obj_from_tls(_AUTOGRAD_CONTEXT_KEY)
    try:
        yield
    finally:
        if stashed is not None:
            c._stash_obj_in_tls(_AUTOGRAD_CONTEXT_KEY, stashed)
        for mode in reversed(dispatch_modes):
            c._push_on_torch_dispatch_stack(mode)
        for mode in reversed(function_modes):
            c._push_on_torch_function_stack(mode)


def _pop_all(length, pop) -> list:
    """Pop a mode stack empty; the modes come back innermost first."""
    popped = []
    if length is None or pop is None:  # a torch without this stack
        return popped
    while length():
        popped.append(pop())
    return popped


def wait_for_every_rank(device: str) -> None:
    """Block until every rank of the default process group gets here (the ``dist.barrier()`` of nbddp)."""
    import torch
    import torch.distributed as dist

    token = torch.zeros(1, device=device)
    unheld = sys.getrefcount(token)  # measured and compared in this frame: an argument would add one
    with no_python_thread_state():
        dist.all_reduce(token)
    if dist.get_backend() != "gloo":
        return
    deadline = time.monotonic() + _RELEASE_WAIT_S
    while sys.getrefcount(token) > unheld and time.monotonic() < deadline:
        time.sleep(0.0005)  # releases the GIL, which the worker needs to let go of the token


def settle_workers() -> None:
    """Let the process group's worker threads drop their last works while the interpreter is alive."""
    time.sleep(_SETTLE_S)

