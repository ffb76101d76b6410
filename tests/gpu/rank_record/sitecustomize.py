"""Recorder for the GPU proofs: what each rank of a job read, its losses, and the files it wrote.

``prove_unsloth.py`` puts this folder first on ``PYTHONPATH`` with ``NBDDP_PROOF_RECORD`` naming a folder.
Python imports ``sitecustomize`` at start-up, so every rank (``RANK`` set by torchrun) writes
``rank<RANK>-<pid>.json`` there at exit:

- ``passes``: each pass over a DataLoader of a sized data set: its length and the indices its sampler gave;
- ``losses``: the value of every scalar ``backward()`` (each micro-batch's loss), in order;
- ``writes``: files opened for writing, or written by ``safetensors.torch.save_file``, under
  ``NBDDP_PROOF_ROOT`` (the notebook's folder), relative to it.

The hooks only read; the notebook is not changed. Processes that are not ranks (the launcher, torchrun's
agent, the IPython shell) record nothing. Standard library and torch only (no ``wrapt`` on the GPU image):
torch and safetensors are imported here, in each rank, before the notebook's first line.
"""

from __future__ import annotations

import atexit
import json
import os
import sys

FOLDER = os.environ.get("NBDDP_PROOF_RECORD")
RANK = os.environ.get("RANK")
ROOT = os.path.realpath(os.environ.get("NBDDP_PROOF_ROOT") or os.getcwd())
record: dict = {"passes": [], "losses": [], "writes": []}


def _written(path) -> None:
    try:
        full = os.path.realpath(os.fspath(path))
    except TypeError:  # a file descriptor or a buffer
        return
    if full.startswith(ROOT + os.sep):
        record["writes"].append(os.path.relpath(full, ROOT))


def _audit(event: str, args) -> None:
    if event != "open" or not args or not isinstance(args[0], (str, bytes, os.PathLike)):
        return
    mode, flags = args[1], args[2] if len(args) > 2 else 0
    if any(c in mode for c in "wax+") if isinstance(mode, str) else bool(flags & (os.O_WRONLY | os.O_RDWR)):
        _written(args[0])


def _patch_torch() -> None:
    import torch
    from torch.utils.data import dataloader

    base = dataloader._BaseDataLoaderIter
    start, next_index = base.__init__, base._next_index

    def __init__(self, loader):
        start(self, loader)
        try:
            size = len(loader.dataset)
        except TypeError:  # an IterableDataset: no indices to count
            self._proof_pass = None
            return
        self._proof_pass = {"size": size, "indices": []}
        record["passes"].append(self._proof_pass)

    def _next_index(self):
        index = next_index(self)
        if getattr(self, "_proof_pass", None) is not None:
            self._proof_pass["indices"] += index if isinstance(index, list) else [index]
        return index

    base.__init__, base._next_index = __init__, _next_index
    backward = torch.Tensor.backward

    def tensor_backward(self, *args, **kwargs):
        if self.numel() == 1:
            record["losses"].append(float(self.detach().float()))
        return backward(self, *args, **kwargs)

    torch.Tensor.backward = tensor_backward


def _patch_safetensors() -> None:
    import safetensors.torch as module

    save_file = module.save_file

    def saving(tensors, filename, *args, **kwargs):
        _written(filename)
        return save_file(tensors, filename, *args, **kwargs)

    module.save_file = saving


def _write() -> None:
    os.makedirs(FOLDER, exist_ok=True)
    path = os.path.join(FOLDER, f"rank{RANK}-{os.getpid()}.json")
    with open(path + ".tmp", "w") as fh:
        json.dump(record, fh)
    os.replace(path + ".tmp", path)


if FOLDER and RANK is not None:
    _patch_torch()
    _patch_safetensors()
    sys.addaudithook(_audit)
    atexit.register(_write)
