"""Write the converter's fixture corpus: notebooks in the styles people copy, written for this project.

Run once (``python tests/corpus/make_corpus.py``) and commit the ``.ipynb`` files; this script is their
readable source. Styles: Unsloth on Kaggle and Colab (SFT, GRPO, vision, Gemma with ``FastModel``, GGUF
export), Hugging Face course notebooks (``Trainer``, TRL SFT/DPO), plain PyTorch competition notebooks
(image, tabular, k-fold), notebooks with several training calls, inference tails, and IPython syntax.

The ``pytorch_*`` notebooks run on a CPU in seconds (synthetic data, tiny models); ``RUNNABLE`` lists them.
The others need GPUs, Unsloth or downloads and are only converted.
"""

from __future__ import annotations

from pathlib import Path

import nbformat

HERE = Path(__file__).resolve().parent

#: Notebooks whose converted script trains on CPU with two gloo processes.
RUNNABLE = ("pytorch_image_cnn", "pytorch_tabular_mlp", "pytorch_kfold")

NOTEBOOKS: dict[str, list[str]] = {}


def notebook(name: str, *cells: str) -> None:
    """Register a notebook; a cell starting with ``md:`` is markdown."""
    NOTEBOOKS[name] = [c.strip("\n") for c in cells]


# ----------------------------------------------------------------------------------------------- Unsloth

UNSLOTH_INSTALL = """%%capture
import os
if "COLAB_" not in "".join(os.environ.keys()):
    !pip install unsloth
else:
    !pip install --no-deps bitsandbytes accelerate xformers==0.0.29.post3 peft trl triton cut_cross_entropy unsloth_zoo
    !pip install sentencepiece protobuf "datasets>=3.4.1" huggingface_hub hf_transfer
    !pip install --no-deps unsloth"""

MEMORY_STATS = """gpu_stats = torch.cuda.get_device_properties(0)
start_gpu_memory = round(torch.cuda.max_memory_reserved() / 1024 / 1024 / 1024, 3)
max_memory = round(gpu_stats.total_memory / 1024 / 1024 / 1024, 3)
print(f"GPU = {gpu_stats.name}. Max memory = {max_memory} GB.")
print(f"{start_gpu_memory} GB of memory reserved.")"""

FINAL_STATS = """used_memory = round(torch.cuda.max_memory_reserved() / 1024 / 1024 / 1024, 3)
used_memory_for_lora = round(used_memory - start_gpu_memory, 3)
used_percentage = round(used_memory / max_memory * 100, 3)
print(f"{trainer_stats.metrics['train_runtime']} seconds used for training.")
print(f"{round(trainer_stats.metrics['train_runtime']/60, 2)} minutes used for training.")
print(f"Peak reserved memory = {used_memory} GB.")
print(f"Peak reserved memory for training = {used_memory_for_lora} GB.")
print(f"Peak reserved memory % of max memory = {used_percentage} %.")"""

GGUF_TAIL = """# Merge to 16bit
if False: model.save_pretrained_merged("model", tokenizer, save_method = "merged_16bit",)
if False: model.push_to_hub_merged("hf/model", tokenizer, save_method = "merged_16bit", token = "")

# Save to 8bit Q8_0
if False: model.save_pretrained_gguf("model", tokenizer,)
if False:
    model.push_to_hub_gguf("hf/model", tokenizer, token = "")
    !pip install llama-cpp-python"""

notebook(
    "unsloth_kaggle_sft",
    "md:# Kaggle: fine-tune Llama 3.2 with Unsloth on two T4s",
    UNSLOTH_INSTALL,
    """from unsloth import FastLanguageModel
import torch
max_seq_length = 2048
dtype = None
load_in_4bit = True

model, tokenizer = FastLanguageModel.from_pretrained(
    model_name = "unsloth/Llama-3.2-3B-Instruct",
    max_seq_length = max_seq_length,
    dtype = dtype,
    load_in_4bit = load_in_4bit,
    # token = "hf_...",
)""",
    """model = FastLanguageModel.get_peft_model(
    model,
    r = 16,
    target_modules = ["q_proj", "k_proj", "v_proj", "o_proj",
                      "gate_proj", "up_proj", "down_proj",],
    lora_alpha = 16,
    lora_dropout = 0,
    bias = "none",
    use_gradient_checkpointing = "unsloth",
    random_state = 3407,
    use_rslora = False,
    loftq_config = None,
)""",
    """from unsloth.chat_templates import get_chat_template, standardize_sharegpt
tokenizer = get_chat_template(tokenizer, chat_template = "llama-3.1")

def formatting_prompts_func(examples):
    convos = examples["conversations"]
    texts = [tokenizer.apply_chat_template(convo, tokenize = False, add_generation_prompt = False) for convo in convos]
    return { "text" : texts, }

from datasets import load_dataset
dataset = load_dataset("mlabonne/FineTome-100k", split = "train")
dataset = standardize_sharegpt(dataset)
dataset = dataset.map(formatting_prompts_func, batched = True,)""",
    """from trl import SFTTrainer
from transformers import TrainingArguments, DataCollatorForSeq2Seq
from unsloth import is_bfloat16_supported

trainer = SFTTrainer(
    model = model,
    tokenizer = tokenizer,
    train_dataset = dataset,
    dataset_text_field = "text",
    max_seq_length = max_seq_length,
    data_collator = DataCollatorForSeq2Seq(tokenizer = tokenizer),
    dataset_num_proc = 2,
    packing = False,
    args = TrainingArguments(
        per_device_train_batch_size = 2,
        gradient_accumulation_steps = 4,
        warmup_steps = 5,
        max_steps = 60,
        learning_rate = 2e-4,
        fp16 = not is_bfloat16_supported(),
        bf16 = is_bfloat16_supported(),
        logging_steps = 1,
        optim = "adamw_8bit",
        weight_decay = 0.01,
        lr_scheduler_type = "linear",
        seed = 3407,
        output_dir = "outputs",
        report_to = "none",
    ),
)""",
    """from unsloth.chat_templates import train_on_responses_only
trainer = train_on_responses_only(
    trainer,
    instruction_part = "<|start_header_id|>user<|end_header_id|>\\n\\n",
    response_part = "<|start_header_id|>assistant<|end_header_id|>\\n\\n",
)""",
    MEMORY_STATS,
    "trainer_stats = trainer.train()",
    FINAL_STATS,
    "md:## Inference",
    """FastLanguageModel.for_inference(model)
messages = [{"role": "user", "content": "Continue the fibonnaci sequence: 1, 1, 2, 3, 5, 8,"}]
inputs = tokenizer.apply_chat_template(messages, tokenize = True, add_generation_prompt = True, return_tensors = "pt").to("cuda")
outputs = model.generate(input_ids = inputs, max_new_tokens = 64, use_cache = True, temperature = 1.5, min_p = 0.1)
tokenizer.batch_decode(outputs)""",
    """from transformers import TextStreamer
text_streamer = TextStreamer(tokenizer, skip_prompt = True)
_ = model.generate(input_ids = inputs, streamer = text_streamer, max_new_tokens = 128, use_cache = True)""",
    """model.save_pretrained("lora_model")
tokenizer.save_pretrained("lora_model")
# model.push_to_hub("your_name/lora_model", token = "...")""",
    GGUF_TAIL,
)

