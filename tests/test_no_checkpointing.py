"""The escape hatch end to end: ``nbddp run --no-checkpointing`` on a notebook that turns checkpointing on
by every route — PEFT's prepare_model_for_kbit_training, gradient_checkpointing_enable, a direct
torch.utils.checkpoint call, TRL's config (on by default) — first without the flag, then with it.

The notebook is written for a GPU runtime as well (TRL's default precision, bf16; a LoraConfig keyword from
another PEFT release; the old torch.cuda.amp spelling), so the run without the flag is also the one where the
compatibility shims let it train on two CPU ranks (tests/test_shims_compat_e2e.py reproduces the failure
without the precision shim)."""

import os
import subprocess
import sys

import pytest

from conftest import ROOT
from nbddp.launch.planning import find_rank_log

pytestmark = pytest.mark.e2e

CELLS = [
    """import warnings
import torch
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
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('always')
    lora = LoraConfig(r=4, target_modules=['q_proj', 'v_proj'], task_type='CAUSAL_LM', merge_weights=False)
    with torch.cuda.amp.autocast(enabled=False):
        pass
print('warned:', sorted({type(w.message).__name__ for w in caught}), flush=True)
model = get_peft_model(model, lora)""",
    """args = SFTConfig(output_dir="out", max_steps=3, per_device_train_batch_size=4, max_length=32,
                 learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to="none")
print("trainer argument gradient_checkpointing:", args.gradient_checkpointing)
print("parallel mode:", args.parallel_mode)
print('precision: bf16', args.bf16, 'fp16', args.fp16, flush=True)
print('world size', args.world_size, flush=True)""",
    """calls = []
def block(x):
    calls.append(1)
    return torch.sin(x)
x = torch.randn(3, requires_grad=True)
torch.utils.checkpoint.checkpoint(block, x, use_reentrant=True).sum().backward()
print("direct checkpoint ran the block", len(calls), "time(s)")""",
    """trainer = SFTTrainer(model=model, args=args, train_dataset=demo.arithmetic_dataset(64), processing_class=tokenizer)
trainer.train()
print('trained', trainer.state.global_step, 'steps', flush=True)""",
    """print("checkpointing after training:", model.is_activation_checkpointing)""",
]


def run_cli(tmp_path, notebook, *flags):
    proc = subprocess.run(
        [sys.executable, "-m", "nbddp.cli", "run", str(notebook), "--nproc", "2", *flags],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_no_checkpointing_turns_every_route_into_a_plain_call(tmp_path, notebook):
    nb = notebook(CELLS)
    out = run_cli(tmp_path, nb, "--runs-dir", str(tmp_path / "plain-runs"))
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
    # the shims let the GPU notebook train on two CPU ranks, each announced once, by rank 0
    assert out.count("nbddp: precision on CPU: no GPU: fp16/bf16 turned off") == 1
    assert out.count("nbddp: PEFT ") == 1
    # inside the ranks: the unknown PEFT keyword warned (UserWarning), the old autocast did not (no FutureWarning)
    assert "warned: ['UserWarning']" in out
    assert "nbddp: SFTConfig: no GPU: fp16/bf16 turned off, training in fp32 (bf16=False, fp16=False)" in out
    assert "precision: bf16 False fp16 False" in out
    assert "trained 3 steps" in out
    (logs,) = (tmp_path / "plain-runs").glob("*/logs")
    rank1 = find_rank_log(logs, 1, "stdout").read_text()  # rank 1 got the same repairs, trained too
    assert "warned: ['UserWarning']" in rank1 and "precision: bf16 False fp16 False" in rank1
    assert "world size 2" in rank1  # one DDP job of two processes (rank 1 prints no Trainer logs)

    out = run_cli(tmp_path, nb, "--runs-dir", str(tmp_path / "runs"), "--no-checkpointing")
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
