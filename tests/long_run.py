"""A long ``%%ddp_train`` run on the embedded model, sized to finish 2000 steps in a few minutes on 2 CPU
cores: the notebook the bounded-output tests (nbclient, the browser) run."""

from __future__ import annotations

MODEL = '''%%ddp_setup
import os
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import SFTConfig, SFTTrainer

from nbddp import demo

tokenizer = AutoTokenizer.from_pretrained(demo.tiny_model())
model = AutoModelForCausalLM.from_pretrained(demo.tiny_model(), dtype=torch.float32)
model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, task_type="CAUSAL_LM",
                                         target_modules=["q_proj", "v_proj"]))'''

FAIL_AT = '''%%ddp_setup
class FailAt(TrainerCallback):
    """Rank 1 fails at step {step}, as a real bug would."""
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == {step} and os.environ["RANK"] == "1":
            raise RuntimeError(f"rank 1 gave up at step {{state.global_step}}")'''

TRAINER = '''%%ddp_setup
args = SFTConfig(
    output_dir="outputs", per_device_train_batch_size=1, max_steps={steps}, learning_rate=5e-3, warmup_steps=10,
    logging_steps={logging_steps}, max_length=16, gradient_checkpointing=False, save_strategy="no",
    report_to="none", seed=3407,
)
trainer = SFTTrainer(model=model, args=args, train_dataset=demo.arithmetic_dataset(512), processing_class=tokenizer,
                     callbacks={callbacks})'''

TRAIN = '''%%ddp_train
trainer.train()
model.save_pretrained("outputs/lora_adapter")'''


def sources(steps: int = 2000, logging_steps: int = 100, fail_at: int | None = None) -> list[str]:
    """The notebook's code cells: load nbddp, the model, (a failing callback,) the trainer, the training."""
    cells = ["%load_ext nbddp", MODEL]
    if fail_at:
        cells.append(FAIL_AT.format(step=fail_at))
    callbacks = "[FailAt()]" if fail_at else "[]"
    cells.append(TRAINER.format(steps=steps, logging_steps=logging_steps, callbacks=callbacks))
    return [*cells, TRAIN]
