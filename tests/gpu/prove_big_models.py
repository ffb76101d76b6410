"""GPU proof: a model bigger than one GPU trains under ``--strategy auto`` (FSDP) and ``split``, where DDP runs
out of memory. As on Kaggle's 2×T4: every process capped at 15 GiB a GPU
(``torch.cuda.set_per_process_memory_fraction``), ``NCCL_P2P_DISABLE=1``, fp16.

The model is a real architecture with random weights: Llama 3 8B's shape (8.03B parameters) in fp16,
written once to ``$NBDDP_CACHE/random-llama-8b`` (16 GB on disk), trained with LoRA r=16 on q/k/v/o over
sequences of a repeating pattern (so the loss falls). The notebook is written here and run three ways with
``nbddp run``:

  ddp    ``--strategy ddp``: expected to fail with CUDA out of memory (the baseline)
  auto   ``--strategy auto``: the estimate must pick fsdp; trains, loss falls, adapter saved once
  split  ``--strategy split``: one process over both GPUs; trains, loss falls

For each it prints (and writes to ``--out`` as a markdown table) the strategy chosen, the peak memory of
every GPU of every rank, tokens a second and the first and last loss. Exit code 0 when all three behave
as expected.

    python tests/gpu/prove_big_models.py [--cap-gib 15] [--steps 12] [--seq 512] [--out benchmarks/results/big-models.md]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

LLAMA_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                rope_theta=500000.0, tie_word_embeddings=False)

CELLS = [
    # the cap, in every rank, on the GPUs the process drives: its own (ddp, fsdp) or every one (split)
    """import os, torch
CAP_GIB = {cap}
one_rank_of_many = int(os.environ.get("WORLD_SIZE", "1")) > 1
for i in ([int(os.environ["LOCAL_RANK"])] if one_rank_of_many else range(torch.cuda.device_count())):
    torch.cuda.set_per_process_memory_fraction(min(1.0, CAP_GIB * 2**30 / torch.cuda.get_device_properties(i).total_memory), i)""",
    """from transformers import AutoModelForCausalLM, Trainer, TrainingArguments, TrainerCallback
from peft import LoraConfig, get_peft_model
from datasets import Dataset
model_path = "{model}"
model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float16)
model = get_peft_model(model, LoraConfig(r=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], task_type="CAUSAL_LM"))""",
    """SEQ = {seq}
rows = [[(start + 7 * j) % 512 + 1000 for j in range(SEQ)] for start in range(256)]
data = Dataset.from_dict({{"input_ids": rows, "labels": rows}})""",
    """import json, time
import torch.distributed as dist

class Peaks(TrainerCallback):
    # every rank's peak per GPU, gathered to rank 0 (whose output the launcher shows)
    def on_train_begin(self, args, state, control, **kw):
        self.t0 = time.time()
    def on_train_end(self, args, state, control, **kw):
        peaks = {{f"cuda:{{i}}": round(torch.cuda.max_memory_allocated(i) / 2**30, 2) for i in range(torch.cuda.device_count())
                 if torch.cuda.max_memory_allocated(i)}}
        ranks = [None] * dist.get_world_size() if dist.is_initialized() and dist.get_world_size() > 1 else [peaks]
        if len(ranks) > 1:
            dist.all_gather_object(ranks, peaks)
        tokens = state.global_step * args.per_device_train_batch_size * SEQ * len(ranks)
        print("PEAKS " + json.dumps({{"ranks": ranks, "tokens_per_s": tokens / (time.time() - self.t0)}}), flush=True)

args = TrainingArguments(output_dir="out", per_device_train_batch_size=1, max_steps={steps}, learning_rate=1e-3,
                         fp16=True, gradient_checkpointing=True, logging_steps=1, save_strategy="no", report_to="none")
trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[Peaks()])
trainer.train()""",
    """trainer.save_model("adapter")
print("adapter saved to adapter")""",
]


def write_model(folder: Path) -> Path:
    """Llama 3 8B's shape with random weights, fp16, written once."""
    if (folder / "config.json").exists():
        return folder
    code = f"""
import torch
from transformers import LlamaConfig, LlamaForCausalLM
config = LlamaConfig(**{LLAMA_8B!r}, torch_dtype="float16")
torch.manual_seed(0)
with torch.device("cuda"):
    model = LlamaForCausalLM(config).half()
model.save_pretrained({str(folder)!r})
"""
    subprocess.run([sys.executable, "-c", code], check=True)
    return folder


def write_notebook(work: Path, model: Path, cap: float, steps: int, seq: int) -> Path:
    import nbformat

    cells = [c.format(cap=cap, model=model, steps=steps, seq=seq) for c in CELLS]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    path = work / "big_model.ipynb"
    nbformat.write(nb, path)
    return path


