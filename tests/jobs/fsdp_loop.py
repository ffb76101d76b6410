"""A plain PyTorch loop on the tiny Llama with LoRA, the model wrapped as the converter wraps it
(``_nbddp.ddp(model)``). Each rank prints how many of the model's elements it holds."""

import torch

import nbddp.runtime as rt

rt.setup()

from tiny_lora import tokenizer_model_data  # noqa: E402

from nbddp.runtime.apply_strategy import local_numel  # noqa: E402

tokenizer, model, data = tokenizer_model_data()
model = rt.ddp(model)
held, total = local_numel(model)
print(f"rank {rt.rank_info().rank} holds {held} of {total} elements ({type(model).__name__})", flush=True)
optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
loader = torch.utils.data.DataLoader(data.with_format("torch", columns=["input_ids"]), batch_size=4,
                                     sampler=rt.distributed_sampler(data, shuffle=True))
losses = []
for epoch in range(3):
    rt.set_epoch(loader, epoch)
    for batch in loader:
        loss = model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(round(loss.item(), 4))
rt.print0(f"losses {losses}", flush=True)
rt.print0("JOB OK", flush=True)
rt.cleanup()
