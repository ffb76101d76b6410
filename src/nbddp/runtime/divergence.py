"""The safety net: replicas that drift apart stop the job; training data that is not sharded is reported.

Static rewriting meets code it cannot see (a model built by a helper, a loop the facts did not recognise).
Such code trains without gradient sync: each rank's copy learns from its own share of the data and rank 0
saves a model that saw half of it, with rc 0. So every rank checks, when an optimizer steps (the first
step, then every N steps), that the parameters it updates are either managed by a DDP/FSDP wrapper or
identical on every rank: one small all-reduce (MAX) of each unmanaged tensor's norm and its negation. N is
chosen from the measured cost of a check and of a step so that checking takes at most ``BUDGET`` of the
training time, and the ranks agree on it through the same all-reduce (they must all enter it at the same
step). When replicas differ, every rank raises the same ``ReplicasDiverged`` from inside
``optimizer.step()``: the message names the optimizer's cell and line, the model and the fix; the launcher
maps the traceback to the cell as for any error.

The first check also compares the last batch a ``DataLoader`` gave before that step: the same batch on every
rank means the training data is not sharded (each rank reads all of it); that is said once, on rank 0, where
no DDP model ran: a DDP model's first training forwards are compared instead, and the same inputs on two ranks
stop the job (``same_batches``).

``NBDDP_ALLOW_DIVERGENCE=1`` turns the net off, for notebooks whose ranks are meant to train apart. DeepSpeed
partitions an optimizer's tensors by rank, so with DeepSpeed imported the parameter check stays off.
"""

from __future__ import annotations

import math
import sys
import time
import weakref

from . import same_batches, settings
from .net import collective_device as _device, script_place as _where, tensors as _tensors

#: Environment variable that turns the checks off (intended per-rank work).
ALLOW_ENV = "NBDDP_ALLOW_DIVERGENCE"
#: The share of training time the checks may take.
BUDGET = 0.01
#: Checks are at least this many steps apart after the first, and at most this many.
MIN_INTERVAL, MAX_INTERVAL = 10, 10_000
#: Relative difference of a tensor's norm between ranks that counts as divergence.
TOLERANCE = 1e-6


class ReplicasDiverged(RuntimeError):
    """The parameters an optimizer updates differ between ranks: training is not synchronised."""


#: Parameters a DDP or FSDP wrapper keeps in sync (their gradients are averaged in backward), by ``id``
#: (a tensor's ``==`` compares values, so tensors go in no set).
_managed: dict[int, weakref.ref] = {}
_installed = False
#: The last batch a DataLoader gave (a reference, dropped after the first check), and whether to keep taking it.
_last_batch: list = []
_data_checked = False


class _OptimizerState:
    """Per optimizer: steps taken, the next step to check, and timing for the interval."""

    def __init__(self):
        self.steps = 0
        self.next_check = 1
        self.since = time.perf_counter()  # when the steps since the last check began
        self.steps_since = 0
        self.check_s = 0.0  # what the last check cost


_states: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def allowed() -> bool:
    return settings.current().allow_divergence is True  # ALLOW_ENV


def install() -> bool:
    """Arm the checks in this rank (``setup()`` calls it once the process group is up); False when off."""
    global _installed
    import torch.distributed as dist

    if _installed or allowed() or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return False
    from torch.optim.optimizer import register_optimizer_step_post_hook

    from . import ddp_patch

    ddp_patch.register_hook("divergence", _remember_managed)
    register_optimizer_step_post_hook(_after_step)
    _watch_batches()
    _installed = True
    return True


#: ``id`` of each DDP wrapper whose forward has run: only then does its backward average the gradients. A
#: wrapper whose model's parts are called directly (``model.mask_decoder(x)`` past the wrapper) never runs, and
#: its parameters count as unmanaged, so the check sees the copies drift instead of trusting the wrapper.
_forward_ran: set[int] = set()