def run(notebook: Path, strategy: str, cap: float) -> dict:
    env = {**os.environ, "NCCL_P2P_DISABLE": "1", "NBDDP_GPU_MEMORY_GIB": str(cap)}
    adapter = notebook.parent / "adapter" / "adapter_model.safetensors"
    adapter.unlink(missing_ok=True)
    runs = notebook.parent / "runs" / strategy  # each run's records apart: a run that ran out of memory early
    # writes no losses, and must not be given another's
    proc = subprocess.run([sys.executable, "-m", "nbddp.cli", "run", str(notebook), "--strategy", strategy,
                           "--skip-installs", "--runs-dir", str(runs)],
                          cwd=notebook.parent, env=env, capture_output=True, text=True, timeout=1800)
    text = proc.stdout + proc.stderr
    (notebook.parent / f"{strategy}.log").write_text(text)
    chosen = re.search(r"nbddp: strategy (\w+)", text)
    peaks = re.search(r"PEAKS (\{.*\})", text)
    losses = trainer_losses(runs) or [float(x) for x in re.findall(r"'loss': '?([\d.]+)", text)]
    return {
        "strategy": strategy, "chosen": chosen.group(1) if chosen else "ddp", "exit": proc.returncode,
        "oom": "OutOfMemoryError" in text or "CUDA out of memory" in text,
        "peaks": json.loads(peaks.group(1)) if peaks else None, "losses": losses,
        "adapter_saves": text.count("adapter saved to adapter"), "adapter": adapter.exists(),
        "estimate": "\n".join(l for l in text.splitlines() if l.startswith("nbddp: ") and ("memory per GPU" in l or "strategy" in l)),
        "error": next((l for l in text.splitlines() if "OutOfMemoryError" in l or "out of memory" in l), ""),
    }


def trainer_losses(runs: Path) -> list[float]:
    """The losses the Trainer logged in the newest run directory under ``runs``: rank 0's ``log`` events in its
    ``metrics.jsonl`` (the terminal shows a progress line in place of the Trainer's printed log dictionaries);
    none where that run wrote none (it ran out of memory before its first log), never an older run's."""
    newest = max((d for d in runs.glob("*") if d.is_dir()), key=lambda d: d.stat().st_mtime, default=None)
    metrics = newest / "metrics.jsonl" if newest is not None else None
    if metrics is None or not metrics.is_file():
        return []
    events = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return [float(e["loss"]) for e in events if e.get("event") == "log" and "loss" in e]


def verdict(r: dict) -> list[str]:
    """What went other than expected for this run (empty: as expected)."""
    if r["strategy"] == "ddp":
        return [] if r["exit"] and r["oom"] else [f"expected out of memory under DDP, got exit {r['exit']}"]
    wrong = []
    if r["exit"]:
        wrong.append(f"exit code {r['exit']}")
    if r["strategy"] == "auto" and r["chosen"] != "fsdp":
        wrong.append(f"auto chose {r['chosen']}, not fsdp")
    if len(r["losses"]) < 2 or not r["losses"][-1] < r["losses"][0]:
        wrong.append(f"loss did not fall: {r['losses']}")
    if not r["adapter"] or r["adapter_saves"] != 1:
        wrong.append(f"adapter saved {r['adapter_saves']} time(s), file there: {r['adapter']}")
    return wrong


def table(results: list[dict], cap: float, steps: int, seq: int) -> str:
    lines = [f"# Models bigger than one GPU: Llama 3 8B shape (random weights), fp16 + LoRA r=16, {cap:g} GiB a GPU",
             "", f"`python tests/gpu/prove_big_models.py --cap-gib {cap:g} --steps {steps} --seq {seq}`, "
             "`NCCL_P2P_DISABLE=1`, batch 1 a rank, gradient checkpointing.", "",
             "| --strategy | ran as | outcome | peak GiB per rank (GPU) | tokens/s | loss first → last |",
             "|---|---|---|---|---|---|"]
    for r in results:
        peaks = "; ".join(f"rank {i}: " + ", ".join(f"{d} {g}" for d, g in p.items())
                          for i, p in enumerate((r["peaks"] or {}).get("ranks", []))) or "-"
        speed = f"{r['peaks']['tokens_per_s']:.0f}" if r["peaks"] else "-"
        loss = f"{r['losses'][0]:.3f} → {r['losses'][-1]:.3f}" if len(r["losses"]) > 1 else "-"
        outcome = "out of memory" if r["oom"] and r["exit"] else ("trained" if not r["exit"] else f"exit {r['exit']}")
        lines.append(f"| {r['strategy']} | {r['chosen']} | {outcome} | {peaks} | {speed} | {loss} |")
    lines += ["", "What `auto` printed:", "", "```", *(r["estimate"] for r in results if r["strategy"] == "auto"), "```"]
    lines += ["", "The DDP baseline's error:", "", "```", *(r["error"][:400] for r in results if r["strategy"] == "ddp"), "```"]
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cap-gib", type=float, default=15.0)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--only", choices=("ddp", "auto", "split"), action="append")
    p.add_argument("--out", type=Path, help="write the markdown table here (e.g. benchmarks/results/big-models.md)")
    args = p.parse_args()
    cache = Path(os.environ.get("NBDDP_CACHE") or Path.home() / ".cache" / "nbddp")
    model = write_model(cache / "random-llama-8b")
    work = Path(tempfile.mkdtemp(prefix="nbddp-big-"))
    notebook = write_notebook(work, model, args.cap_gib, args.steps, args.seq)
    results, failed = [], False
    for strategy in args.only or ("ddp", "auto", "split"):
        r = run(notebook, strategy, args.cap_gib)
        wrong = verdict(r)
        failed |= bool(wrong)
        print(f"{'FAIL' if wrong else 'PASS'} {strategy}: ran as {r['chosen']}, exit {r['exit']}, "
              f"peaks {r['peaks']}, losses {r['losses'][:1]}…{r['losses'][-1:]} {'; '.join(wrong)}", flush=True)
        results.append(r)
    text = table(results, args.cap_gib, args.steps, args.seq)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    print(f"logs in {work}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
