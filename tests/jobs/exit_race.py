"""A finished rank that exits under the conditions where gloo's worker threads used to abort it.

DDP wrappers at module level (as in converted plain loops), a torch-function mode active (every collective's
work snapshots it), a backward pass (torch keeps a Python context in thread-local storage during it), and a
main thread that never hands the GIL over on its own (``sys.setswitchinterval``), so a worker that still holds
a Python object when the script ends meets the interpreter finalising. ``nbddp.runtime.sync`` says why.
"""

import sys

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import nbddp.runtime as rt

rt.setup()
torch.set_default_device("cpu")
models = [DDP(nn.Linear(8, 8)), DDP(nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)))]
for model in models:
    model(torch.randn(4, 8)).sum().backward()
with rt.main_process_first():
    pass
sys.setswitchinterval(1000)
rt.print0("JOB OK", flush=True)
rt.cleanup()