def _remember_managed(wrapper) -> None:
    ref = weakref.ref(wrapper)
    for param in wrapper.module.parameters():
        _managed[id(param)] = (weakref.ref(param), ref)
    wrapper.register_forward_pre_hook(lambda module, args: _forward_ran.add(id(module)))
    same_batches.watch(wrapper)  # ranks reading the same samples stop after the first steps


def _is_managed(param) -> bool:
    refs = _managed.get(id(param))
    if refs is None or refs[0]() is not param:
        return False
    wrapper = refs[1]()
    return wrapper is not None and id(wrapper) in _forward_ran


def _bypassed(params: list) -> bool:
    """Whether some of ``params`` sit in a DDP wrapper whose forward never ran (its parts called directly)."""
    return any((refs := _managed.get(id(p))) is not None and refs[0]() is p for p in params)


def _watch_batches() -> None:
    """Keep a reference to each batch a DataLoader gives until the first check has compared one."""
    from torch.utils.data import dataloader

    cls = dataloader._BaseDataLoaderIter
    original = cls.__next__

    def __next__(self):
        batch = original(self)
        if not _data_checked:
            _last_batch[:] = [batch]
        return batch

    __next__._nbddp_original = original
    cls.__next__ = __next__


def _stop_watching_batches() -> None:
    from torch.utils.data import dataloader

    cls = dataloader._BaseDataLoaderIter
    original = getattr(cls.__next__, "_nbddp_original", None)
    if original is not None:
        cls.__next__ = original
    _last_batch.clear()


# ------------------------------------------------------------------------------------------ the check


def _after_step(optimizer, args, kwargs) -> None:
    state = _states.get(optimizer)
    if state is None:
        state = _states[optimizer] = _OptimizerState()
    state.steps += 1
    state.steps_since += 1
    if state.steps < state.next_check:
        return
    unmanaged = _unmanaged(optimizer)
    if state.steps > 1 and not unmanaged:
        state.next_check = math.inf  # every tensor it updates is synchronised by a wrapper
        return
    started = time.perf_counter()
    step_s = (started - state.since) / state.steps_since if state.steps > 1 else 0.0
    interval = check(optimizer, unmanaged, state.steps, _interval(state.check_s, step_s))
    state.check_s = time.perf_counter() - started
    state.next_check = state.steps + interval
    state.since, state.steps_since = time.perf_counter(), 0


def _interval(check_s: float, step_s: float) -> int:
    """Steps between checks so that a check costs at most ``BUDGET`` of the steps' time."""
    if step_s <= 0:
        return MIN_INTERVAL
    return int(min(MAX_INTERVAL, max(MIN_INTERVAL, math.ceil(check_s / (BUDGET * step_s)))))


def _unmanaged(optimizer) -> list:
    """The tensors an optimizer updates that no DDP/FSDP wrapper keeps in sync (sharded ones excluded)."""
    if "deepspeed" in sys.modules:
        return []
    return [p for group in optimizer.param_groups for p in group["params"] if not _is_managed(p) and not _sharded(p)]


def _sharded(param) -> bool:
    """FSDP's flat parameters and DTensors hold each rank's own shard: they differ by design."""
    kind = type(param).__name__
    return kind in ("FlatParameter", "DTensor") or hasattr(param, "_local_tensor") or hasattr(param, "ds_id")


def check(optimizer, unmanaged: list, step: int, proposal: int) -> int:
    """One all-reduce over the ranks: the norms of ``unmanaged``, the data's last batch and each rank's
    proposed interval. Raises ``ReplicasDiverged`` when the norms differ; returns the agreed interval."""
    global _data_checked
    import torch
    import torch.distributed as dist

    with torch.no_grad():
        norms = (torch.stack(torch._foreach_norm([p.detach().float() for p in unmanaged])).double().cpu()
                 if unmanaged else torch.zeros(0, dtype=torch.float64))
    batch = None if _data_checked else _batch_checksum()
    extra = [batch or 0.0, -(batch or 0.0), 0.0 if batch is not None else 1.0, float(proposal)]
    values = torch.cat([norms, -norms, torch.tensor(extra, dtype=torch.float64)]).to(_device())
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    values = values.cpu().tolist()
    n = len(norms)
    high, low = values[:n], [-v for v in values[n : 2 * n]]
    batch_max, minus_batch_min, some_without_batch, interval = values[2 * n :]
    if not _data_checked:
        _data_checked = True
        _stop_watching_batches()
        if not some_without_batch and batch_max == -minus_batch_min and not _forward_ran:
            _say_data_not_sharded()  # a DDP model's first forwards are compared instead (``same_batches``)
    differ = [p for p, a, b in zip(unmanaged, high, low) if not _close(a, b)]
    if differ:
        raise ReplicasDiverged(_divergence_message(differ, len(unmanaged), step))
    return max(int(interval), MIN_INTERVAL)


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= TOLERANCE * max(abs(a), abs(b), 1e-12)


