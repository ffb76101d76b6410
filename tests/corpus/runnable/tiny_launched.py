"""Tiny local stand-ins for the runnable notebooks whose training is a command they launch (``launched/``).

Beside ``tiny.py``'s models and data sets, such a notebook needs the files its shell lines run: the
published training script and recipe (``tests/corpus/public/``), put where the notebook's command looks for
them, with the few lines that need a GPU, the Hub or an older library replaced. Each replaced line ends with
``# nbddp-offline: <why>``, as in the notebooks. Importing this module adds its builders to ``tiny.BUILDERS``.
"""

from __future__ import annotations

from pathlib import Path

import tiny

PUBLIC = Path(__file__).resolve().parent.parent / "public"
MARK = "# nbddp-offline:"


def orca_math(folder: Path, n: int = 32) -> None:
    """microsoft/orca-math-word-problems-200k's columns (question, answer): short arithmetic word problems."""
    from datasets import Dataset, DatasetDict

    rows = {"question": [], "answer": []}
    for i in range(n):
        a, b = 3 + i % 9, 2 + i % 7
        rows["question"].append(f"Ann has {a} apples and buys {b} more. How many apples does she have?")
        rows["answer"].append(f"She has {a} + {b} = {a + b} apples. The answer is {a + b}.")
    DatasetDict({"train": Dataset.from_dict(rows)}).save_to_disk(str(folder))


def edited(source: str, edits: list[tuple[str, str]]) -> str:
    """``source`` with each published line ``old`` (found once, whole, indent kept) replaced by ``new``."""
    lines = source.split("\n")
    for old, new in edits:
        hits = [i for i, line in enumerate(lines) if line.strip() == old.strip()]
        assert len(hits) == 1, (old, hits)
        indent = lines[hits[0]][: len(lines[hits[0]]) - len(lines[hits[0]].lstrip())]
        lines[hits[0]] = indent + new
    return "\n".join(lines)


#: run_sft.py (fine-tune-llms-in-2025's training script, written for transformers 4.46 and TRL 0.12): the
#: lines the libraries of this test environment (transformers 5, TRL 1) renamed or removed.
RUN_SFT = [
    ("torch_dtype=model_args.torch_dtype if model_args.torch_dtype in ['auto', None] else getattr(torch, "
     "model_args.torch_dtype), # What torch dtype to use, defaults to auto",
     "torch_dtype=model_args.dtype if model_args.dtype in ['auto', None] else getattr(torch, model_args.dtype),  "
     f"{MARK} ModelConfig's torch_dtype is dtype in TRL 1"),
    ("trust_remote_code=model_args.trust_remote_code,",
     f"trust_remote_code=False,  {MARK} ModelConfig's trust_remote_code left TRL 1 (the tokenizer's)"),
    ("trust_remote_code=model_args.trust_remote_code, # Whether to trust the remote code, this also you to fine-tune "
     "custom architectures",
     f"trust_remote_code=False,  {MARK} ModelConfig's trust_remote_code left TRL 1 (the model's)"),
    ("if training_args.use_liger:",
     f"if training_args.use_liger_kernel:  {MARK} SFTConfig's use_liger is use_liger_kernel in TRL 1"),
    ("train_dataset = train_dataset.select(range(10000))",
     f"train_dataset = train_dataset.select(range(min(10000, len(train_dataset))))  {MARK} the tiny data set "
     "has fewer than 10000 rows"),
    ("tokenizer=tokenizer,",
     f"processing_class=tokenizer,  {MARK} SFTTrainer's tokenizer= is processing_class= in TRL 1"),
]
#: ``training_args.distributed_state`` (accelerate's PartialState) left TrainingArguments in transformers 5;
#: the script calls it twice, each line replaced alike.
WAIT = ("training_args.distributed_state.wait_for_everyone()  # wait for all processes to load",
        f"__import__('accelerate').PartialState().wait_for_everyone()  {MARK} TrainingArguments.distributed_state "
        "(accelerate's PartialState) left transformers 5")

#: The QLoRA recipe for an 8B Llama on GPUs, pointed at the tiny Llama on a CPU.
RECIPE = [
    ("model_name_or_path: Meta-Llama/Meta-Llama-3.1-8B", f"model_name_or_path: tiny/llama_chat  {MARK} a tiny Llama"),
    ("tokenizer_name_or_path: Meta-Llama/Meta-Llama-3.1-8B-Instruct",
     f"tokenizer_name_or_path: tiny/llama_chat  {MARK} its chat tokenizer"),
    ("torch_dtype: bfloat16", f"dtype: float32  {MARK} CPU training; torch_dtype is dtype in TRL 1"),
    ("attn_implementation: flash_attention_2", f"attn_implementation: sdpa  {MARK} flash-attn needs a GPU"),
    ("use_liger: true", f"use_liger_kernel: false  {MARK} liger-kernel needs a GPU (and is use_liger_kernel in TRL 1)"),
    ("bf16: true", f"bf16: false  {MARK} CPU training"),
    ("tf32: true", f"tf32: false  {MARK} CPU training"),
    ("max_seq_length: 1024", f"max_length: 2048  {MARK} max_seq_length is max_length in TRL 1; the tiny Llama's "
     "tokens are characters, and the notebook's system prompt alone is 1700 of them"),
    ("load_in_4bit: true", f"load_in_4bit: false  {MARK} bitsandbytes needs a GPU"),
    ("learning_rate: 2.0e-4", f"learning_rate: 2.0e-3  {MARK} a random tiny model learns faster"),
    ("warmup_ratio: 0.1", f"warmup_steps: 0.1  {MARK} warmup_ratio is warmup_steps (a fraction) in transformers 5"),
    ("- tensorboard", f"- none  {MARK} tensorboard is not installed"),
    ("push_to_hub: true", f"push_to_hub: false  {MARK} no Hub offline"),
]


def run_sft(folder: Path) -> None:
    """``scripts/run_sft.py`` and ``receipes/llama-3-1-8b-qlora.yaml`` next to the notebook, edited as above."""
    root = folder.parent.parent
    (root / "scripts").mkdir(exist_ok=True)
    (root / "receipes").mkdir(exist_ok=True)
    script = (PUBLIC / "philschmid" / "run_sft.py").read_text()
    assert script.count(WAIT[0]) == 2
    script = script.replace(WAIT[0], WAIT[1])
    (root / "scripts" / "run_sft.py").write_text(edited(script, RUN_SFT))
    recipe = (PUBLIC / "philschmid" / "llama-3-1-8b-qlora.yaml").read_text()
    (root / "receipes" / "llama-3-1-8b-qlora.yaml").write_text(edited(recipe, RECIPE))


def merge_adapter_weights(folder: Path) -> None:
    """``scripts/merge_adapter_weights.py`` (the notebook's post step) as published."""
    root = folder.parent.parent
    (root / "scripts").mkdir(exist_ok=True)
    (root / "scripts" / "merge_adapter_weights.py").write_bytes(
        (PUBLIC / "philschmid" / "merge_adapter_weights.py").read_bytes())


tiny.BUILDERS.update(orca_math=orca_math, run_sft=run_sft, merge_adapter_weights=merge_adapter_weights)
