"""The HF Trainer on the tiny Llama with LoRA (a PeftModel, so the Trainer picks find_unused_parameters=True),
gradient checkpointing on. Environment: REENTRANT=1 asks for use_reentrant=True; STATIC=1 sets
ddp_static_graph=True; ACCUM sets gradient_accumulation_steps.
"""

import os

import torch

import nbddp.runtime as rt

rt.setup()

from tiny_lora import tokenizer_model_data  # noqa: E402
from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments  # noqa: E402

env = os.environ.get
tokenizer, model, data = tokenizer_model_data()
args = TrainingArguments(
    output_dir="out",
    max_steps=3,
    per_device_train_batch_size=2,
    gradient_accumulation_steps=int(env("ACCUM", "1")),
    gradient_checkpointing=True,
    gradient_checkpointing_kwargs={"use_reentrant": True} if env("REENTRANT") == "1" else None,
    ddp_static_graph=True if env("STATIC") == "1" else None,
    learning_rate=1e-3,
    logging_steps=1,
    save_strategy="no",
    report_to="none",
    use_cpu=not torch.cuda.is_available(),
)
trainer = Trainer(
    model=model, args=args, train_dataset=data,
    data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
)
trainer.train()
ddp = trainer.model_wrapped
rt.print0(f"ddp: find_unused_parameters={ddp.find_unused_parameters} static_graph={ddp.static_graph}", flush=True)
rt.print0("JOB OK", flush=True)
rt.cleanup()
