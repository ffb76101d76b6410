"""How close ``nbddp.choose_strategy``'s memory estimate comes to the peak a real GPU shows, per job shape.

    python benchmarks/memory_estimate.py measure --out DIR     # on a GPU machine: one process per shape
    python benchmarks/memory_estimate.py report DIR            # here: the estimates beside the peaks

``auto`` picks DDP, FSDP or split from an estimate made before launch (``choose_strategy.estimate``); a wrong
estimate sends a job that fits to a slower strategy, or one that does not fit to an out-of-memory error.
This measures, on one GPU, the peak of a Trainer + PEFT job (real architectures' shapes, random weights
made on the GPU, fixed-length random tokens, 4 steps of AdamW) for each shape in ``SHAPES`` and compares it
with the estimate for that shape. The peak counted is what a GPU must hold: the allocator's peak reservation
plus the CUDA context (the device's used memory at the end less the reservation then), as
``choose_strategy.OVERHEAD_BYTES`` stands for.

Each shape runs in a process of its own, so the peaks do not mix; ``measure`` writes ``peaks.jsonl``,
``report`` writes ``memory_estimate.md`` beside it (and ``--commit`` under ``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: Public configurations' sizes (their ``config.json``), written out: nothing is downloaded.
MODELS = {
    "Qwen2.5-0.5B": dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                         tie_word_embeddings=True),
    "Llama-3.2-1B": dict(model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
                         tie_word_embeddings=True),
    "Llama-3.1-8B": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                         tie_word_embeddings=False),
}

ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

#: name → (model, bits, LoRA r or None for a full fine-tune, LoRA targets, batch, sequence, checkpointing)
SHAPES = {
    "qwen0.5b-lora": ("Qwen2.5-0.5B", 16, 16, ALL_LINEAR, 4, 512, False),
    "qwen0.5b-full": ("Qwen2.5-0.5B", 16, None, None, 4, 512, False),
    "llama1b-lora-qv-ckpt": ("Llama-3.2-1B", 16, 16, ("q_proj", "v_proj"), 4, 1024, True),
    "llama1b-4bit-lora-ckpt": ("Llama-3.2-1B", 4, 16, ALL_LINEAR, 4, 1024, True),
    "llama8b-lora-ckpt": ("Llama-3.1-8B", 16, 16, ALL_LINEAR, 2, 1024, True),
    "llama8b-lora": ("Llama-3.1-8B", 16, 16, ALL_LINEAR, 1, 1024, False),
}

#: name → (model, batch, sequence): Unsloth's QLoRA as its notebooks write it (4-bit, LoRA r=16 on every linear
#: layer, ``use_gradient_checkpointing="unsloth"``), rows of the notebooks' ``max_seq_length``.
UNSLOTH_SHAPES = {
    "unsloth-qwen0.5b-4bit": ("Qwen2.5-0.5B", 2, 2048),
    "unsloth-llama1b-4bit": ("Llama-3.2-1B", 2, 2048),
    "unsloth-llama8b-4bit": ("Llama-3.1-8B", 2, 2048),
}

STEPS = 4


# ---- on the GPU ------------------------------------------------------------------------------------------


def _model(name: str, bits: int):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, BitsAndBytesConfig

    sizes = dict(MODELS[name])
    config = AutoConfig.for_model(sizes.pop("model_type"), **sizes, torch_dtype="bfloat16")
    torch.manual_seed(0)
    if bits == 16:
        with torch.device("cuda"):
            return AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    folder = f"/tmp/memory-estimate-{name}"  # bitsandbytes quantizes while loading: save the weights first
    if not os.path.exists(f"{folder}/config.json"):
        with torch.device("cuda"):
            AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16).save_pretrained(folder)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)
    return AutoModelForCausalLM.from_pretrained(folder, quantization_config=quant, device_map={"": 0},
                                                torch_dtype=torch.bfloat16)


def _unsloth_model(name: str, seq: int):
    """Unsloth's loader on a saved random-weight folder (with a tokenizer: Unsloth loads one), 4-bit, and its
    LoRA with its own checkpointing, as the Kaggle notebooks call them."""
    from unsloth import FastLanguageModel  # first, as Unsloth asks: it patches transformers as it loads

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = f"/tmp/memory-estimate-{name}"
    if not os.path.exists(f"{folder}/tokenizer_config.json"):
        import varlen_workload

        sizes = dict(MODELS[name])
        config = AutoConfig.for_model(sizes.pop("model_type"), **sizes, torch_dtype="bfloat16")
        torch.manual_seed(0)
        with torch.device("cuda"):
            AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16).save_pretrained(folder)
        varlen_workload.tokenizer(MODELS[name]["vocab_size"]).save_pretrained(folder)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    model, _ = FastLanguageModel.from_pretrained(model_name=folder, max_seq_length=seq, load_in_4bit=True)
    return FastLanguageModel.get_peft_model(model, r=16, target_modules=list(ALL_LINEAR), lora_alpha=16,
                                            lora_dropout=0, use_gradient_checkpointing="unsloth")


def measure_one(shape: str) -> dict:
    """Train ``STEPS`` steps of one shape and return its peaks (bytes)."""
    if shape in UNSLOTH_SHAPES:
        name, batch, seq = UNSLOTH_SHAPES[shape]
        model, ckpt = _unsloth_model(name, seq), False  # Unsloth checkpoints by itself
    else:
        name, bits, r, targets, batch, seq, ckpt = SHAPES[shape]
        model = _model_with_adapter(name, bits, r, targets, ckpt)
    return _train_and_measure(shape, model, MODELS[name]["vocab_size"], batch, seq, ckpt)


def _model_with_adapter(name: str, bits: int, r: int | None, targets, ckpt: bool):
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    model = _model(name, bits)
    if bits < 16:
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=ckpt)
    if r:
        model = get_peft_model(model, LoraConfig(r=r, lora_alpha=2 * r, target_modules=list(targets),
                                                 task_type="CAUSAL_LM"))
    return model


def _train_and_measure(shape: str, model, vocab: int, batch: int, seq: int, ckpt: bool) -> dict:
    import torch
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    ids = torch.randint(0, vocab, (batch * STEPS, seq)).tolist()
    data = Dataset.from_dict({"input_ids": ids, "labels": ids})
    args = TrainingArguments(output_dir=f"/tmp/memory-estimate-out-{shape}", per_device_train_batch_size=batch,
                             max_steps=STEPS, bf16=True, gradient_checkpointing=ckpt, optim="adamw_torch",
                             gradient_checkpointing_kwargs={"use_reentrant": False}, logging_steps=1,
                             save_strategy="no", report_to=[], learning_rate=1e-4)
    start = time.perf_counter()
    Trainer(model=model, args=args, train_dataset=data).train()
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    context = (total - free) - torch.cuda.memory_reserved()
    return {"shape": shape, "allocated": torch.cuda.max_memory_allocated(),
            "reserved": torch.cuda.max_memory_reserved(), "context": context,
            "peak": torch.cuda.max_memory_reserved() + context, "seconds": round(time.perf_counter() - start, 1),
            "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}


def measure(out: Path, shapes: list[str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for shape in shapes:
        proc = subprocess.run([sys.executable, __file__, "one", shape], capture_output=True, text=True)
        with open(out / "measure.log", "a") as log:  # one file: a device call brings back few
            log.write(f"==== {shape} (rc {proc.returncode})\n{proc.stdout[-8000:]}{proc.stderr[-8000:]}\n")
        line = next((ln for ln in reversed(proc.stdout.splitlines()) if ln.startswith("{")), None)
        record = json.loads(line) if proc.returncode == 0 and line else {"shape": shape, "error": proc.stderr[-600:]}
        with open(out / "peaks.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        print(json.dumps(record), flush=True)


# ---- here: the estimates -----------------------------------------------------------------------------------


def estimate_for(shape: str):
    from nbddp.choose_strategy import JobShape, estimate

    if shape in UNSLOTH_SHAPES:
        name, batch, seq = UNSLOTH_SHAPES[shape]
        job = JobShape(model=name, unsloth=True, dtype="bfloat16", bits=4, lora_r=16, lora_targets=ALL_LINEAR,
                       batch=batch, seq_len=seq, checkpointing=True, offloaded=True)
        return estimate(job, dict(MODELS[name], torch_dtype="bfloat16"), world=2)
    name, bits, r, targets, batch, seq, ckpt = SHAPES[shape]
    config = dict(MODELS[name], torch_dtype="bfloat16")
    job = JobShape(model=name, dtype="bfloat16", bits=bits, lora_r=r, lora_targets=targets, batch=batch,
                   seq_len=seq, checkpointing=ckpt, upcast=bits < 16)  # measure_one prepares k-bit models
    return estimate(job, config, world=2)


def report(folder: Path, commit: bool) -> str:
    records = [json.loads(ln) for ln in (folder / "peaks.jsonl").read_text().splitlines() if ln.strip()]
    gib = 2**30
    rows = ["| shape | measured peak | estimate (DDP rank) | estimate ÷ peak | parts of the estimate |",
            "|---|---:|---:|---:|---|"]
    for rec in records:
        if "error" in rec:
            rows.append(f"| {rec['shape']} | failed: {rec['error'].splitlines()[-1][:80]} | | | |")
            continue
        est = estimate_for(rec["shape"])
        parts = ", ".join(f"{k} {v / gib:.2f}" for k, v in est.parts.items() if v)
        rows.append(f"| {rec['shape']} | {rec['peak'] / gib:.2f} GiB | {est.ddp / gib:.2f} GiB | "
                    f"{est.ddp / rec['peak']:.2f} | {parts} |")
    gpu = next((r.get("gpu") for r in records if "gpu" in r), "?")
    text = ("# The memory estimate against measured peaks\n\n"
            f"`benchmarks/memory_estimate.py`, one call on one {gpu} (torch "
            f"{next((r.get('torch') for r in records if 'torch' in r), '?')}), {STEPS} Trainer steps per shape, "
            "bf16, AdamW, fixed-length random tokens, random weights; peak = the allocator's peak reservation + "
            "the CUDA context. Shapes: `SHAPES` in the script (model, bits, LoRA r, targets, batch, sequence, "
            "checkpointing).\n\n" + "\n".join(rows) + "\n")
    (folder / "memory_estimate.md").write_text(text)
    if commit:
        (ROOT / "benchmarks" / "results" / "memory_estimate.md").write_text(text)
    return text


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    m = sub.add_parser("measure")
    m.add_argument("--out", type=Path, required=True)
    m.add_argument("--shape", action="append", choices=sorted({**SHAPES, **UNSLOTH_SHAPES}),
                   help="default: every shape but Unsloth's (they need Unsloth installed)")
    o = sub.add_parser("one")
    o.add_argument("shape", choices=sorted({**SHAPES, **UNSLOTH_SHAPES}))
    r = sub.add_parser("report")
    r.add_argument("folder", type=Path)
    r.add_argument("--commit", action="store_true", help="also write benchmarks/results/memory_estimate.md")
    args = p.parse_args(argv)
    if args.what == "measure":
        measure(args.out, args.shape or list(SHAPES))
    elif args.what == "one":
        print(json.dumps(measure_one(args.shape)), flush=True)
    else:
        print(report(args.folder, args.commit))


if __name__ == "__main__":
    main()