notebook(
    "unsloth_grpo",
    "md:# GRPO with Unsloth: teach a model to reason",
    UNSLOTH_INSTALL.replace("unsloth_zoo", "unsloth_zoo vllm"),
    """from unsloth import FastLanguageModel, PatchFastRL
PatchFastRL("GRPO", FastLanguageModel)""",
    """from unsloth import is_bfloat16_supported
import torch
max_seq_length = 1024
lora_rank = 32

model, tokenizer = FastLanguageModel.from_pretrained(
    model_name = "Qwen/Qwen2.5-3B-Instruct",
    max_seq_length = max_seq_length,
    load_in_4bit = True,
    fast_inference = True,
    max_lora_rank = lora_rank,
    gpu_memory_utilization = 0.5,
    device_map = "balanced",
)

model = FastLanguageModel.get_peft_model(
    model,
    r = lora_rank,
    target_modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    lora_alpha = lora_rank,
    use_gradient_checkpointing = "unsloth",
    random_state = 3407,
)""",
    '''import re
from datasets import load_dataset, Dataset

SYSTEM_PROMPT = """
Respond in the following format:
<reasoning>
...
</reasoning>
<answer>
...
</answer>
"""

def extract_xml_answer(text: str) -> str:
    answer = text.split("<answer>")[-1]
    answer = answer.split("</answer>")[0]
    return answer.strip()

def extract_hash_answer(text: str) -> str | None:
    if "####" not in text:
        return None
    return text.split("####")[1].strip()

def get_gsm8k_questions(split = "train") -> Dataset:
    data = load_dataset("openai/gsm8k", "main")[split]
    data = data.map(lambda x: {
        "prompt": [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": x["question"]}
        ],
        "answer": extract_hash_answer(x["answer"])
    })
    return data

dataset = get_gsm8k_questions()''',
    """def correctness_reward_func(prompts, completions, answer, **kwargs) -> list[float]:
    responses = [completion[0]["content"] for completion in completions]
    extracted_responses = [extract_xml_answer(r) for r in responses]
    print("-" * 20, f"Question:\\n{prompts[0][-1]['content']}", f"\\nResponse:\\n{responses[0]}")
    return [2.0 if r == a else 0.0 for r, a in zip(extracted_responses, answer)]

def int_reward_func(completions, **kwargs) -> list[float]:
    responses = [completion[0]["content"] for completion in completions]
    return [0.5 if extract_xml_answer(r).isdigit() else 0.0 for r in responses]

def strict_format_reward_func(completions, **kwargs) -> list[float]:
    pattern = r"^<reasoning>\\n.*?\\n</reasoning>\\n<answer>\\n.*?\\n</answer>\\n$"
    responses = [completion[0]["content"] for completion in completions]
    return [0.5 if re.match(pattern, r) else 0.0 for r in responses]""",
    """from trl import GRPOConfig, GRPOTrainer
training_args = GRPOConfig(
    use_vllm = True,
    learning_rate = 5e-6,
    adam_beta1 = 0.9,
    adam_beta2 = 0.99,
    weight_decay = 0.1,
    warmup_ratio = 0.1,
    lr_scheduler_type = "cosine",
    optim = "paged_adamw_8bit",
    logging_steps = 1,
    bf16 = is_bfloat16_supported(),
    fp16 = not is_bfloat16_supported(),
    per_device_train_batch_size = 1,
    gradient_accumulation_steps = 1,
    num_generations = 6,
    max_prompt_length = 256,
    max_completion_length = 200,
    max_steps = 250,
    save_steps = 250,
    max_grad_norm = 0.1,
    report_to = "none",
    output_dir = "outputs",
)""",
    """trainer = GRPOTrainer(
    model = model,
    processing_class = tokenizer,
    reward_funcs = [int_reward_func, strict_format_reward_func, correctness_reward_func],
    args = training_args,
    train_dataset = dataset,
)
trainer.train()""",
    """text = tokenizer.apply_chat_template([
    {"role" : "user", "content" : "Calculate pi."},
], tokenize = False, add_generation_prompt = True)

from vllm import SamplingParams
sampling_params = SamplingParams(temperature = 0.8, top_p = 0.95, max_tokens = 1024)
output = model.fast_generate([text], sampling_params = sampling_params, lora_request = None)[0].outputs[0].text
output""",
    'model.save_lora("grpo_saved_lora")',
    """output = model.fast_generate(
    text,
    sampling_params = sampling_params,
    lora_request = model.load_lora("grpo_saved_lora"),
)[0].outputs[0].text
print(output)""",
    GGUF_TAIL,
)

