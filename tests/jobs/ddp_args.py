"""Builds DDP wrappers the way users and libraries do and prints, on rank 0, the settings DDP ended up with.

Models: a plain Linear stack with a constant buffer (like rotary inv_freq), a BatchNorm model (running
statistics that training changes), and a wrapper whose caller asks for broadcast_buffers=True and
gradient_as_bucket_view=False explicitly. One training step each, so the settings are really used.

Then five DDP steps on one fixed batch per rank, a small model with a constant buffer, fixed seeds; rank 0
prints the losses.
"""

import json

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import nbddp.runtime as rt

info = rt.setup()


class WithConstant(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("inv_freq", torch.arange(4.0), persistent=False)

    def forward(self, x):
        return self.lin(x) * self.inv_freq.sum()


models = {
    "constant_buffer": DDP(WithConstant()),
    "batchnorm": DDP(nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8))),
    "explicit": DDP(WithConstant(), broadcast_buffers=True, gradient_as_bucket_view=False),
}
seen = {}
own = torch.Generator().manual_seed(info.rank)  # each rank its own batch, as a sharded loader gives it
for name, model in models.items():
    model(torch.randn(4, 8, generator=own)).sum().backward()
    seen[name] = {"broadcast_buffers": model.broadcast_buffers, "gradient_as_bucket_view": model.gradient_as_bucket_view}
rt.print0("DDP_ARGS " + json.dumps(seen), flush=True)

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 1))
model.register_buffer("scale", torch.tensor(0.5), persistent=False)
ddp = DDP(model)
opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
g = torch.Generator().manual_seed(100 + info.rank)  # each rank its own data
x, y = torch.randn(8, 16, generator=g), torch.randn(8, 1, generator=g)
losses = []
for _ in range(5):
    loss = ((ddp(x) * model.scale - y) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.item())
rt.print0("LOSSES " + json.dumps(losses), flush=True)
rt.cleanup()
