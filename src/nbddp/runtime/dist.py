"""The rank helpers the generated script calls: where this rank sits, its device, its share of the data, DDP.

Where the rank sits is kept by ``rank`` (and passed on from here, as the script reaches it). Imported by the
generated script in every rank; nothing here imports IPython, nbformat or libcst.
"""

from __future__ import annotations

import contextlib
import os
import functools

from . import settings
from . import rank
from .rank import (  # noqa: F401 (the script's and the runtime's names for where the rank sits)
    RankInfo,
    env_int,
    is_local_main_process,
    rank_info,
    remember,
    remembered,
)


#: The seed every rank starts from unless ``NBDDP_SEED`` says otherwise.
DEFAULT_SEED = 0


def seed_everything(seed: int | str | None = None) -> int | None:
    """Seed Python's, NumPy's and torch's generators (every GPU's too) with the same value on every rank.

    ``seed`` defaults to ``NBDDP_SEED``, else ``DEFAULT_SEED``; "off" leaves them alone and returns None.
    A script that seeds itself later (``set_seed``, the Trainer's ``seed``) simply overrides this.
    """
    import random

    import torch

    if seed is None:
        seed = settings.current().seed  # NBDDP_SEED
    value = str(DEFAULT_SEED if seed is None else seed).strip().lower()
    if value in ("off", "none", ""):
        return None
    try:
        number = int(value)
    except ValueError:
        raise ValueError(f"NBDDP_SEED must be a whole number or 'off', not {value!r}") from None
    random.seed(number)
    torch.manual_seed(number)
    with contextlib.suppress(ImportError):
        import numpy

        numpy.random.seed(number % 2**32)
    return number


def is_main_process() -> bool:
    """True on global rank 0 (and in a plain single process)."""
    return rank.is_main_process()


def on_rank0() -> bool:
    """The rank-0 guard the converter writes (``if _nbddp.on_rank0():``), which every rank reaches: True on global
    rank 0. Under FSDP every rank first gathers the plain loop's sharded models whose weights changed, so the
    code rank 0 then runs alone saves whole weights (``apply_strategy.gather_for_rank0_code``): a collective, so only
    at a guard every rank reaches, never from ``is_main_process``, which any code may ask on rank 0 alone."""
    from . import apply_strategy

    if apply_strategy.current() == "fsdp":
        apply_strategy.gather_for_rank0_code()
    return rank.is_main_process()


@contextlib.contextmanager
def main_process_first(local: bool = True):
    """Let rank 0 (of the node, by default) run the block first, the others after it: for caches and downloads."""
    import torch.distributed as dist

    from .sync import wait_for_every_rank

    first = is_local_main_process() if local else is_main_process()
    grouped = dist.is_available() and dist.is_initialized()
    if grouped and not first:
        wait_for_every_rank(rank_info().device)
    try:
        yield
    finally:
        if grouped and first:
            wait_for_every_rank(rank_info().device)


def barrier() -> None:
    """Every rank waits here for the others (after rank 0 wrote files they read); alone, a no-op.

    What the script calls as ``_nbddp.barrier()``: ``sync.wait_for_every_rank``, not ``dist.barrier()``,
    for the reasons ``sync`` gives.
    """
    import torch.distributed as dist

    from .sync import wait_for_every_rank

    if dist.is_available() and dist.is_initialized():
        wait_for_every_rank(rank_info().device)


def device_map() -> dict | str | None:
    """A ``from_pretrained`` device map putting the whole model on this rank's device; ``"balanced"``
    (accelerate spreads the layers over every GPU) when the job runs split (``NBDDP_STRATEGY=split``);
    None under FSDP: a 16-bit model loads on the CPU and ``fully_shard`` moves each rank's shards to its GPU
    (a whole replica on the GPU first is what does not fit), a 4-bit one onto this rank's GPU, where
    bitsandbytes quantizes it."""
    from . import apply_strategy

    if apply_strategy.current() in ("split", "fsdp"):
        return "balanced" if apply_strategy.current() == "split" else None
    info = rank_info()
    return {"": info.local_rank} if info.device.startswith("cuda") else {"": "cpu"}