notebook(
    "unsloth_vision_sft",
    "md:# Vision fine-tune: Qwen2-VL on LaTeX OCR",
    "%%capture\n!pip install unsloth",
    """from unsloth import FastVisionModel
import torch

model, tokenizer = FastVisionModel.from_pretrained(
    "unsloth/Qwen2-VL-7B-Instruct",
    load_in_4bit = True,
    use_gradient_checkpointing = "unsloth",
)
model = FastVisionModel.get_peft_model(
    model,
    finetune_vision_layers = True,
    finetune_language_layers = True,
    finetune_attention_modules = True,
    finetune_mlp_modules = True,
    r = 16,
    lora_alpha = 16,
    lora_dropout = 0,
    bias = "none",
    random_state = 3407,
)""",
    """from datasets import load_dataset
dataset = load_dataset("unsloth/LaTeX_OCR", split = "train")
instruction = "Write the LaTeX representation for this image."

def convert_to_conversation(sample):
    conversation = [
        { "role": "user",
          "content" : [
            {"type" : "text",  "text"  : instruction},
            {"type" : "image", "image" : sample["image"]} ]
        },
        { "role" : "assistant",
          "content" : [
            {"type" : "text",  "text"  : sample["text"]} ]
        },
    ]
    return { "messages" : conversation }

converted_dataset = [convert_to_conversation(sample) for sample in dataset]""",
    """from unsloth import is_bf16_supported
from unsloth.trainer import UnslothVisionDataCollator
from trl import SFTTrainer, SFTConfig

FastVisionModel.for_training(model)
trainer = SFTTrainer(
    model = model,
    tokenizer = tokenizer,
    data_collator = UnslothVisionDataCollator(model, tokenizer),
    train_dataset = converted_dataset,
    args = SFTConfig(
        per_device_train_batch_size = 2,
        gradient_accumulation_steps = 4,
        warmup_steps = 5,
        max_steps = 30,
        learning_rate = 2e-4,
        fp16 = not is_bf16_supported(),
        bf16 = is_bf16_supported(),
        logging_steps = 1,
        optim = "adamw_8bit",
        output_dir = "outputs",
        report_to = "none",
        remove_unused_columns = False,
        dataset_text_field = "",
        dataset_kwargs = {"skip_prepare_dataset": True},
        max_seq_length = 2048,
    ),
)""",
    "trainer_stats = trainer.train()",
    """FastVisionModel.for_inference(model)
image = dataset[2]["image"]
messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": instruction}]}]
input_text = tokenizer.apply_chat_template(messages, add_generation_prompt = True)
inputs = tokenizer(image, input_text, add_special_tokens = False, return_tensors = "pt").to("cuda")
from transformers import TextStreamer
text_streamer = TextStreamer(tokenizer, skip_prompt = True)
_ = model.generate(**inputs, streamer = text_streamer, max_new_tokens = 128, use_cache = True, temperature = 1.5, min_p = 0.1)""",
    """model.save_pretrained("lora_model")
tokenizer.save_pretrained("lora_model")""",
)

notebook(
    "unsloth_gemma_fastmodel",
    "md:# Gemma 3 with `FastModel`, trained with `unsloth_train`",
    "%%capture\n%pip install unsloth\n%pip install --no-deps --upgrade timm",
    """from unsloth import FastModel
import torch

model, tokenizer = FastModel.from_pretrained(
    model_name = "unsloth/gemma-3-4b-it",
    max_seq_length = 2048,
    load_in_4bit = True,
    load_in_8bit = False,
    full_finetuning = False,
    device_map = "sequential",
)
model = FastModel.get_peft_model(
    model,
    finetune_vision_layers = False,
    finetune_language_layers = True,
    r = 8, lora_alpha = 8, lora_dropout = 0, bias = "none",
    random_state = 3407,
)""",
    """from unsloth.chat_templates import get_chat_template, standardize_data_formats
tokenizer = get_chat_template(tokenizer, chat_template = "gemma-3")
from datasets import load_dataset
dataset = load_dataset("mlabonne/FineTome-100k", split = "train")
dataset = standardize_data_formats(dataset)
def apply_chat_template(examples):
    texts = tokenizer.apply_chat_template(examples["conversations"])
    return { "text" : texts }
dataset = dataset.map(apply_chat_template, batched = True)""",
    """from trl import SFTTrainer, SFTConfig
from unsloth import unsloth_train
trainer = SFTTrainer(
    model = model,
    tokenizer = tokenizer,
    train_dataset = dataset,
    eval_dataset = None,
    args = SFTConfig(
        dataset_text_field = "text",
        per_device_train_batch_size = 2,
        gradient_accumulation_steps = 4,
        warmup_steps = 5,
        max_steps = 30,
        learning_rate = 2e-4,
        logging_steps = 1,
        optim = "adamw_8bit",
        weight_decay = 0.01,
        lr_scheduler_type = "linear",
        seed = 3407,
        report_to = "none",
    ),
)
trainer_stats = unsloth_train(trainer)""",
    """print(trainer_stats)
messages = [{"role": "user", "content": [{"type" : "text", "text" : "Why is the sky blue?"}]}]
text = tokenizer.apply_chat_template(messages, add_generation_prompt = True)
outputs = model.generate(**tokenizer([text], return_tensors = "pt").to("cuda"), max_new_tokens = 64)
print(tokenizer.batch_decode(outputs))""",
    """model.save_pretrained("gemma-3")
tokenizer.save_pretrained("gemma-3")
if False:
    model.save_pretrained_merged("gemma-3-finetune", tokenizer)""",
)

