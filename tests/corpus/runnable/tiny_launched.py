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


def llama_bpe(folder: Path, vocab_size: int = 1024) -> None:
    """A 2-layer Llama (hidden 32) with a byte-level BPE tokenizer trained on fine-tune-llms-in-2025's own code
    cells and ``orca_math``'s rows, and a chat template: its system prompt is a few hundred tokens, so each
    conversation fits the recipe's 1024 whole (a character-level tokenizer would cut every one inside the
    shared system prompt, and every sample would read the same)."""
    import nbformat
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    notebook = nbformat.read(PUBLIC / "philschmid" / "fine-tune-llms-in-2025.ipynb", as_version=4)
    text = [c.source for c in notebook.cells if c.cell_type == "code"]
    text += [f"Ann has {a} apples and buys {b} more. She has {a} + {b} = {a + b} apples."
             for a in range(3, 12) for b in range(2, 9)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    tokenizer.chat_template = tiny.CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=1024,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(folder)


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
    ("model_name_or_path: Meta-Llama/Meta-Llama-3.1-8B", f"model_name_or_path: tiny/llama_bpe  {MARK} a tiny Llama"),
    ("tokenizer_name_or_path: Meta-Llama/Meta-Llama-3.1-8B-Instruct",
     f"tokenizer_name_or_path: tiny/llama_bpe  {MARK} its chat tokenizer"),
    ("torch_dtype: bfloat16", f"dtype: float32  {MARK} CPU training; torch_dtype is dtype in TRL 1"),
    ("attn_implementation: flash_attention_2", f"attn_implementation: sdpa  {MARK} flash-attn needs a GPU"),
    ("use_liger: true", f"use_liger_kernel: false  {MARK} liger-kernel needs a GPU (and is use_liger_kernel in TRL 1)"),
    ("bf16: true", f"bf16: false  {MARK} CPU training"),
    ("tf32: true", f"tf32: false  {MARK} CPU training"),
    ("max_seq_length: 1024", f"max_length: 1024  {MARK} max_seq_length is max_length in TRL 1"),
    ("load_in_4bit: true", f"load_in_4bit: false  {MARK} bitsandbytes needs a GPU"),
    ("learning_rate: 2.0e-4", f"learning_rate: 2.0e-3  {MARK} a random tiny model learns faster"),
    ("warmup_ratio: 0.1", f"warmup_steps: 0.1  {MARK} warmup_ratio is warmup_steps (a fraction) in transformers 5"),
    ("- tensorboard", f"- none  {MARK} tensorboard is not installed"),
    ("push_to_hub: true", f"push_to_hub: false  {MARK} no Hub offline"),
]


#: The files the builders below write next to the notebook → the published file each is made from.
PUBLISHED = {"scripts/run_sft.py": "philschmid/run_sft.py",
             "receipes/llama-3-1-8b-qlora.yaml": "philschmid/llama-3-1-8b-qlora.yaml",
             "scripts/merge_adapter_weights.py": "philschmid/merge_adapter_weights.py"}


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


tiny.BUILDERS.update(llama_bpe=llama_bpe, orca_math=orca_math, run_sft=run_sft, merge_adapter_weights=merge_adapter_weights)