def device():
    """This rank's ``torch.device``: ``cuda:<local rank>`` with GPUs, else the CPU (for ``"cuda:0"`` in a notebook)."""
    import torch

    return torch.device(rank_info().device)


def ddp(model):
    """Wrap a model placed on this rank's device in ``DistributedDataParallel`` (once; alone, it stays as it is).

    The wrapper passes attribute lookups it cannot answer on to the model, and sets the model's own plain
    attributes on the model, so the notebook's code keeps working after the wrap (``model.head.parameters()``,
    ``model.config``, its own methods, ``net.output_type = ["loss"]`` read by its forward). DDP looks for
    parameters a step leaves out unless the model is a PEFT adapter (``looks_for_unused``). Under
    ``NBDDP_STRATEGY=fsdp`` the model is sharded with FSDP2's ``fully_shard`` instead (``apply_strategy.shard``).
    """
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from . import apply_strategy

    if isinstance(model, DistributedDataParallel) or not (dist.is_available() and dist.is_initialized()):
        return model
    if apply_strategy.current() == "fsdp":
        return apply_strategy.shard(_without_inner_wrappers(model))
    info = rank_info()
    ids = [info.local_rank] if info.device.startswith("cuda") else None
    inner = _without_inner_wrappers(model)
    return _notebook_ddp()(inner, device_ids=ids, find_unused_parameters=looks_for_unused(inner))


def looks_for_unused(model) -> bool:
    """Whether DDP looks for parameters a step leaves out, as the HF Trainer decides for its own wrap: not for
    a PEFT adapter (every adapter weight takes part in each step: the search would only cost a walk of the
    graph per step), yes for any other model, which may leave a pooler, an unused head or a dropped layer
    out (without the search the second step stops). ``NBDDP_FIND_UNUSED_PARAMETERS=0|1`` decides instead."""
    forced = settings.current().find_unused_parameters  # NBDDP_FIND_UNUSED_PARAMETERS
    if forced is not None:
        return forced
    if hasattr(model, "peft_config") or getattr(model, "_hf_peft_config_loaded", False):
        return False
    rank.say("nbddp: DDP looks for parameters a training step leaves out (the model is not a PEFT adapter: it "
             "may skip a pooler, a head or a layer); NBDDP_FIND_UNUSED_PARAMETERS=0 saves that search where every "
             "weight trains in each step", once="ddp: find unused")
    return True


def _without_inner_wrappers(model):
    """A model built on a wrapped one (``get_peft_model(ddp_model, …)``) holds the first wrapper inside: it
    gets the plain module back in its place, so the new wrapper alone syncs the gradients (the old one, no
    longer run forward, expects none)."""
    from torch.nn.parallel import DistributedDataParallel

    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, DistributedDataParallel):
                setattr(parent, name, child.module)
    return model


@functools.cache
def _notebook_ddp():
    from torch.nn.parallel import DistributedDataParallel

    class NotebookDDP(DistributedDataParallel):
        """``DistributedDataParallel`` that falls back to the wrapped model's attributes."""

        def __getattr__(self, name):
            try:
                return super().__getattr__(name)
            except AttributeError:
                inner = self.__dict__.get("_modules", {}).get("module")
                if inner is None or name == "module":
                    raise
                return getattr(inner, name)

        def __setattr__(self, name, value):
            """``net.output_type = ["loss"]`` after the wrap sets the model's own attribute, which its forward
            reads (set on the wrapper, the model never saw it: a Kaggle loop failed with KeyError). Only a plain
            attribute the model has and the wrapper does not: DDP's own, and names new to both, stay DDP's."""
            inner = self.__dict__.get("_modules", {}).get("module")
            if inner is not None and name in inner.__dict__ and name not in self.__dict__ \
                    and not hasattr(type(self), name):
                setattr(inner, name, value)
            else:
                super().__setattr__(name, value)

        def __getitem__(self, index):
            """``model[0]`` of an ``nn.Sequential``/``ModuleList`` the notebook indexes after the wrap."""
            return self.module[index]

        def __len__(self):
            return len(self.module)

        def __bool__(self):  # a module is true, whether or not it has a length
            return True

        def __iter__(self):
            return iter(self.module)

        def __deepcopy__(self, memo):
            """``copy.deepcopy(model)`` in the notebook copies its model: the wrapper is nbddp's, and a copy
            of it would name every weight ``module.…`` (and hold a second reducer on the job's group)."""
            import copy

            return copy.deepcopy(self.module, memo)

    return NotebookDDP


