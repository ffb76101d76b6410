"""Write the papermill templates of this folder from the cells below, so that the three stay consistent.

    python templates/build.py            # rewrite templates/*.ipynb
    python templates/build.py --check    # exit 1 if a committed template differs from what this writes

Every template has the same shape:

1. a markdown cell: what it trains, how to run it;
2. the cell tagged ``parameters``: typed, commented values (``papermill --help-notebook`` lists them);
3. the training cells, tagged ``skip-execution``: nbclient (so papermill) leaves them out of the kernel, and
   nbddp runs them in every rank instead;
4. the launch cell, tagged ``nbddp-skip``: ``nbddp.template.run_template`` trains the cells above under torchrun
   with the kernel's parameter values. ``nbddp run`` and ``nbddp export`` leave this cell out.

So ``papermill`` → kernel (parameters, launch) → torchrun → one process per GPU (two gloo processes on CPU).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import nbformat

HERE = Path(__file__).resolve().parent
KERNELSPEC = {"name": "python3", "display_name": "Python 3", "language": "python"}

COMMANDS = (
    ("papermill --cwd templates templates/{name}.ipynb out.ipynb -p max_steps 200", "papermill (--help-notebook lists parameters)"),
    ("nbddp run templates/{name}.ipynb", "the nbddp CLI, defaults"),
    ("nbddp export templates/{name}.ipynb --kaggle kernel/ --id USER/{slug}", "a Kaggle Script on two T4s"),
)

HOW_TO_RUN = """
**Run it** (each process is one GPU; without GPUs, two CPU processes):

```bash
{commands}
```

