"""Saving under FSDP on two gloo ranks: what a plain PyTorch loop writes after training (and in its loop)
holds the whole trained weights, as the same notebook under DDP writes them; ``--resume`` continues a
Trainer's sharded training from its last checkpoint."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from nbddp.job import run_job
from nbddp.options import RunOptions
from views import Said

SRC = Path(__file__).resolve().parents[1] / "src"

#: A plain loop on the tiny Llama with LoRA: a checkpoint in the loop, the weights and the adapter after it.
PLAIN_LOOP = [
    """import torch
from nbddp import demo
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer
tokenizer = AutoTokenizer.from_pretrained(demo.tiny_model())
model = AutoModelForCausalLM.from_pretrained(demo.tiny_model(), dtype=torch.float32)
model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
data = demo.arithmetic_dataset(64).map(
    lambda row: tokenizer(row["text"], padding="max_length", max_length=16, truncation=True), remove_columns=["text"])
train_loader = torch.utils.data.DataLoader(data.with_format("torch", columns=["input_ids"]), batch_size=4, shuffle=True)
optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)""",
    """for epoch in range(2):
    for batch in train_loader:
        loss = model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    torch.save(model.state_dict(), f"epoch{epoch}.pt")
    print("epoch", epoch, loss.item())""",
    """torch.save(model.state_dict(), "model.pt")
model.save_pretrained("adapter")
print("saved")""",
]

#: In a fresh process: each file loads into a fresh plain model, and the two runs' weights agree.
COMPARE = """
import json, sys, torch
from nbddp import demo
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

def fresh():
    model = AutoModelForCausalLM.from_pretrained(demo.tiny_model(), dtype=torch.float32)
    return get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))

fsdp, ddp = sys.argv[1], sys.argv[2]
report = {}
for name in ("epoch0.pt", "epoch1.pt", "model.pt"):
    saved = torch.load(f"{fsdp}/{name}", weights_only=False)
    kinds = sorted({type(t).__name__ for t in saved.values()})
    model = fresh()
    model.load_state_dict(saved, strict=True)  # every key, every shape: the whole model
    reference = torch.load(f"{ddp}/{name}", weights_only=False)
    worst = max((saved[k] - reference[k]).abs().max().item() for k in reference)
    moved = max((saved[k] - fresh().state_dict()[k]).abs().max().item() for k in reference if "lora_B" in k)
    report[name] = {"kinds": kinds, "keys": sorted(saved) == sorted(reference), "worst": worst, "moved": moved}
adapter = load_file(f"{fsdp}/adapter/adapter_model.safetensors")
reference = load_file(f"{ddp}/adapter/adapter_model.safetensors")
report["adapter"] = {"keys": sorted(adapter) == sorted(reference),
                     "shapes": sorted({tuple(t.shape) for t in adapter.values()}),
                     "worst": max((adapter[k] - reference[k]).abs().max().item() for k in reference)}
print(json.dumps(report))
"""


def train(folder: Path, cells: list[str], again: bool = False, **options) -> str:
    folder.mkdir(exist_ok=again)
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    nbformat.write(nb, folder / "nb.ipynb")
    chunks = []
    job = run_job(folder / "nb.ipynb", RunOptions(nproc=2, runs_dir=folder / "runs", timeout_s=600, **options),
                  Said(chunks))
    out = "".join(chunks)
    assert job.ok, (job.failure and job.failure.message[-3000:]) or out[-3000:]
    return out


@pytest.mark.e2e
def test_a_plain_loop_under_fsdp_saves_the_whole_trained_weights(tmp_path):
    out = train(tmp_path / "fsdp", PLAIN_LOOP, strategy="fsdp")
    assert "strategy fsdp" in out and "saved" in out
    train(tmp_path / "ddp", PLAIN_LOOP, strategy="ddp")
    proc = subprocess.run([sys.executable, "-c", COMPARE, str(tmp_path / "fsdp"), str(tmp_path / "ddp")],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(SRC)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.splitlines()[-1])
    for name in ("epoch0.pt", "epoch1.pt", "model.pt"):
        saved = report[name]
        assert saved["kinds"] == ["Tensor"] and saved["keys"], saved  # plain tensors, not a rank's DTensor shards
        assert saved["moved"] > 1e-3, saved  # trained, not the initial weights
        assert saved["worst"] < 1e-4, saved  # what DDP trains from the same start on the same batches
    adapter = report["adapter"]
    assert adapter["keys"] and adapter["shapes"] == [[4, 64], [32, 4], [64, 4]], adapter  # whole, not a shard
    assert adapter["worst"] < 1e-4, adapter


#: A Trainer on the tiny Llama with LoRA saving a checkpoint every 4 steps; rank 0 says each step it trains.
TRAINER = [
    """import json, os, torch
from nbddp import demo
from peft import LoraConfig, get_peft_model
from transformers import (AutoModelForCausalLM, AutoTokenizer, DataCollatorForLanguageModeling, Trainer,
                          TrainerCallback, TrainingArguments)
