"""The HF Trainer on the tiny Llama with LoRA, 8 steps, a loss logged every 2; the training step's loss is
made NaN at steps 2 and 5 (after its backward, so only logging sees it). Rank 0 prints the logged losses
and how many times a tensor was turned into a Python bool during train() (each one makes the CPU wait for
the device). FILTER=0 sets logging_nan_inf_filter=False.
"""

import json
import os

import torch

import nbddp.runtime as rt

rt.setup()

from tiny_lora import tokenizer_model_data  # noqa: E402
from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments  # noqa: E402

NAN_STEPS = (2, 5)


class NaNTrainer(Trainer):
    def training_step(self, *args, **kwargs):
        loss = super().training_step(*args, **kwargs)
        return loss * float("nan") if self.state.global_step in NAN_STEPS else loss


tokenizer, model, data = tokenizer_model_data()
args = TrainingArguments(
    output_dir="out", max_steps=8, per_device_train_batch_size=2, learning_rate=1e-3, logging_steps=2,
    save_strategy="no", report_to="none", use_cpu=not torch.cuda.is_available(), seed=0,
    logging_nan_inf_filter=os.environ.get("FILTER", "1") == "1",
)
trainer = NaNTrainer(
    model=model, args=args, train_dataset=data, data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False)
)

bools = 0
to_bool = torch.Tensor.__bool__


def counting_bool(self):
    global bools
    bools += 1
    return to_bool(self)


torch.Tensor.__bool__ = counting_bool
trainer.train()
torch.Tensor.__bool__ = to_bool
losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
rt.print0("RESULT " + json.dumps({"losses": losses, "bools": bools, "filter_after": args.logging_nan_inf_filter}),
          flush=True)
rt.cleanup()
