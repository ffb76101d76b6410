"""A tiny BertForSequenceClassification (no dropout) trained by the HF Trainer with SGD for 2 steps on 8 rows,
one step = the whole set on however many processes run it, then evaluated: the logged training losses and
``eval_loss``, equal in one process and on several ranks when the loss is the kernel's."""

import os

import torch
from torch.utils.data import Dataset

ROWS = 8


class Rows(Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(1)
        self.x = torch.randint(5, 90, (ROWS, 12), generator=g)
        self.y = torch.randint(0, 2, (ROWS,), generator=g)

    def __len__(self):
        return ROWS

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.y[i]}


def train_and_evaluate(out_dir) -> dict:
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.manual_seed(0)
    config = BertConfig(vocab_size=100, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, num_labels=2, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    model = BertForSequenceClassification(config)
    args = TrainingArguments(str(out_dir), per_device_train_batch_size=ROWS // world,
                             per_device_eval_batch_size=ROWS // world, max_steps=2, logging_steps=1,
                             report_to=[], learning_rate=0.5, optim="sgd", use_cpu=True, save_strategy="no")
    trainer = Trainer(model=model, args=args, train_dataset=Rows(), eval_dataset=Rows())
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {"losses": losses, "eval_loss": trainer.evaluate()["eval_loss"]}