In Jupyter or Kaggle, run the parameters cell, then the last cell: it trains the cells between them on every
GPU through torchrun. (Those cells are tagged `skip-execution`, which papermill honours; "Run All" in an
editor would also run them once in the notebook's own process.) The last cell reads this notebook's saved file.
"""


def parameters(output_dir: str, **overrides) -> str:
    """The parameters cell; ``overrides`` replace a default (value and comment) or add a parameter."""
    rows = {
        "model_name": ('""', 'Hugging Face model id or local folder; empty for nbddp\'s embedded tiny Llama (runs on CPU)'),
        "max_seq_length": ("32", "tokens per example; longer examples are cut"),
        "lora_r": ("16", "LoRA rank: the adapter's size"),
        "lora_alpha": ("32", "LoRA scale, usually 2 x lora_r"),
        "learning_rate": ("5e-3", "peak learning rate, decaying linearly to 0"),
        "max_steps": ("60", "optimizer steps"),
        "batch_size": ("16", "examples per process and step"),
        "nproc": ("0", "training processes; 0 means one per GPU (2 on a machine without GPUs)"),
        "strategy": ('"auto"', "auto (ddp where the model fits one GPU, else fsdp, else split), ddp, fsdp, split or deepspeed"),
        "data_path": ('""', 'JSON lines, CSV or Parquet file with a "text" column; empty for the embedded arithmetic sums'),
        "output_dir": (f'"{output_dir}"', "where rank 0 saves the result"),
        "precision": ('"auto"', "auto (bf16 where the GPU has it, fp16 on other GPUs, fp32 on CPU), bf16, fp16 or fp32"),
        "seed": ("3407", "random seed, the same on every process"),
    }
    rows.update(overrides)
    types = {"model_name": "str", "data_path": "str", "output_dir": "str", "precision": "str", "learning_rate": "float",
             "strategy": "str"}
    lines = ["# Parameters: papermill -p NAME VALUE overrides one; papermill --help-notebook lists them."]
    for name, (value, comment) in rows.items():
        assert "=" not in comment, "papermill skips a parameter line holding a second '='"
        kind = types.get(name) or ("bool" if value in ("True", "False") else "int")
        lines.append(f"{name}: {kind} = {value}  # {comment}")
    return "\n".join(lines)


PRECISION = '''\
# bf16 on GPUs that have it (A100, L4, H100), fp16 on the others (T4, P100), fp32 on CPU.
if precision == "auto":
    precision = ("bf16" if torch.cuda.is_bf16_supported(including_emulation=False) else "fp16") if torch.cuda.is_available() else "fp32"
dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[precision]
print(f"precision {precision}")'''

LOAD_DATA = '''\
def load_table(path):
    """A JSON lines, CSV or Parquet file as a datasets.Dataset."""
    kind = {"json": "json", "jsonl": "json", "csv": "csv", "parquet": "parquet"}[path.rsplit(".", 1)[-1].lower()]
    return load_dataset(kind, data_files=path, split="train")'''

SFT_DATA = LOAD_DATA + '''


dataset = load_table(data_path) if data_path else demo.arithmetic_dataset(1024, seed=seed)
print(dataset)
print(dataset[0]["text"])'''

SFT_TRAIN = '''\
training_args = SFTConfig(
    output_dir=output_dir,
    per_device_train_batch_size=batch_size,
    max_steps=max_steps,
    learning_rate=learning_rate,
    lr_scheduler_type="linear",
    warmup_steps=max(1, max_steps // 20),
    logging_steps=max(1, max_steps // 10),
    max_length=max_seq_length,
    bf16=precision == "bf16",
    fp16=precision == "fp16",
    use_cpu=not torch.cuda.is_available(),  # without GPUs, accelerate must be told to run DDP over CPU processes
    save_strategy="no",
    report_to="none",
    seed=seed,
)
trainer = SFTTrainer(model=model, args=training_args, train_dataset=dataset, processing_class=tokenizer)
trainer_stats = trainer.train()'''

SFT_SAVE = '''\
# After training nbddp runs the rest on rank 0 only: one save, one printout.
model.save_pretrained(output_dir)
tokenizer.save_pretrained(output_dir)
losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
print(f"{trainer.state.global_step} steps on {training_args.world_size} processes, loss {losses[0]:.3f} -> {losses[-1]:.3f}")
print(f"adapter saved to {output_dir}")'''


def launch(name: str) -> str:
    return f'''\
# Train the cells above on every GPU (two CPU processes without GPUs) through torchrun, with this kernel's
# parameter values. Rank 0's output streams here; every rank's log is kept under nbddp_runs/.
from nbddp.display import failure_report, summary
from nbddp.template import run_template

script, result = run_template("{name}.ipynb", globals(), nproc=nproc or None, strategy=strategy)
print(summary(result))
if not result.ok:
    raise RuntimeError(failure_report(result.failure) if result.failure else f"training failed: see {{result.run_dir}}")'''


TEMPLATES = {
    "sft_lora": dict(
        title="Supervised fine-tuning with LoRA (TRL `SFTTrainer`), on every GPU",
        intro="A LoRA adapter trained with TRL's `SFTTrainer` on a text dataset. With the defaults it trains "
              "nbddp's embedded tiny Llama on short sums in well under a minute, on CPU too.",
        parameters=parameters("outputs/sft_lora"),
        cells=[
            '''\
import torch
from datasets import load_dataset
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import SFTConfig, SFTTrainer

from nbddp import demo''',
            PRECISION,
            '''\
model_path = model_name or demo.tiny_model()
tokenizer = AutoTokenizer.from_pretrained(model_path)
if tokenizer.pad_token is None:
    tokenizer.pad_token = tokenizer.eos_token
model = AutoModelForCausalLM.from_pretrained(model_path, device_map="auto", dtype=dtype)
lora = LoraConfig(r=lora_r, lora_alpha=lora_alpha, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
model = get_peft_model(model, lora)
model.print_trainable_parameters()''',
            SFT_DATA,
            SFT_TRAIN,
            SFT_SAVE,
        ],
    ),
    "qlora_4bit": dict(
        title="QLoRA: a 4-bit base model with a LoRA adapter, on every GPU",
        intro="The base model's weights are loaded in 4 bits (bitsandbytes NF4) and a LoRA adapter trains on "
              "top. Where Unsloth is installed (and a GPU is there) its loader and LoRA are used, else "
              "transformers' with `BitsAndBytesConfig`. With the defaults it trains nbddp's embedded tiny "
              "Llama; bitsandbytes' 4-bit layers run on CPU too, so it runs anywhere.",
        parameters=parameters(
            "outputs/qlora_4bit",
            learning_rate=("2e-3", "peak learning rate, decaying linearly to 0"),
            load_in_4bit=("True", "4-bit NF4 base weights (QLoRA); False loads them in the precision below"),
        ),
        cells=[
            '''\
import importlib.util

import torch

# Unsloth wants to be imported before transformers, TRL and PEFT; it needs a GPU.
use_unsloth = importlib.util.find_spec("unsloth") is not None and torch.cuda.is_available()
if use_unsloth:
    from unsloth import FastLanguageModel

from datasets import load_dataset
from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig
from trl import SFTConfig, SFTTrainer

from nbddp import demo''',
            PRECISION,
            '''\
model_path = model_name or demo.tiny_model()
target_modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
if use_unsloth:
    model, tokenizer = FastLanguageModel.from_pretrained(
        model_path, max_seq_length=max_seq_length, dtype=dtype, load_in_4bit=load_in_4bit, device_map="auto"
    )
    model = FastLanguageModel.get_peft_model(
        model, r=lora_r, lora_alpha=lora_alpha, lora_dropout=0, target_modules=target_modules,
        use_gradient_checkpointing="unsloth", random_state=seed,
    )
else:
    quantization = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=dtype
    ) if load_in_4bit else None
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(
        model_path, device_map="auto", dtype=dtype, quantization_config=quantization
    )
    if load_in_4bit:
        model = prepare_model_for_kbit_training(model, gradient_checkpointing_kwargs={"use_reentrant": False})
    lora = LoraConfig(r=lora_r, lora_alpha=lora_alpha, lora_dropout=0.0, target_modules=target_modules, task_type="CAUSAL_LM")
    model = get_peft_model(model, lora)
if tokenizer.pad_token is None:
    tokenizer.pad_token = tokenizer.eos_token
four_bit = sum(type(m).__name__ == "Linear4bit" for m in model.modules())
print(f"{'Unsloth' if use_unsloth else 'transformers'} loader, {four_bit} linear layers in 4 bits")
model.print_trainable_parameters()''',
            SFT_DATA,
            SFT_TRAIN,
            SFT_SAVE,
        ],
    ),
    "torch_classifier": dict(
        title="A classifier trained by a plain PyTorch loop (DDP, LoRA), on every GPU",
        intro="No Trainer: a sequence classifier (a LoRA adapter and a new head on a causal LM) trained by a "
              "hand-written loop with `DistributedDataParallel` and a `DistributedSampler`. nbddp has already "
              "joined every process to the process group; run alone, the same code is one process. With the "
              "defaults it learns whether a sum of two numbers reaches 50 with nbddp's embedded tiny Llama.",
        parameters=parameters(
            "outputs/torch_classifier",
            max_seq_length=("16", "tokens per example; longer examples are cut"),
            lora_r=("8", "LoRA rank: the adapter's size"),
            lora_alpha=("16", "LoRA scale, usually 2 x lora_r"),
            learning_rate=("2e-3", "peak learning rate, decaying linearly to 0"),
            max_steps=("40", "optimizer steps"),
            batch_size=("32", "examples per process and step"),
            data_path=('""', 'JSON lines, CSV or Parquet file with "text" and "label" (0/1) columns; empty for the embedded sums'),
        ),
        cells=[
            '''\
import torch
import torch.distributed as dist
from datasets import load_dataset
from peft import LoraConfig, get_peft_model
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from nbddp import demo''',
            '''\
distributed = dist.is_available() and dist.is_initialized()
rank, world_size = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
torch.manual_seed(seed)
''' + PRECISION,
            '''\
model_path = model_name or demo.tiny_model()
tokenizer = AutoTokenizer.from_pretrained(model_path)
if tokenizer.pad_token is None:
    tokenizer.pad_token = tokenizer.eos_token
model = AutoModelForSequenceClassification.from_pretrained(model_path, num_labels=2, dtype=torch.float32)
model.config.pad_token_id = tokenizer.pad_token_id
lora = LoraConfig(r=lora_r, lora_alpha=lora_alpha, lora_dropout=0.0, target_modules="all-linear", task_type="SEQ_CLS")
model = get_peft_model(model, lora).to(device)
model.print_trainable_parameters()
# Each process holds the whole model; DDP averages the gradients of the trainable weights after each backward.
ddp_model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None) if distributed else model''',
            LOAD_DATA + '''


if data_path:
    rows = load_table(data_path).to_list()
else:  # "12+47=" → 1: does the sum reach 50?
    rows = [{"text": r["prompt"], "label": int(int(r["completion"]) >= 50)} for r in demo.arithmetic_examples(2048, seed=seed)]


def collate(batch):
    enc = tokenizer([r["text"] for r in batch], padding=True, truncation=True, max_length=max_seq_length, return_tensors="pt")
    enc["labels"] = torch.tensor([int(r["label"]) for r in batch])
    return enc


# Each process reads its own share of the rows, reshuffled every epoch.
sampler = DistributedSampler(rows, num_replicas=world_size, rank=rank, shuffle=True, seed=seed)
loader = DataLoader(rows, batch_size=batch_size, sampler=sampler, collate_fn=collate, drop_last=True)
print(f"{len(rows)} rows, {len(loader)} batches per process and epoch")''',
            '''\
optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=learning_rate)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: max(0.0, 1 - s / max_steps))
scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
ddp_model.train()
step, epoch, losses = 0, 0, []
while step < max_steps:
    sampler.set_epoch(epoch)
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        with torch.autocast(device.type, dtype=dtype, enabled=precision != "fp32"):
            loss = ddp_model(**batch).loss
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        losses.append(loss.item())
        if rank == 0 and (step % max(1, max_steps // 10) == 0 or step == max_steps):
            print(f"step {step}/{max_steps}  loss {loss.item():.4f}", flush=True)
        if step == max_steps:
            break
    epoch += 1
print(f"rank {rank}/{world_size}: {step} steps, {step * batch_size} examples, mean loss {sum(losses) / len(losses):.4f}", flush=True)''',
            '''\
if rank == 0:  # one process saves
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    print(f"adapter and classifier head saved to {output_dir}")''',
        ],
    ),
}


def commands(name: str) -> str:
    """The ways to run a template, comments aligned."""
    lines = [(cmd.format(name=name, slug=name.replace("_", "-")), why) for cmd, why in COMMANDS]
    width = max(len(cmd) for cmd, _ in lines)
    return "\n".join(f"{cmd.ljust(width)}   # {why}" for cmd, why in lines)


def build(name: str) -> nbformat.NotebookNode:
    """One template as a notebook, with fixed cell ids so that rebuilding gives the same file."""
    spec = TEMPLATES[name]
    slug = name.replace("_", "-")
    cells = [
        nbformat.v4.new_markdown_cell(f"# {spec['title']}\n\n{spec['intro']}\n" + HOW_TO_RUN.format(commands=commands(name))),
        nbformat.v4.new_code_cell(spec["parameters"], metadata={"tags": ["parameters"]}),
        nbformat.v4.new_markdown_cell("## Training: these cells run in every process (tag `skip-execution`: not in this kernel)"),
    ]
    cells += [nbformat.v4.new_code_cell(src, metadata={"tags": ["skip-execution"]}) for src in spec["cells"]]
    cells += [
        nbformat.v4.new_markdown_cell("## Launch"),
        nbformat.v4.new_code_cell(launch(name), metadata={"tags": ["nbddp-skip"]}),
    ]
    for k, cell in enumerate(cells):
        cell.id = f"{slug}-{k:02d}"
    nb = nbformat.v4.new_notebook(cells=cells, metadata={"kernelspec": KERNELSPEC, "language_info": {"name": "python"}})
    nbformat.validate(nb)
    return nb


def render(name: str) -> str:
    return nbformat.writes(build(name)) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="compare with the committed templates; write nothing")
    p.add_argument("--out", type=Path, default=HERE, help="folder to write into (default: this one)")
    args = p.parse_args(argv)
    stale = []
    for name in TEMPLATES:
        path = args.out / f"{name}.ipynb"
        text = render(name)
        if args.check:
            if not path.exists() or path.read_text(encoding="utf-8") != text:
                stale.append(path.name)
        else:
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path}")
    if stale:
        print(f"out of date (run python templates/build.py): {', '.join(stale)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