def _batch_checksum() -> float | None:
    """A number that differs between two different batches (almost surely): sums of the batch's tensors."""
    import torch

    if not _last_batch:
        return None
    tensors = list(_tensors(_last_batch[0]))
    if not tensors:
        return None
    total = 0.0
    for k, t in enumerate(tensors, start=1):
        flat = t.detach().flatten()
        flat = (flat.abs() if flat.is_complex() else flat).double()
        position = torch.arange(len(flat), dtype=torch.float64, device=flat.device) % 7 + 1  # order counts
        total += k * float((flat * position).sum())
    return total


# ---------------------------------------------------------------------------------------- messages


def _say_data_not_sharded() -> None:
    from .rank import say

    where = _where()
    say(
        "nbddp: warning: the training batches are the same on every rank"
        + (f" (optimizer step at {where})" if where else "")
        + ": each rank reads the whole data set, so the ranks repeat each other's work. Give the training "
        "DataLoader sampler=_nbddp.distributed_sampler(dataset, shuffle=True), or build it with "
        "DataLoader(dataset, shuffle=True) so nbddp shards it.",
        once="divergence: data not sharded",
    )


def _divergence_message(params: list, total: int, step: int) -> str:
    where = _where()
    model, names = _owner(params)
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    return (
        f"nbddp: the ranks' copies of {model or 'the model'} diverged after optimizer step {step}"
        + (f" ({where})" if where else "")
        + f": {len(params)} of the {total} tensors this optimizer updates differ between ranks ({shown}). "
        + (_bypassed_fix(model) if _bypassed(params) else
           "They are not in a DistributedDataParallel wrapper, so each rank trains its own copy on its own share "
           "of the data and no rank holds the trained model. Fix: wrap the model before its optimizer steps ("
           + (f"{model} = _nbddp.ddp({model})" if model else "model = _nbddp.ddp(model)")
           + ", or train it with a Trainer/Accelerate).")
        + f" If each rank is meant to train its own copy, run with {ALLOW_ENV}=1 (--allow-divergence)."
    )


def _bypassed_fix(model: str | None) -> str:
    name = model or "model"
    return (f"{name} is in a DistributedDataParallel wrapper, but the training calls its parts directly "
            f"({name}.part(…)) and never {name}(…) itself, so the wrapper never runs and no gradient is averaged. "
            f"Fix: call {name}(…) in the training step, or call the part the optimizer trains by its name in the "
            f"training's own code ({name}.part(…), {name} not handed to a function), where nbddp wraps that part "
            f"instead; by hand: part_ddp = _nbddp.ddp(_nbddp.unwrap({name}).part), then part_ddp(…) in the step.")


def _owner(params: list) -> tuple[str | None, list[str]]:
    """The notebook's name for the model holding ``params`` (a module in the script's globals), and the
    parameters' names in it."""
    import torch

    wanted = {id(p) for p in params}
    main = sys.modules.get("__main__")
    best = None
    for name, value in list(vars(main).items() if main else ()):
        if name.startswith("_") or not isinstance(value, torch.nn.Module):
            continue
        names = [n for n, p in value.named_parameters() if id(p) in wanted]
        if names and (best is None or len(names) >= len(best[1])):  # ties: the name bound last
            best = (name, names)
    return best if best else (None, [f"tensor of shape {tuple(p.shape)}" for p in params])
