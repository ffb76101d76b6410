"""Five DDP steps on one fixed batch per rank, a small model with a constant buffer, fixed seeds; rank 0 prints the losses."""

import json

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import nbddp.runtime as rt

info = rt.setup()
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
