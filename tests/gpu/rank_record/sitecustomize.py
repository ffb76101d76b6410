"""Test-only recorder: what each process of a job read, its losses, how its optimizers stepped, the files it wrote.

Python imports ``sitecustomize`` at start-up from the path. Two callers put this folder on ``PYTHONPATH``, each
with its own variables, and each reads the records it always read:

- ``tests/test_runnable_corpus.py``, ``tests/test_runnable_launched.py``: ``NBDDP_TEST_RECORD`` names the folder,
  ``NBDDP_TEST_RECORD_ROOT`` the notebook's folder. Every rank of a job (``RANK`` set by torchrun), or the one
  process running the notebook as written (``NBDDP_TEST_RECORD_AS=single``), or a process a launched command
  started that is no rank (``NBDDP_LAUNCHED_INNER`` without ``RANK``: ``launched``) writes
  ``<rank, single or launched>-<pid>.json`` at exit with every key below, and its ``WORLD_SIZE`` (``world``),
  whether a launched command started it (``inner``), its ``argv`` and when it began and ended (``began``,
  ``ended``); each loss is ``[optimizer, value]``, ``optimizer`` the newest optimizer's number.
- the GPU proofs (``tests/gpu/prove_unsloth.py``): ``NBDDP_PROOF_RECORD`` names the folder, ``NBDDP_PROOF_ROOT``
  the notebook's folder. Every rank writes ``rank<RANK>-<pid>.json`` with ``passes``, ``losses`` (the values
  alone) and ``writes``; the weights are not hashed at each step (a GPU copy per step).

What is recorded:

- ``passes``: each pass over a DataLoader of a sized data set: its length, the indices its sampler gave and
  the optimizer steps taken while it was the newest pass (0 for an evaluation or a peek at one batch);
- ``losses``: every scalar ``backward()`` (each micro-batch's loss), in order;
- ``optimizers``: per optimizer (in creation order) the steps taken and a hash of its parameters after the
  last step (the weights each replica ends with);
- ``devices``: each device a loss was on, once, a GPU's with its UUID (which card a rank used);
- ``writes``: files opened for writing under the notebook's folder, relative to it, with ``torch.save``'s and
  safetensors' files among them (the record's own folder left out).

Nothing of the notebook changes: the hooks only read, by plain function wrapping (standard library and torch
only: the GPU image has no ``wrapt``). torch and safetensors are imported here, in a process that records,
before the notebook's first line. Other processes (the nbddp CLI, torchrun's agent, an IPython shell that
launches a job) do nothing here.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import sys
import time


def _is_agent() -> bool:
    """torchrun's process (nbddp's agent, which a launched ``torchrun`` runs too): its ranks, forked from it, run
    this file again and record; hooks it installed itself would be theirs twice."""
    try:
        with open("/proc/self/cmdline", "rb") as f:
            return b"\0nbddp.agent\0" in f.read()
    except OSError:
        return False


if os.environ.get("NBDDP_TEST_RECORD"):
    FOLDER, ROOT_DIR = os.environ["NBDDP_TEST_RECORD"], os.environ.get("NBDDP_TEST_RECORD_ROOT")
    LABEL = (os.environ.get("NBDDP_TEST_RECORD_AS") or os.environ.get("RANK")
             or ("launched" if os.environ.get("NBDDP_LAUNCHED_INNER") and not _is_agent() else None))
    NAME, WHOLE = f"{LABEL}-{os.getpid()}.json", True
else:
    FOLDER, ROOT_DIR = os.environ.get("NBDDP_PROOF_RECORD"), os.environ.get("NBDDP_PROOF_ROOT")
    LABEL = os.environ.get("RANK")
    NAME, WHOLE = f"rank{LABEL}-{os.getpid()}.json", False
ROOT = os.path.realpath(ROOT_DIR or os.getcwd())

record: dict = {"passes": [], "losses": [], "optimizers": [], "writes": [], "world": os.environ.get("WORLD_SIZE"),
                "inner": bool(os.environ.get("NBDDP_LAUNCHED_INNER")), "began": time.time(), "devices": []}
_optimizers: list = []


def _written(path) -> None:
    try:
        full = os.path.realpath(os.fspath(path))
    except TypeError:  # a file descriptor or a buffer
        return
    if full.startswith(ROOT + os.sep) and not full.startswith(os.path.realpath(FOLDER) + os.sep):
        record["writes"].append(os.path.relpath(full, ROOT))


def _audit(event: str, args) -> None:
    if event != "open" or not args or not isinstance(args[0], (str, bytes, os.PathLike)):
        return
    mode, flags = args[1], args[2] if len(args) > 2 else 0
    writes = any(c in mode for c in "wax+") if isinstance(mode, str) else bool(flags & (os.O_WRONLY | os.O_RDWR))
    if writes:
        _written(args[0])


def _patch_loaders() -> None:
    from torch.utils.data import dataloader

    base = dataloader._BaseDataLoaderIter
    start, next_index = base.__init__, base._next_index

    def __init__(self, loader):
        start(self, loader)
        try:
            size = len(loader.dataset)
        except TypeError:  # an IterableDataset: no indices to count
            self._record = None
            return
        self._record = {"size": size, "indices": [], "steps": 0}
        record["passes"].append(self._record)

    def _next_index(self):
        index = next_index(self)
        if getattr(self, "_record", None) is not None:
            self._record["indices"] += index if isinstance(index, list) else [index]
        return index

    base.__init__, base._next_index = __init__, _next_index


def _device(torch, device) -> None:
    """The device a loss was on, with its GPU's UUID: the same ``cuda:0`` in two ranks that each see one GPU is
    two cards."""
    name = str(device)
    if device.type == "cuda":
        name += " " + str(torch.cuda.get_device_properties(device).uuid)
    if name not in record["devices"]:
        record["devices"].append(name)


def _patch_backward(torch) -> None:
    backward = torch.Tensor.backward

    def tensor_backward(self, *args, **kwargs):
        if self.numel() == 1:
            record["losses"].append([len(_optimizers) - 1, float(self.detach().float())])
            _device(torch, self.device)
        return backward(self, *args, **kwargs)

    torch.Tensor.backward = tensor_backward


def _patch_optimizers() -> None:
    from torch.optim import Optimizer
    from torch.optim.optimizer import register_optimizer_step_post_hook

    optimizer_init = Optimizer.__init__

    def init(self, params, *args, **kwargs):
        optimizer_init(self, params, *args, **kwargs)
        if not any(o is self for o, _ in _optimizers):
            entry = {"steps": 0, "hash": _hash(self) if WHOLE else None}
            _optimizers.append((self, entry))
            record["optimizers"].append(entry)

    Optimizer.__init__ = init

    def after_step(optimizer, args, kwargs):
        for known, entry in _optimizers:
            if known is optimizer:
                entry["steps"] += 1
                entry["hash"] = _hash(optimizer) if WHOLE else None
        if record["passes"]:
            record["passes"][-1]["steps"] += 1

    register_optimizer_step_post_hook(after_step)


def _hash(optimizer) -> str:
    import torch

    digest = hashlib.sha256()
    for group in optimizer.param_groups:
        for p in group["params"]:
            digest.update(p.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _patch_saves(torch) -> None:
    """``torch.save`` and safetensors' ``save_file`` open their files in C++, where the audit hook sees nothing."""
    save = torch.save

    def torch_save(obj, f, *args, **kwargs):
        _written(f)
        return save(obj, f, *args, **kwargs)

    torch.save = torch_save
    try:
        import safetensors.torch as module
    except ImportError:
        return
    save_file = module.save_file

    def saving(tensors, filename, *args, **kwargs):
        _written(filename)
        return save_file(tensors, filename, *args, **kwargs)

    module.save_file = saving


def _write() -> None:
    record.update(ended=time.time(), argv=sys.argv)
    os.makedirs(FOLDER, exist_ok=True)
    path = os.path.join(FOLDER, NAME)
    kept = record if WHOLE else {"passes": record["passes"], "losses": [v for _, v in record["losses"]],
                                 "writes": record["writes"], "devices": record["devices"]}
    with open(path + ".tmp", "w") as fh:
        json.dump(kept, fh)
    os.replace(path + ".tmp", path)


if FOLDER and LABEL:
    import torch

    _patch_loaders()
    _patch_backward(torch)
    _patch_optimizers()
    _patch_saves(torch)
    sys.addaudithook(_audit)
    atexit.register(_write)
