"""What the Trainer jobs share (import it after ``rt.setup()``): the tiny Llama with a LoRA adapter on
q_proj/v_proj, and 64 arithmetic rows tokenised to 16 tokens."""

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from nbddp import demo


def tokenizer_model_data():
    path = demo.tiny_model()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    data = demo.arithmetic_dataset(64).map(
        lambda row: tokenizer(row["text"], padding="max_length", max_length=16, truncation=True),
        remove_columns=["text"],
    )
    return tokenizer, model, data
