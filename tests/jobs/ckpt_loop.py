"""A hand-written DDP loop over the tiny Llama with LoRA (frozen base), configured by environment variables.

CKPT: how checkpointing is switched on — "none", "hf" (transformers' default), "empty" (an empty kwargs dict,
as PEFT's prepare_model_for_kbit_training passes: torch's default, reentrant), "reentrant", "direct" (the
layers wrapped by hand in torch.utils.checkpoint; with use_reentrant=True if REENTRANT=1, else without it).
FIND_UNUSED / STATIC: the DDP arguments. VARY=1: one layer's adapter is skipped on odd steps, so the
parameters used change between steps.
"""

import contextlib
import os

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import nbddp.runtime as rt

device = rt.setup().device

from peft import LoraConfig, get_peft_model  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from nbddp import demo  # noqa: E402

env = os.environ.get
model = AutoModelForCausalLM.from_pretrained(demo.tiny_model(), dtype=torch.float32).to(device)
model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
ckpt = env("CKPT", "none")
if ckpt in ("hf", "empty", "reentrant"):
    kwargs = {"hf": None, "empty": {}, "reentrant": {"use_reentrant": True}}[ckpt]
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.enable_input_require_grads()
elif ckpt == "direct":
    import functools

    from torch.utils.checkpoint import checkpoint

    reentrant = {"use_reentrant": True} if env("REENTRANT") == "1" else {}

    def checkpointed(forward):
        return lambda *args, **kwargs: checkpoint(functools.partial(forward, **kwargs), *args, **reentrant)

    for layer in model.base_model.model.model.layers:
        layer.forward = checkpointed(layer.forward)
    model.enable_input_require_grads()
model.train()
ddp = DDP(model, find_unused_parameters=env("FIND_UNUSED") == "1", static_graph=env("STATIC") == "1")
print(f"ddp: find_unused_parameters={ddp.find_unused_parameters} static_graph={ddp.static_graph}", flush=True)
opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
accum = int(env("ACCUM", "1"))
varying = model.base_model.model.model.layers[1].self_attn.q_proj
gen = torch.Generator().manual_seed(int(os.environ["RANK"]))
for step in range(int(env("STEPS", "4"))):
    if env("VARY") == "1":
        varying._disable_adapters = step % 2 == 1
    for micro in range(accum):
        ids = torch.randint(4, 40, (2, 12), generator=gen).to(device)
        with ddp.no_sync() if micro < accum - 1 else contextlib.nullcontext():
            loss = ddp(input_ids=ids, labels=ids).loss / accum
            loss.backward()
    opt.step()
    opt.zero_grad()
    rt.print0(f"step {step} loss {loss.item():.4f}", flush=True)
rt.print0("JOB OK", flush=True)
rt.cleanup()
