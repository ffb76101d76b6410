"""The HF Trainer on the tiny Llama with LoRA, as a converted notebook has it (``ddp_find_unused_parameters``,
non-reentrant gradient checkpointing), saving the adapter with ``trainer.save_model``. Each rank prints how
many of the model's elements it holds and every adapter file it writes. Run with NBDDP_STRATEGY=fsdp."""

import os

import torch

import nbddp.runtime as rt

rt.setup()

import peft.peft_model  # noqa: E402
from tiny_lora import tokenizer_model_data  # noqa: E402
from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments  # noqa: E402

from nbddp.runtime.apply_strategy import local_numel  # noqa: E402

rank = rt.rank_info().rank
save_file = peft.peft_model.safe_save_file


def counted_save(tensors, path, *args, **kwargs):
    print(f"SAVED by rank {rank}: {path}", flush=True)
    return save_file(tensors, path, *args, **kwargs)


peft.peft_model.safe_save_file = counted_save
tokenizer, model, data = tokenizer_model_data()
args = TrainingArguments(
    output_dir="out",
    max_steps=int(os.environ.get("STEPS", "24")),
    per_device_train_batch_size=4,
    learning_rate=3e-3,
    logging_steps=4,
    save_strategy="no",
    report_to="none",
    ddp_find_unused_parameters=False,
    gradient_checkpointing=True,
    gradient_checkpointing_kwargs={"use_reentrant": False},
    use_cpu=not torch.cuda.is_available(),
)
trainer = Trainer(
    model=model, args=args, train_dataset=data,
    data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
)
trainer.train()
held, total = local_numel(trainer.model_wrapped)
print(f"rank {rank} holds {held} of {total} elements ({type(trainer.model_wrapped).__name__})", flush=True)
if rt.is_main_process():  # as the converter leaves saving after training: rank 0 alone
    trainer.save_model("adapter")
    model.save_pretrained("adapter_direct")
    losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
    print(f"losses {losses}", flush=True)
rt.print0("JOB OK", flush=True)
rt.cleanup()