notebook(
    "unsloth_gguf_export",
    "md:# Colab: Mistral SFT, then export GGUF and push it",
    "!pip install -q unsloth",
    """from unsloth import FastLanguageModel
model, tokenizer = FastLanguageModel.from_pretrained("unsloth/mistral-7b-v0.3-bnb-4bit", max_seq_length = 2048, load_in_4bit = True, device_map = "auto")
model = FastLanguageModel.get_peft_model(model, r = 16, lora_alpha = 16, use_gradient_checkpointing = "unsloth")""",
    """alpaca_prompt = \"\"\"Below is an instruction. Write a response.

### Instruction:
{}

### Response:
{}\"\"\"
EOS_TOKEN = tokenizer.eos_token
def formatting_prompts_func(examples):
    texts = [alpaca_prompt.format(i, o) + EOS_TOKEN for i, o in zip(examples["instruction"], examples["output"])]
    return { "text" : texts, }
from datasets import load_dataset
dataset = load_dataset("yahma/alpaca-cleaned", split = "train").map(formatting_prompts_func, batched = True)""",
    """from trl import SFTTrainer, SFTConfig
trainer = SFTTrainer(model = model, tokenizer = tokenizer, train_dataset = dataset,
                     args = SFTConfig(max_steps = 60, per_device_train_batch_size = 2, output_dir = "outputs", gradient_checkpointing = True))
trainer.train()""",
    """from google.colab import userdata
token = userdata.get("HF_TOKEN")
model.save_pretrained_gguf("model", tokenizer, quantization_method = "q4_k_m")
model.push_to_hub_gguf("me/mistral-alpaca-gguf", tokenizer, quantization_method = ["q4_k_m", "q8_0"], token = token)
model.push_to_hub_merged("me/mistral-alpaca", tokenizer, save_method = "merged_16bit", token = token)""",
    "!ls -la model",
)

# ----------------------------------------------------------------------------------- Hugging Face course

notebook(
    "hf_trainer_text_classification",
    "md:# Text classification with the Trainer (course chapter 3 style)",
    "!pip install -q datasets evaluate transformers[sentencepiece]",
    """from datasets import load_dataset
from transformers import AutoTokenizer, AutoModelForSequenceClassification, DataCollatorWithPadding
import numpy as np
import evaluate

raw_datasets = load_dataset("glue", "mrpc")
checkpoint = "bert-base-uncased"
tokenizer = AutoTokenizer.from_pretrained(checkpoint)

def tokenize_function(example):
    return tokenizer(example["sentence1"], example["sentence2"], truncation=True)

tokenized_datasets = raw_datasets.map(tokenize_function, batched=True)
data_collator = DataCollatorWithPadding(tokenizer=tokenizer)""",
    """model = AutoModelForSequenceClassification.from_pretrained(checkpoint, num_labels=2)
device = torch.device("cuda:0") if torch.cuda.is_available() else torch.device("cpu")
model.to(device)""",
    """from transformers import TrainingArguments, Trainer

def compute_metrics(eval_preds):
    metric = evaluate.load("glue", "mrpc")
    logits, labels = eval_preds
    predictions = np.argmax(logits, axis=-1)
    return metric.compute(predictions=predictions, references=labels)

training_args = TrainingArguments("test-trainer", eval_strategy="epoch", ddp_find_unused_parameters=True)
trainer = Trainer(
    model,
    training_args,
    train_dataset=tokenized_datasets["train"],
    eval_dataset=tokenized_datasets["validation"],
    data_collator=data_collator,
    processing_class=tokenizer,
    compute_metrics=compute_metrics,
)""",
    "trainer.train()",
    """predictions = trainer.predict(tokenized_datasets["validation"])
print(predictions.predictions.shape, predictions.label_ids.shape)
preds = np.argmax(predictions.predictions, axis=-1)""",
    """metric = evaluate.load("glue", "mrpc")
metric.compute(predictions=preds, references=predictions.label_ids)""",
    'trainer.push_to_hub("bert-mrpc")',
)

