"""The HF Trainer on the tiny Llama with LoRA, loaded with ``device_map=rt.device_map()`` as the converter
writes it. Run with NBDDP_STRATEGY=split in a single process."""

import torch
from peft import LoraConfig, get_peft_model

import nbddp.runtime as rt

rt.setup()

from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorForLanguageModeling  # noqa: E402
from transformers import Trainer, TrainingArguments  # noqa: E402

from nbddp import demo  # noqa: E402

info = rt.rank_info()
path = demo.tiny_model()
tokenizer = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, device_map=rt.device_map())
print(f"device_map {rt.device_map()!r}, world size {info.world_size}, hf_device_map {getattr(model, 'hf_device_map', None)}", flush=True)
model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
data = demo.arithmetic_dataset(64).map(
    lambda row: tokenizer(row["text"], padding="max_length", max_length=16, truncation=True), remove_columns=["text"])
args = TrainingArguments(output_dir="out", max_steps=24, per_device_train_batch_size=4, learning_rate=3e-3,
                         logging_steps=4, save_strategy="no", report_to="none", use_cpu=not torch.cuda.is_available())
trainer = Trainer(model=model, args=args, train_dataset=data,
                  data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False))
trainer.train()
import torch.distributed as dist  # noqa: E402

print(f"process group: {dist.is_initialized()}", flush=True)
print(f"losses {[r['loss'] for r in trainer.state.log_history if 'loss' in r]}", flush=True)
print("JOB OK", flush=True)
rt.cleanup()
