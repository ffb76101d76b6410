"""The HF Trainer on the tiny Llama with LoRA, 8 steps, a loss logged every 2; the training step's loss is
made NaN at steps 2 and 5 (after its backward, so only logging sees it). Three trainings in turn, each from
the same seed: "unfiltered" (logging_nan_inf_filter=False), "own" (the Trainer's own ``train``, none of
nbddp's wrappers around it, so its own filter) and "on_device" (``train`` as nbddp patched it). For each,
rank 0 prints ``CASE <name>`` before it and ``RESULT <name> {...}`` after it: the logged losses and how many
times a tensor was turned into a Python bool during train() (each one makes the CPU wait for the device).
"""

import json

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


def own_train(trainer):
    """``Trainer.train`` as transformers wrote it: every wrapper nbddp stacked on it peeled off."""
    train = Trainer.train
    while hasattr(train, "__wrapped__"):
        train = train.__wrapped__
    return train(trainer)


to_bool = torch.Tensor.__bool__
bools = 0


def counting_bool(self):
    global bools
    bools += 1
    return to_bool(self)


for case in ("unfiltered", "own", "on_device"):
    rt.print0(f"CASE {case}", flush=True)
    torch.manual_seed(0)  # the same adapter weights in each case
    tokenizer, model, data = tokenizer_model_data()
    args = TrainingArguments(
        output_dir="out", max_steps=8, per_device_train_batch_size=2, learning_rate=1e-3, logging_steps=2,
        save_strategy="no", report_to="none", use_cpu=not torch.cuda.is_available(), seed=0,
        logging_nan_inf_filter=case != "unfiltered",
    )
    trainer = NaNTrainer(
        model=model, args=args, train_dataset=data,
        data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
    )
    bools = 0
    torch.Tensor.__bool__ = counting_bool
    own_train(trainer) if case == "own" else trainer.train()
    torch.Tensor.__bool__ = to_bool
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    rt.print0(f"RESULT {case} " + json.dumps(
        {"losses": losses, "bools": bools, "filter_after": args.logging_nan_inf_filter}), flush=True)
rt.cleanup()