notebook(
    "hf_trainer_causal_lm",
    "md:# Training a causal language model from scratch",
    """from datasets import load_dataset, DatasetDict
from transformers import AutoTokenizer, GPT2LMHeadModel, AutoConfig, DataCollatorForLanguageModeling
import math

ds_train = load_dataset("huggingface-course/codeparrot-ds-train", split="train")
ds_valid = load_dataset("huggingface-course/codeparrot-ds-valid", split="validation")
raw_datasets = DatasetDict({"train": ds_train.shuffle().select(range(50000)), "valid": ds_valid.shuffle().select(range(500))})
context_length = 128
tokenizer = AutoTokenizer.from_pretrained("huggingface-course/code-search-net-tokenizer")""",
    """def tokenize(element):
    outputs = tokenizer(element["content"], truncation=True, max_length=context_length, return_overflowing_tokens=True, return_length=True)
    input_batch = []
    for length, input_ids in zip(outputs["length"], outputs["input_ids"]):
        if length == context_length:
            input_batch.append(input_ids)
    return {"input_ids": input_batch}

tokenized_datasets = raw_datasets.map(
    tokenize, batched=True, remove_columns=raw_datasets["train"].column_names
)
tokenized_datasets""",
    """config = AutoConfig.from_pretrained("gpt2", vocab_size=len(tokenizer), n_ctx=context_length,
                                    bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
model = GPT2LMHeadModel(config)
model_size = sum(t.numel() for t in model.parameters())
print(f"GPT-2 size: {model_size/1000**2:.1f}M parameters")
tokenizer.pad_token = tokenizer.eos_token
data_collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)""",
    """from transformers import Trainer, TrainingArguments
args = TrainingArguments(
    output_dir="codeparrot-ds",
    per_device_train_batch_size=32,
    per_device_eval_batch_size=32,
    eval_strategy="steps",
    eval_steps=5_000,
    logging_steps=5_000,
    gradient_accumulation_steps=8,
    num_train_epochs=1,
    weight_decay=0.1,
    warmup_steps=1_000,
    lr_scheduler_type="cosine",
    learning_rate=5e-4,
    save_steps=5_000,
    fp16=True,
    push_to_hub=True,
)
trainer = Trainer(model=model, processing_class=tokenizer, args=args, data_collator=data_collator,
                  train_dataset=tokenized_datasets["train"], eval_dataset=tokenized_datasets["valid"])""",
    "trainer.train()",
    """eval_results = trainer.evaluate()
print(f"Perplexity: {math.exp(eval_results['eval_loss']):.2f}")""",
    """trainer.push_to_hub()
from transformers import pipeline
pipe = pipeline("text-generation", model="codeparrot-ds", device=0)
txt = "# create some data\\nx = np.random.randn(100)\\n"
print(pipe(txt, num_return_sequences=1)[0]["generated_text"])""",
)

notebook(
    "trl_sft_qlora",
    "md:# QLoRA with TRL's SFTTrainer and bitsandbytes",
    "%pip install -q -U bitsandbytes peft trl accelerate datasets",
    """import torch
from datasets import load_dataset
from peft import LoraConfig, prepare_model_for_kbit_training
from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig
from trl import SFTConfig, SFTTrainer

model_id = "meta-llama/Llama-3.1-8B"
bnb_config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_use_double_quant=True)
model = AutoModelForCausalLM.from_pretrained(model_id, quantization_config=bnb_config, device_map={"": 0})
model.config.use_cache = False
model = prepare_model_for_kbit_training(model)
tokenizer = AutoTokenizer.from_pretrained(model_id, device_map="auto")
tokenizer.pad_token = tokenizer.eos_token""",
    """dataset = load_dataset("timdettmers/openassistant-guanaco", split="train")
peft_config = LoraConfig(lora_alpha=16, lora_dropout=0.1, r=64, bias="none", task_type="CAUSAL_LM")""",
    """sft_config = SFTConfig(
    output_dir="./results",
    num_train_epochs=1,
    per_device_train_batch_size=4,
    gradient_accumulation_steps=4,
    optim="paged_adamw_32bit",
    save_steps=25,
    logging_steps=25,
    learning_rate=2e-4,
    bf16=True,
    max_grad_norm=0.3,
    warmup_ratio=0.03,
    lr_scheduler_type="constant",
    gradient_checkpointing=True,
    dataset_text_field="text",
    max_length=512,
)
trainer = SFTTrainer(model=model, train_dataset=dataset, peft_config=peft_config, processing_class=tokenizer, args=sft_config)""",
    "%%time\ntrainer.train()",
    """trainer.model.save_pretrained("llama-guanaco-adapter")
del model, trainer
torch.cuda.empty_cache()""",
    """from peft import AutoPeftModelForCausalLM
model = AutoPeftModelForCausalLM.from_pretrained("llama-guanaco-adapter", device_map="auto", torch_dtype=torch.bfloat16)
model = model.merge_and_unload()
model.save_pretrained("llama-guanaco-merged", safe_serialization=True)
tokenizer.save_pretrained("llama-guanaco-merged")""",
)

notebook(
    "trl_dpo",
    "md:# Preference tuning with DPO",
    "!pip install -q trl peft",
    """import torch
from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from peft import LoraConfig
from trl import DPOConfig, DPOTrainer

model_name = "Qwen/Qwen2.5-0.5B-Instruct"
model = AutoModelForCausalLM.from_pretrained(model_name, torch_dtype=torch.bfloat16, device_map="cuda:0")
ref_model = AutoModelForCausalLM.from_pretrained(model_name, torch_dtype=torch.bfloat16, device_map="cuda:0")
tokenizer = AutoTokenizer.from_pretrained(model_name)""",
    """train_dataset = load_dataset("trl-lib/ultrafeedback_binarized", split="train")
train_dataset = train_dataset.filter(lambda x: len(x["chosen"]) < 2000)""",
    """training_args = DPOConfig(
    output_dir="Qwen2.5-0.5B-DPO",
    logging_steps=10,
    beta=0.1,
    per_device_train_batch_size=2,
    gradient_accumulation_steps=8,
    max_length=1024,
    bf16=True,
)
trainer = DPOTrainer(
    model=model,
    ref_model=ref_model,
    args=training_args,
    processing_class=tokenizer,
    train_dataset=train_dataset,
    peft_config=LoraConfig(r=16, lora_alpha=32, task_type="CAUSAL_LM"),
)
trainer.train()""",
    """trainer.save_model(training_args.output_dir)
metrics = trainer.state.log_history
import matplotlib.pyplot as plt
plt.plot([m["rewards/margins"] for m in metrics if "rewards/margins" in m])
plt.title("reward margin")
plt.savefig("margins.png")""",
)

