"""Test-only recorder for the runnable public notebooks: what each process trained on and ended with.

Python imports ``sitecustomize`` at start-up from the path; ``tests/test_runnable_corpus.py`` puts this folder
on ``PYTHONPATH`` with ``NBDDP_TEST_RECORD`` naming a folder. Every rank of a job (``RANK`` set by torchrun),
or the one process running the notebook as written (``NBDDP_TEST_RECORD_AS=single``), then writes
``<rank>-<pid>.json`` there at exit with:

- ``passes``: each pass over a DataLoader of a sized data set: its length, the indices its sampler gave and
  the optimizer steps taken while it was the newest pass (0 for an evaluation or a peek at one batch);
- ``losses``: ``[optimizer, value]`` for every scalar ``backward()``, ``optimizer`` the newest one's number;
- ``optimizers``: per optimizer (in creation order) the steps taken and a hash of its parameters after the
  last step (the weights each replica ends with);
- ``writes``: files opened for writing under ``NBDDP_TEST_RECORD_ROOT`` (the notebook's folder), with
  ``torch.save``'s and safetensors' files among them.

Nothing of the notebook changes: the hooks only read. Imported by processes that are neither (the nbddp
CLI, torchrun's agent), it does nothing.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import sys

FOLDER = os.environ.get("NBDDP_TEST_RECORD")
LABEL = os.environ.get("NBDDP_TEST_RECORD_AS") or os.environ.get("RANK")
ROOT = os.path.realpath(os.environ.get("NBDDP_TEST_RECORD_ROOT") or os.getcwd())

record: dict = {"passes": [], "losses": [], "optimizers": [], "writes": []}
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


def _patch_torch(torch) -> None:
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

    backward = torch.Tensor.backward

    def tensor_backward(self, *args, **kwargs):
        if self.numel() == 1:
            record["losses"].append([len(_optimizers) - 1, float(self.detach().float())])
        return backward(self, *args, **kwargs)

    torch.Tensor.backward = tensor_backward

    from torch.optim import Optimizer

    optimizer_init = Optimizer.__init__

    def init(self, params, *args, **kwargs):
        optimizer_init(self, params, *args, **kwargs)
        if not any(o is self for o, _ in _optimizers):
            entry = {"steps": 0, "hash": _hash(self)}
            _optimizers.append((self, entry))
            record["optimizers"].append(entry)

    Optimizer.__init__ = init

    def after_step(optimizer, args, kwargs):
        for known, entry in _optimizers:
            if known is optimizer:
                entry["steps"] += 1
                entry["hash"] = _hash(optimizer)
        if record["passes"]:
            record["passes"][-1]["steps"] += 1

    from torch.optim.optimizer import register_optimizer_step_post_hook

    register_optimizer_step_post_hook(after_step)
    save = torch.save

    def torch_save(obj, f, *args, **kwargs):
        _written(f)
        return save(obj, f, *args, **kwargs)

    torch.save = torch_save


def _hash(optimizer) -> str:
    digest = hashlib.sha256()
    for group in optimizer.param_groups:
        for p in group["params"]:
            digest.update(p.detach().cpu().contiguous().view(-1).view(__import__("torch").uint8).numpy().tobytes())
    return digest.hexdigest()


def _patch_safetensors(module) -> None:
    save_file = module.save_file

    def saving(tensors, filename, *args, **kwargs):
        _written(filename)
        return save_file(tensors, filename, *args, **kwargs)

    module.save_file = saving


def _write() -> None:
    os.makedirs(FOLDER, exist_ok=True)
    path = os.path.join(FOLDER, f"{LABEL}-{os.getpid()}.json")
    with open(path + ".tmp", "w") as fh:
        json.dump(record, fh)
    os.replace(path + ".tmp", path)


if FOLDER and LABEL:
    import wrapt

    wrapt.register_post_import_hook(_patch_torch, "torch")
    wrapt.register_post_import_hook(_patch_safetensors, "safetensors.torch")
    sys.addaudithook(_audit)
    atexit.register(_write)
