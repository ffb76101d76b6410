"""The escape hatch end to end: ``nbddp run --no-checkpointing`` on a notebook that turns checkpointing on
by every route — PEFT's prepare_model_for_kbit_training, gradient_checkpointing_enable, a direct
torch.utils.checkpoint call, TRL's config (on by default) — first without the flag, then with it."""

import os
import subprocess
import sys

import pytest

from conftest import ROOT

pytestmark = pytest.mark.e2e

CELLS = [
    """import torch
from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import SFTConfig, SFTTrainer

from nbddp import demo""",
    """model_name = demo.tiny_model()
tokenizer = AutoTokenizer.from_pretrained(model_name)
model = AutoModelForCausalLM.from_pretrained(model_name, device_map="auto", dtype=torch.float32)
model.is_loaded_in_8bit = True  # what a bitsandbytes 8-bit load leaves: PEFT then turns checkpointing on
model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=True)
del model.is_loaded_in_8bit
print("after prepare_model_for_kbit_training:", model.is_activation_checkpointing)
model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
print("after gradient_checkpointing_enable:", model.is_activation_checkpointing)
model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))""",
    """calls = []
def block(x):
    calls.append(1)
    return torch.sin(x)
x = torch.randn(3, requires_grad=True)
torch.utils.checkpoint.checkpoint(block, x, use_reentrant=True).sum().backward()
print("direct checkpoint ran the block", len(calls), "time(s)")""",
    """args = SFTConfig(output_dir="out", max_steps=3, per_device_train_batch_size=4, max_length=32,
                 learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to="none", bf16=False, fp16=False,
                 use_cpu=not torch.cuda.is_available())  # without it the HF Trainer does not use DDP on a CPU
print("trainer argument gradient_checkpointing:", args.gradient_checkpointing)
print("parallel mode:", args.parallel_mode)
trainer = SFTTrainer(model=model, args=args, train_dataset=demo.arithmetic_dataset(64), processing_class=tokenizer)
trainer.train()""",
    """print("checkpointing after training:", model.is_activation_checkpointing)""",
]


def run_cli(tmp_path, notebook, *flags):
    proc = subprocess.run(
        [sys.executable, "-m", "nbddp.cli", "run", str(notebook), "--nproc", "2",
         "--runs-dir", str(tmp_path / "runs"), *flags],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_no_checkpointing_turns_every_route_into_a_plain_call(tmp_path, notebook):
    nb = notebook(CELLS)
    out = run_cli(tmp_path, nb)
    for line in (
        "after prepare_model_for_kbit_training: True",
        "after gradient_checkpointing_enable: True",
        "direct checkpoint ran the block 2 time(s)",  # forward, and again in the backward
        "trainer argument gradient_checkpointing: True",
        "checkpointing after training: True",
        "parallel mode: ParallelMode.DISTRIBUTED",
        "nbddp: Gradient checkpointing detected on",  # DDP wrapped a checkpointed model
    ):
        assert line in out, out[-3000:]
    assert "Gradient checkpointing disabled" not in out

    out = run_cli(tmp_path, nb, "--no-checkpointing")
    assert "nbddp: Gradient checkpointing disabled (NBDDP_DISABLE_CHECKPOINTING=1)" in out
    assert "lower the batch size or the sequence length" in out  # the memory warning
    for line in (
        "after prepare_model_for_kbit_training: False",
        "after gradient_checkpointing_enable: False",
        "direct checkpoint ran the block 1 time(s)",
        "trainer argument gradient_checkpointing: False",
        "checkpointing after training: False",
        "parallel mode: ParallelMode.DISTRIBUTED",
    ):
        assert line in out, out[-3000:]
    assert "Gradient checkpointing detected" not in out