# ---------------------------------------------------------------------------------- several trainings

notebook(
    "sft_then_dpo",
    "md:# Two stages: SFT, then DPO on the SFT model",
    "!pip install -q trl peft datasets",
    """import torch
from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from peft import LoraConfig, get_peft_model
from trl import SFTConfig, SFTTrainer, DPOConfig, DPOTrainer

tokenizer = AutoTokenizer.from_pretrained("HuggingFaceTB/SmolLM2-360M")
model = AutoModelForCausalLM.from_pretrained("HuggingFaceTB/SmolLM2-360M", device_map="auto")
model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, task_type="CAUSAL_LM"))""",
    """sft_data = load_dataset("trl-lib/Capybara", split="train[:2000]")
sft_trainer = SFTTrainer(model=model, args=SFTConfig(output_dir="sft", max_steps=100), train_dataset=sft_data,
                         processing_class=tokenizer)
sft_stats = sft_trainer.train()""",
    """print(sft_stats.metrics)
model.save_pretrained("stage1-sft")
sample = model.generate(**tokenizer("Hello", return_tensors="pt").to(model.device), max_new_tokens=20)
print(tokenizer.decode(sample[0]))""",
    """pref_data = load_dataset("trl-lib/ultrafeedback_binarized", split="train[:2000]")
pref_data = pref_data.filter(lambda x: len(x["chosen"]) < 1500)
dpo_args = DPOConfig(output_dir="dpo", max_steps=100, beta=0.1, ddp_find_unused_parameters=False)
dpo_trainer = DPOTrainer(model=model, args=dpo_args, train_dataset=pref_data, processing_class=tokenizer)""",
    "dpo_trainer.train()",
    """dpo_trainer.save_model("stage2-dpo")
dpo_trainer.push_to_hub("me/smollm2-sft-dpo")""",
)

notebook(
    "hf_two_runs_with_eval",
    "md:# Two learning rates, compared on the validation set",
    """from datasets import load_dataset
from transformers import AutoTokenizer, AutoModelForSequenceClassification, TrainingArguments, Trainer

ds = load_dataset("imdb")
tok = AutoTokenizer.from_pretrained("distilbert-base-uncased")
ds = ds.map(lambda b: tok(b["text"], truncation=True), batched=True)
small_train = ds["train"].shuffle(seed=0).select(range(2000))
small_eval = ds["test"].shuffle(seed=0).select(range(500))""",
    """results = {}
model = AutoModelForSequenceClassification.from_pretrained("distilbert-base-uncased", num_labels=2)
args = TrainingArguments("run-a", learning_rate=5e-5, num_train_epochs=1, save_strategy="no")
trainer = Trainer(model=model, args=args, train_dataset=small_train, eval_dataset=small_eval, processing_class=tok)
trainer.train()""",
    """results["5e-5"] = trainer.evaluate()
print(results)
trainer.save_model("run-a")""",
    """model = AutoModelForSequenceClassification.from_pretrained("distilbert-base-uncased", num_labels=2)
args = TrainingArguments("run-b", learning_rate=1e-5, num_train_epochs=1, save_strategy="no")
trainer = Trainer(model=model, args=args, train_dataset=small_train, eval_dataset=small_eval, processing_class=tok)
trainer.train()""",
    """results["1e-5"] = trainer.evaluate()
import pandas as pd
df = pd.DataFrame(results).T
display(df)
df.to_csv("results.csv")""",
)

notebook(
    "peft_resume_inference",
    "md:# Continue training a saved adapter, then chat with it",
    """import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainingArguments, Trainer, DataCollatorForLanguageModeling
from peft import PeftModel
from datasets import load_dataset

base = AutoModelForCausalLM.from_pretrained("gpt2", torch_dtype=torch.float16, device_map="sequential")
model = PeftModel.from_pretrained(base, "my-org/gpt2-lora", is_trainable=True)
tokenizer = AutoTokenizer.from_pretrained("gpt2")
tokenizer.pad_token = tokenizer.eos_token""",
    """data = load_dataset("Abirate/english_quotes", split="train")
data = data.map(lambda samples: tokenizer(samples["quote"]), batched=True)""",
    """trainer = Trainer(
    model=model,
    train_dataset=data,
    args=TrainingArguments(per_device_train_batch_size=4, gradient_accumulation_steps=4, warmup_steps=10,
                           max_steps=50, learning_rate=2e-4, fp16=True, logging_steps=1, output_dir="outputs"),
    data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
)
model.config.use_cache = False
trainer.train(resume_from_checkpoint=False)""",
    """model.config.use_cache = True
batch = tokenizer("Two things are infinite: ", return_tensors="pt").to("cuda:0")
with torch.cuda.amp.autocast():
    output_tokens = model.generate(**batch, max_new_tokens=50)
print("\\n\\n", tokenizer.decode(output_tokens[0], skip_special_tokens=True))
model.push_to_hub("my-org/gpt2-lora", use_auth_token=True, commit_message="more training")""",
)

