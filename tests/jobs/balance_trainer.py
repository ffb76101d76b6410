"""The HF Trainer with LoRA on the tiny Llama over variable-length rows (1 to 7 sums each, a long tail), for
token-balanced shards. Each rank writes ``rank<N>.json`` into ``$OUT``: the sample ids it trained on per
epoch and the real tokens of each of its micro-batches; rank 0 adds the loss of every step.
CASES (comma-separated, in order; tests/test_balance.py): one training per case in this launch, its records in
``$OUT/<case>/``, ``CASE <name>`` printed first: "plain" with NBDDP_BALANCE=0 (the rank's settings read again
with it), "balanced" with the launch's own settings.
Environment: N (rows), BATCH (per device), ACCUM, EPOCHS, LR, DATA_SEED; NBDDP_BALANCE as the runtime reads it.
"""

import json
import os
import random

import torch

import nbddp.runtime as rt
from nbddp.runtime import settings

rt.setup()

from datasets import Dataset  # noqa: E402
from peft import LoraConfig, get_peft_model  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM, AutoTokenizer, DataCollatorForLanguageModeling, Trainer, TrainerCallback,
    TrainingArguments,
)

from nbddp import demo  # noqa: E402

env = os.environ.get
N, BATCH, ACCUM, EPOCHS = (int(env(k, d)) for k, d in (("N", "96"), ("BATCH", "2"), ("ACCUM", "1"), ("EPOCHS", "2")))
path = demo.tiny_model()
tokenizer = AutoTokenizer.from_pretrained(path)

rng = random.Random(1234)  # the data is the same in every run; only the order a sampler draws differs
rows = []
for i, ex in enumerate(demo.arithmetic_examples(N * 7, seed=5)[:N]):
    sums = min(7, max(1, int(rng.lognormvariate(0.3, 0.7))))
    picks = demo.arithmetic_examples(sums, seed=i)
    rows.append({"idx": i, "text": " ".join(f"Q: {p['prompt']}? A: {p['completion']}" for p in picks)})
data = Dataset.from_list(rows).map(lambda row: tokenizer(row["text"], truncation=True, max_length=120),
                                   remove_columns=["text"])
lm_collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)


def train(case: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    seen: dict[int, list[int]] = {}
    tokens: list[int] = []
    epoch = {"now": 0}

    class Epochs(TrainerCallback):
        def on_epoch_begin(self, args, state, control, **kwargs):
            epoch["now"] = round(state.epoch or 0)

    def collate(features):
        """Note which rows and how many real tokens this rank's micro-batch holds, then pad as usual."""
        seen.setdefault(epoch["now"], []).extend(f.pop("idx") for f in features)
        tokens.append(sum(len(f["input_ids"]) for f in features))
        return lm_collator(features)

    args = TrainingArguments(
        output_dir="out", num_train_epochs=EPOCHS, per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=ACCUM, learning_rate=float(env("LR", "2e-3")), logging_steps=1,
        save_strategy="no", report_to="none", remove_unused_columns=False, data_seed=int(env("DATA_SEED", "0")),
        use_cpu=not torch.cuda.is_available(), disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=collate, callbacks=[Epochs()])
    trainer.train()
    record = {"seen": seen, "tokens": tokens, "sampler": type(trainer._get_train_sampler()).__name__}
    if rt.is_main_process():
        record["loss"] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    out = os.path.join(env("OUT", "."), case)
    os.makedirs(out, exist_ok=True)  # case "": $OUT itself
    with open(os.path.join(out, f"rank{rt.rank_info().rank}.json"), "w") as fh:
        json.dump(record, fh)


launched = env("NBDDP_BALANCE")
if "CASES" not in os.environ:
    train("")  # one training, as launched
for case in env("CASES", "").split(",") if "CASES" in os.environ else ():
    rt.print0(f"CASE {case}", flush=True)
    if case == "plain":
        os.environ["NBDDP_BALANCE"] = "0"
    elif launched is None:
        os.environ.pop("NBDDP_BALANCE", None)
    else:
        os.environ["NBDDP_BALANCE"] = launched
    settings.load()
    train(case)
rt.print0("JOB OK", flush=True)
rt.cleanup()