#: What a DDP wrapper standing for a notebook's model holds when ``unwrap`` should give back something else than its
#: ``.module`` (a function returning it; ``data_parallel.py`` sets it for a notebook's DataParallel).
UNWRAPPED = "_nbddp_unwrapped"


def unwrap(model):
    """The module inside a ``DistributedDataParallel`` wrapper (``.module``), or the model itself; a wrapper that
    says how the notebook had its model (``_nbddp_unwrapped``: a DataParallel, ``data_parallel.py``) gives that."""
    from torch.nn.parallel import DistributedDataParallel

    as_the_notebook_had_it = getattr(model, "__dict__", {}).get(UNWRAPPED)
    if as_the_notebook_had_it is not None:
        return as_the_notebook_had_it()
    return model.module if isinstance(model, DistributedDataParallel) else model


def distributed_sampler(dataset, shuffle: bool = False):
    """A ``DistributedSampler`` giving this rank its own share of ``dataset`` (all of it in a single process);
    token-balanced when shuffled and lengths vary (``balance``; ``NBDDP_BALANCE=0``: off)."""
    from .balance import sampler_for

    info = rank_info()
    return sampler_for(dataset, num_replicas=info.world_size, rank=info.rank, shuffle=bool(shuffle))


def set_epoch(loader, epoch: int) -> None:
    """Reshuffle a loader's ``DistributedSampler`` for this epoch; a no-op for any other loader."""
    sampler = getattr(loader, "sampler", None)
    if hasattr(sampler, "set_epoch"):
        sampler.set_epoch(epoch)


def print0(*args, **kwargs) -> None:
    """``print`` on rank 0 only."""
    if is_main_process():
        print(*args, **kwargs)




def rank0_only(func):
    """``func`` itself on rank 0 (and alone); on the other ranks a stand-in whose result takes any call, attribute
    or ``with`` and does nothing: a ``SummaryWriter`` or an MLflow run the kernel had once is made once, and the
    notebook's ``writer.add_scalar(…)`` runs on every rank unchanged."""
    if is_main_process():
        return func
    return _writer_stand_in if getattr(func, "__name__", None) == "SummaryWriter" else _Silent()


def _writer_stand_in(log_dir=None, *args, logdir=None, **kwargs):
    """A ``SummaryWriter`` off rank 0: its folder made, as the kernel's writer left it (a later cell may look in
    it: ``os.walk(log_dir)`` for checkpoints), and nothing written there."""
    folder = log_dir if log_dir is not None else logdir  # torch's log_dir, tensorboardX's logdir
    if folder is not None:
        os.makedirs(folder, exist_ok=True)
    return _Silent()


def rank0_mode(mode: str | None = None) -> str | None:
    """``wandb.init``'s ``mode``: the notebook's own on rank 0, ``"disabled"`` on the others, so one W&B run is
    made (as in the kernel) and ``wandb.log`` on the other ranks does nothing instead of raising."""
    return mode if is_main_process() else "disabled"


class _Silent:
    """What ``rank0_only`` gives the other ranks: every attribute and call is another one, and does nothing."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Silent()

    def __call__(self, *args, **kwargs):
        return _Silent()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def __iter__(self):
        return iter(())

    def __repr__(self):
        return "<nbddp: made on rank 0 only>"