notebook(
    "kaggle_magics",
    "md:# Kaggle notebook full of IPython syntax",
    "%%capture\n!pip install -U transformers peft trl\n%pip install -q datasets",
    """%env TOKENIZERS_PARALLELISM=false
%env WANDB_DISABLED true
%matplotlib inline
%load_ext autoreload
%autoreload 2
%cd /kaggle/working
!nvidia-smi
gpu_info = !nvidia-smi --query-gpu=name --format=csv,noheader
print(gpu_info)""",
    """import os
os.environ["CUDA_VISIBLE_DEVICES"] = "0"
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import SFTConfig, SFTTrainer
from datasets import load_dataset""",
    """%%time
model = AutoModelForCausalLM.from_pretrained("/kaggle/input/qwen2.5/transformers/0.5b/1", device_map="auto", torch_dtype=torch.float16)
tokenizer = AutoTokenizer.from_pretrained("/kaggle/input/qwen2.5/transformers/0.5b/1")""",
    """%time ds = load_dataset("json", data_files="/kaggle/input/my-data/train.jsonl", split="train")
display(ds)""",
    """%%writefile config.yaml
lr: 0.0002
steps: 100""",
    """trainer = SFTTrainer(model=model, train_dataset=ds, processing_class=tokenizer,
                     args=SFTConfig(output_dir="/kaggle/working/out", max_steps=100, report_to="none", gradient_checkpointing=True))
%time trainer.train()""",
    """%%bash
ls -la /kaggle/working/out
du -sh /kaggle/working/out""",
    """if False:
    !pip install llama-cpp-python
    model.save_pretrained_gguf("gguf", tokenizer)
trainer.save_model("/kaggle/working/final")
display(trainer.state.log_history[-1])""",
)

notebook(
    "inference_tail",
    "md:# Train, then a long inference and plotting tail",
    """import torch, time
import matplotlib.pyplot as plt
from transformers import AutoModelForCausalLM, AutoTokenizer, TextStreamer
from trl import SFTTrainer, SFTConfig
from datasets import load_dataset
model = AutoModelForCausalLM.from_pretrained("Qwen/Qwen2.5-1.5B", device_map=None, torch_dtype="auto").to("cuda:0")
tokenizer = AutoTokenizer.from_pretrained("Qwen/Qwen2.5-1.5B")
data = load_dataset("openai/gsm8k", "main", split="train")""",
    """config = SFTConfig(output_dir="out", max_steps=20, logging_steps=1)
trainer = SFTTrainer(model=model, args=config, train_dataset=data.map(lambda x: {"text": x["question"] + x["answer"]}))
start = time.time()
trainer.train()
elapsed = time.time() - start""",
    """losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
plt.figure(figsize=(8, 4))
plt.plot(losses)
plt.xlabel("step")
plt.show()
print(f"trained in {elapsed:.0f}s")""",
    """questions = [data[i]["question"] for i in range(5)]
streamer = TextStreamer(tokenizer)
for q in questions:
    ids = tokenizer(q, return_tensors="pt").to(model.device)
    out = model.generate(**ids, max_new_tokens=100, streamer=streamer)
    print(tokenizer.decode(out[0]))""",
    """answers = []
with torch.no_grad():
    for q in questions:
        answers.append(tokenizer.decode(model.generate(**tokenizer(q, return_tensors="pt").to(model.device))[0]))
import json
with open("answers.json", "w") as f:
    json.dump(answers, f)""",
)

# ------------------------------------------------------------------------------------- plain PyTorch

notebook(
    "pytorch_image_cnn",
    "md:# Image classifier, competition style: a small CNN, AMP, a best-model checkpoint",
    """import time
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

SEED = 42
torch.manual_seed(SEED)
np.random.seed(SEED)
device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
use_amp = torch.cuda.is_available()
EPOCHS = 3
BATCH_SIZE = 32""",
    """# synthetic "images": the class is which quadrant is brightest
def make_images(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 1, 16, 16, generator=g) * 0.2
    y = torch.randint(0, 4, (n,), generator=g)
    for i, c in enumerate(y.tolist()):
        r, col = divmod(c, 2)
        x[i, 0, r * 8:(r + 1) * 8, col * 8:(col + 1) * 8] += 0.8
    return x, y

x_train, y_train = make_images(512, 0)
x_valid, y_valid = make_images(128, 1)
train_ds = TensorDataset(x_train, y_train)
valid_ds = TensorDataset(x_valid, y_valid)
train_loader = DataLoader(train_ds, batch_size=BATCH_SIZE, shuffle=True, drop_last=True)
valid_loader = DataLoader(valid_ds, batch_size=64, shuffle=False)""",
    """class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.fc = nn.Linear(16 * 4 * 4, 4)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc(x.flatten(1))

model = Net()
model = model.to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
criterion = nn.CrossEntropyLoss()
scaler = torch.cuda.amp.GradScaler(enabled=use_amp)""",
    """def evaluate(model, loader):
    model.eval()
    correct, total = 0, 0
    with torch.no_grad():
        for xb, yb in loader:
            xb, yb = xb.to(device), yb.to(device)
            correct += (model(xb).argmax(1) == yb).sum().item()
            total += len(yb)
    return correct / total""",
    """best_acc = 0.0
history = []
for epoch in range(EPOCHS):
    model.train()
    t0 = time.time()
    running = 0.0
    for step, (xb, yb) in enumerate(train_loader):
        xb, yb = xb.to(device), yb.to(device)
        optimizer.zero_grad()
        with torch.cuda.amp.autocast(enabled=use_amp):
            loss = criterion(model(xb), yb)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        running += loss.item()
    acc = evaluate(model, valid_loader)
    history.append(running / len(train_loader))
    print(f"epoch {epoch}: train loss {history[-1]:.4f}, valid acc {acc:.3f}, {time.time() - t0:.1f}s")
    if acc >= best_acc:
        best_acc = acc
        torch.save(model.state_dict(), "best_model.pt")""",
    """print(f"best valid accuracy {best_acc:.3f}")
torch.save(model.state_dict(), "final_model.pt")
model.load_state_dict(torch.load("best_model.pt"))
final_acc = evaluate(model, valid_loader)
print(f"reloaded best model: valid acc {final_acc:.3f}")
print(f"loss went from {history[0]:.4f} to {history[-1]:.4f}")""",
)