tokenizer = AutoTokenizer.from_pretrained(demo.tiny_model())
model = AutoModelForCausalLM.from_pretrained(demo.tiny_model(), dtype=torch.float32)
model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
data = demo.arithmetic_dataset(64).map(
    lambda row: tokenizer(row["text"], padding="max_length", max_length=16, truncation=True), remove_columns=["text"])

class Steps(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            print("TRAINED STEP", state.global_step, flush=True)""",
    """args = TrainingArguments(output_dir="out", max_steps=int(os.environ["STEPS"]), per_device_train_batch_size=4,
                         learning_rate=1e-2, lr_scheduler_type="constant", logging_steps=2, save_strategy="steps",
                         save_steps=4, report_to="none")
trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[Steps()],
                  data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False))
trainer.train()""",
    """print("LOSSES", json.dumps({r["step"]: r["loss"] for r in trainer.state.log_history if "loss" in r}))""",
]


def trained_steps(out: str) -> list[int]:
    return [int(step) for step in re.findall(r"TRAINED STEP (\d+)", out)]  # between the progress bar's redraws


def logged_losses(out: str) -> dict[int, float]:
    losses = json.loads(re.search(r"LOSSES (\{.*\})", out).group(1))
    return {int(step): loss for step, loss in losses.items()}


@pytest.mark.e2e
def test_resume_continues_a_trainer_sharded_with_fsdp(tmp_path):
    folder = tmp_path / "job"
    first = train(folder, TRAINER, strategy="fsdp", env={"STEPS": "8"})
    assert "strategy fsdp" in first and trained_steps(first) == list(range(1, 9))
    assert sorted(p.name for p in (folder / "out").iterdir()) == ["checkpoint-4", "checkpoint-8"]
    saved = {p.name for p in (folder / "out" / "checkpoint-4").iterdir()}
    assert {"pytorch_model_fsdp.bin", "optimizer.bin", "rng_state_0.pth", "rng_state_1.pth"} <= saved, saved
    (folder / "out" / "checkpoint-8" / "trainer_state.json").unlink()  # as a run stopped while saving leaves it
    second = train(folder, TRAINER, strategy="fsdp", env={"STEPS": "16"}, resume=True, again=True)
    assert f"resuming from out{os.sep}checkpoint-4" in second
    assert trained_steps(second) == list(range(5, 17))  # steps 1-4 were not trained again
    before, after = logged_losses(first), logged_losses(second)
    assert [after[s] for s in (2, 4)] == [before[s] for s in (2, 4)]  # the history the checkpoint held
    # steps 5 to 8 as the first run trained them: the checkpoint's weights, optimizer state and data order
    assert all(abs(after[s] - before[s]) < 1e-4 * before[s] for s in (6, 8)), (before, after)
    assert after[16] < before[2] - 0.1, after  # and it keeps learning


#: A full fine-tune in a plain loop, saved with ``save_pretrained`` and ``torch.save`` after training.
FULL_FINE_TUNE = [
    """import torch
from nbddp import demo
from transformers import AutoModelForCausalLM, AutoTokenizer
tokenizer = AutoTokenizer.from_pretrained(demo.tiny_model())
model = AutoModelForCausalLM.from_pretrained(demo.tiny_model(), dtype=torch.float32)
data = demo.arithmetic_dataset(32).map(
    lambda row: tokenizer(row["text"], padding="max_length", max_length=16, truncation=True), remove_columns=["text"])
train_loader = torch.utils.data.DataLoader(data.with_format("torch", columns=["input_ids"]), batch_size=4, shuffle=True)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
for batch in train_loader:
    model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss.backward()
    optimizer.step()
    optimizer.zero_grad()""",
    """model.save_pretrained("full")
torch.save(model.state_dict(), "full.pt")""",
]

LOAD_PRETRAINED = """
import json, sys, torch
from nbddp import demo
from transformers import AutoModelForCausalLM

folder = sys.argv[1]
model, info = AutoModelForCausalLM.from_pretrained(f"{folder}/full", output_loading_info=True)
start = AutoModelForCausalLM.from_pretrained(demo.tiny_model()).state_dict()
saved, weights = torch.load(f"{folder}/full.pt", weights_only=False), model.state_dict()
print(json.dumps({"missing": sorted(info["missing_keys"]), "unexpected": sorted(info["unexpected_keys"]),
                  "same_as_state_dict": all(weights[k].equal(saved[k]) for k in weights),
                  "moved": max((weights[k] - start[k]).abs().max().item() for k in weights)}))
"""


@pytest.mark.e2e
def test_a_full_fine_tune_in_a_plain_loop_under_fsdp_saves_pretrained_whole(tmp_path):
    train(tmp_path / "job", FULL_FINE_TUNE, strategy="fsdp")
    proc = subprocess.run([sys.executable, "-c", LOAD_PRETRAINED, str(tmp_path / "job")], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(SRC)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.splitlines()[-1])
    assert report["missing"] == [] and report["unexpected"] == [], report  # every weight, whole
    assert report["same_as_state_dict"] and report["moved"] > 1e-4, report  # the trained weights