notebook(
    "pytorch_tabular_mlp",
    "md:# Tabular regression with an MLP and a `train_one_epoch` function",
    """import numpy as np
import pandas as pd
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

rng = np.random.default_rng(0)
df = pd.DataFrame(rng.normal(size=(600, 6)), columns=[f"f{i}" for i in range(6)])
df["target"] = df[["f0", "f1", "f2"]].sum(axis=1) * 2 + rng.normal(scale=0.1, size=600)
train_df, valid_df = df.iloc[:500], df.iloc[500:]
display(df.head())""",
    """class TabularDataset(Dataset):
    def __init__(self, frame):
        self.x = torch.tensor(frame.drop(columns="target").values, dtype=torch.float32)
        self.y = torch.tensor(frame["target"].values, dtype=torch.float32).unsqueeze(1)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]

train_dl = DataLoader(TabularDataset(train_df), batch_size=25, shuffle=True)
valid_dl = DataLoader(TabularDataset(valid_df), batch_size=100)""",
    """device = "cuda:0" if torch.cuda.is_available() else "cpu"
model = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 1))
model.to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
loss_fn = nn.MSELoss()""",
    """def train_one_epoch(model, loader):
    model.train()
    total = 0.0
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        loss = loss_fn(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        total += loss.item() * len(x)
    return total / len(loader.sampler)

def valid_loss(model, loader):
    model.eval()
    with torch.no_grad():
        return sum(loss_fn(model(x.to(device)), y.to(device)).item() * len(x) for x, y in loader) / len(loader.dataset)""",
    """log = []
for epoch in range(6):
    tr = train_one_epoch(model, train_dl)
    va = valid_loss(model, valid_dl)
    log.append((epoch, tr, va))
    print(f"{epoch:2d} train {tr:.4f} valid {va:.4f}")""",
    """results = pd.DataFrame(log, columns=["epoch", "train", "valid"])
print(results.to_string(index=False))
results.to_csv("log.csv", index=False)
torch.save(model, "mlp.pt")
print("first/last valid", results.valid.iloc[0], results.valid.iloc[-1])""",
)

notebook(
    "pytorch_kfold",
    "md:# K-fold cross-validation: a fresh model per fold",
    """import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset, Subset

torch.manual_seed(0)
X = torch.randn(300, 5)
y = (X[:, 0] + X[:, 1] > 0).long()
dataset = TensorDataset(X, y)
folds = torch.arange(300) % 3
device = torch.device("cuda:0") if torch.cuda.is_available() else torch.device("cpu")""",
    """scores = []
for fold in range(3):
    train_idx = (folds != fold).nonzero().flatten().tolist()
    valid_idx = (folds == fold).nonzero().flatten().tolist()
    train_loader = DataLoader(Subset(dataset, train_idx), batch_size=20, shuffle=True)
    valid_loader = DataLoader(Subset(dataset, valid_idx), batch_size=100)
    model = nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Linear(16, 2)).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for epoch in range(4):
        model.train()
        for xb, yb in train_loader:
            loss = nn.functional.cross_entropy(model(xb.to(device)), yb.to(device))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    model.eval()
    with torch.no_grad():
        acc = sum((model(xb.to(device)).argmax(1) == yb.to(device)).sum().item() for xb, yb in valid_loader) / len(valid_idx)
    scores.append(acc)
    print(f"fold {fold}: accuracy {acc:.3f}")
    torch.save(model.state_dict(), f"fold{fold}.pt")""",
    """print("mean accuracy", sum(scores) / len(scores))
import json
json.dump({"scores": scores}, open("cv.json", "w"))""",
)


def write_all(folder: Path = HERE) -> list[Path]:
    """Write every notebook (deterministic cell ids, so rewriting changes nothing that did not change)."""
    paths = []
    for name, cells in NOTEBOOKS.items():
        nb_cells = []
        for i, src in enumerate(cells):
            cell = nbformat.v4.new_markdown_cell(src[3:].strip()) if src.startswith("md:") else nbformat.v4.new_code_cell(src)
            cell["id"] = f"{name[:20]}-{i}"
            nb_cells.append(cell)
        nb = nbformat.v4.new_notebook(cells=nb_cells, metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}})
        nbformat.validate(nb)
        path = folder / f"{name}.ipynb"
        nbformat.write(nb, str(path))
        paths.append(path)
    return paths


if __name__ == "__main__":
    for p in write_all():
        print(p.relative_to(HERE.parent.parent))
