"""The variable-length workload of ``varlen.py``, shared by every configuration so they train the same thing.

Model: the Qwen2.5-0.5B shape (hidden 896, 24 layers, 14 heads, 2 KV heads, intermediate 4864, vocabulary
151 936, tied embeddings) with random weights, built and saved locally once (``prepare``), with a byte-level BPE
tokenizer of Qwen2's class (``tokenizer``) so Unsloth can load the folder and read text rows too. LoRA r=16 on every linear layer,
gradient checkpointing, batch 2 per device and 4 accumulation steps (the Unsloth Kaggle notebooks'
settings), lr 2e-4, bf16 (``BENCH_DTYPE=fp16`` for the Kaggle-like set), padded per micro-batch to its
longest row, loss on every real token.

Lengths (tokens per row, prompt template included) follow Alpaca as the public Unsloth Kaggle Alpaca
notebooks format it (``alpaca_prompt`` + EOS): drawn from the empirical percentiles that
``alpaca_lengths.py`` measured and ``results/alpaca_lengths.json`` holds (inverse CDF, linear between the
101 percentiles), cut to 8 … ``MAXLEN`` (2048). Measured on 2,000 Alpaca rows (the full 52,002-row file
could not be had; 37.7 % with an input, the datasheet says about 40 %) in characters, converted at 4
characters a token plus BOS and EOS (no Llama tokenizer was available): mean 143 tokens, median 124,
5th percentile 73, 95th 269, 99th 380, longest 696. The fixed template (~60 tokens) sets a floor, so the
spread is narrower than answers alone suggest (log-normal fit: mu 4.86, sigma 0.44).
Why Alpaca: it is what the public Unsloth and Kaggle fine-tuning notebooks train on, the workload of the
figures this benchmark is compared with.

``BENCH_TINY=1`` swaps in a 2-layer, 64-wide model with a 1 000-token vocabulary and lengths divided by 8
(a CPU smoke run); ``BENCH_CPU=1`` trains on the CPU (gloo under torchrun).

Used as the notebook's module (``NOTEBOOK_CELLS``, ``UNSLOTH_CELLS``) and as the hand-written recipe
(``python varlen_workload.py handwritten`` under torchrun). Each run's rank 0 writes
``$BENCH_OUT.rank0.json``: real tokens/s over every rank (padding not counted), padded tokens/s, step time,
each optimizer step's spread of real tokens between ranks, the wait per step from the profiler, losses,
peak memory per rank.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import random
import string
import sys
import time

CPU = os.environ.get("BENCH_CPU") == "1"
TINY = os.environ.get("BENCH_TINY") == "1"
BATCH = int(os.environ.get("BENCH_BATCH", 2))
ACCUM = int(os.environ.get("BENCH_ACCUM", 4))
WARMUP = int(os.environ.get("BENCH_WARMUP", 3 if TINY else 8))
TIMED = int(os.environ.get("BENCH_TIMED", 4 if TINY else 40))
PROFILED = int(os.environ.get("BENCH_PROFILED", 2 if TINY else 8))  # after the timed steps, kept out of them
STEPS = WARMUP + TIMED + PROFILED
DTYPE = "fp32" if CPU else os.environ.get("BENCH_DTYPE", "bf16")
MAXLEN = 256 if TINY else 2048
LENGTHS_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "alpaca_lengths.json")
CHECKPOINT = os.environ.get("BENCH_CHECKPOINT", "/tmp/bench-varlen-tiny" if TINY else "/tmp/bench-qwen2-0.5b")

QWEN2_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rope_theta=1e6,
                 tie_word_embeddings=True, rms_norm_eps=1e-6)
TINY_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=1000, max_position_embeddings=512, tie_word_embeddings=True)

WORDS = 4000  # distinct words of the Unsloth proof's text rows

#: (real tokens, padded tokens) of every micro-batch this process collated, in order.
COLLATED: list[tuple[int, int]] = []


def token_percentiles(path: str = LENGTHS_FILE) -> list[float]:
    """The 0th..100th percentile of Alpaca's formatted row lengths in tokens (``alpaca_lengths.py``)."""
    with open(path) as fh:
        return json.load(fh)["token_percentiles"]


def draw_length(percentiles: list[float], u: float) -> float:
    """The length at cumulative share ``u`` (0..1): linear between the two percentiles around it."""
    pos = u * (len(percentiles) - 1)
    lo = min(int(pos), len(percentiles) - 2)
    return percentiles[lo] + (percentiles[lo + 1] - percentiles[lo]) * (pos - lo)


def lengths(n: int, seed: int = 1) -> list[int]:
    rng = random.Random(seed)
    scale = 8 if TINY else 1
    table = token_percentiles()
    return [min(MAXLEN, max(8, round(draw_length(table, rng.random()) / scale))) for _ in range(n)]


def prepare_checkpoint(path: str = CHECKPOINT) -> str:
    """Save the random-weight model and a tokenizer once, for ``from_pretrained`` (and Unsloth) to load."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if os.path.exists(os.path.join(path, "config.json")):
        return path
    shape = TINY_SHAPE if TINY else QWEN2_05B
    config = Qwen2Config(**shape, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(torch.float32 if CPU else torch.bfloat16)
    model.save_pretrained(path)
    tokenizer(shape["vocab_size"]).save_pretrained(path)
    return path


#: Letters-only words (``aaa``, ``aab``, …): each one token of ``tokenizer``'s, with or without a space before it.
def words(n: int) -> list[str]:
    out = []
    for size in itertools.count(3):
        for letters in itertools.product(string.ascii_lowercase, repeat=size):
            out.append("".join(letters))
            if len(out) == n:
                return out


def tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer of the model's own class (``Qwen2Tokenizer``), trained by ``tokenizers`` on
    the Alpaca prompt and ``words``. Why its own class: transformers 5 loads a Qwen2 folder's tokenizer as
    ``Qwen2Tokenizer`` whatever ``tokenizer_config.json`` names, rebuilding it from the vocabulary and merges; a
    word-level tokenizer came back reading every text as the bare EOS, so a model trained on text rows saw
    nothing (loss 0)."""
    import json as _json

    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX, Qwen2Tokenizer

    from alpaca_lengths import ALPACA_PROMPT

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    vocabulary = words(min(WORDS, vocab_size // 8))
    lines = [" " + " ".join(vocabulary[i:i + 50]) for i in range(0, len(vocabulary), 50)]  # each after a space
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=1, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train_from_iterator([ALPACA_PROMPT.format("", "", ""), *lines, "\n".join(vocabulary)], trainer)
    merges = [tuple(m) for m in _json.loads(bpe.to_str())["model"]["merges"]]
    return Qwen2Tokenizer(vocab=bpe.get_vocab(), merges=merges, unk_token=None, bos_token="<s>", eos_token="</s>",
                          pad_token="<pad>", model_max_length=MAXLEN)


def gpu_name() -> str:
    """``2 × NVIDIA H200``, as the results name the machine (``unknown GPU`` where nvidia-smi cannot say)."""
    import subprocess

    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30).stdout.split("\n")
    except (OSError, subprocess.SubprocessError):
        return "unknown GPU"
    names = [n.strip() for n in out if n.strip()]
    return f"{len(names)} × {names[0]}" if names else "unknown GPU"


def torch_dtype():
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(DTYPE, torch.float32)


def cap_memory() -> None:
    """``BENCH_MEM_GIB``: this process may use at most that much of its GPU (a Kaggle T4 has 15 GiB)."""
    import torch

    gib = os.environ.get("BENCH_MEM_GIB")
    if gib and torch.cuda.is_available():
        device = int(os.environ.get("LOCAL_RANK", 0))
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, float(gib) * 2**30 / total), device)


def lora_config():
    from peft import LoraConfig

    return LoraConfig(r=16, lora_alpha=16, lora_dropout=0.0, task_type="CAUSAL_LM",
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])


def dataset():
    """Enough rows for every configuration's steps on 2 ranks, each of its drawn length, random token ids."""
    from datasets import Dataset

    n = BATCH * ACCUM * 2 * STEPS
    rng = random.Random(2)
    vocab = (TINY_SHAPE if TINY else QWEN2_05B)["vocab_size"]
    return Dataset.from_dict({"input_ids": [[rng.randrange(4, vocab) for _ in range(k)] for k in lengths(n)]})


def collator():
    """Pad each micro-batch to its longest row (labels -100 there); note its real and padded tokens."""
    import torch

    def collate(rows):
        ids = [r["input_ids"] for r in rows]
        longest = max(len(x) for x in ids)
        COLLATED.append((sum(len(x) for x in ids), longest * len(ids)))
        pad = lambda x, v: list(x) + [v] * (longest - len(x))  # noqa: E731
        return {"input_ids": torch.tensor([pad(x, 0) for x in ids]),
                "attention_mask": torch.tensor([[1] * len(x) + [0] * (longest - len(x)) for x in ids]),
                "labels": torch.tensor([pad(x, -100) for x in ids])}

    return collate


def training_args(output_dir: str, **extra):
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=output_dir, per_device_train_batch_size=BATCH, gradient_accumulation_steps=ACCUM,
        max_steps=STEPS, learning_rate=2e-4, logging_steps=1, save_strategy="no", report_to="none",
        bf16=DTYPE == "bf16", fp16=DTYPE == "fp16", gradient_checkpointing=True, seed=0, use_cpu=CPU,
        dataloader_drop_last=True, **extra)


def torchrun_device_map():
    """Where the notebook's code under torchrun puts its model, as the HF docs say to (one GPU per process)."""
    from accelerate import PartialState

    return "cpu" if CPU else {"": PartialState().local_process_index}


def timing_callback():
    """Times steps WARMUP..WARMUP+TIMED, profiles the PROFILED steps after, and has rank 0 write the record."""
    from transformers import TrainerCallback

    class Timing(TrainerCallback):
        def __init__(self):
            self.t0 = self.t1 = None
            self.losses, self.prof, self.wait_ms = [], None, None

        def on_step_end(self, args, state, control, **kw):
            step = state.global_step
            if step in (WARMUP, WARMUP + TIMED):
                synchronize()
                now = time.perf_counter()
                if step == WARMUP:
                    self.t0 = now
                else:
                    self.t1 = now
                    self.prof = start_profile()
            if step == STEPS and self.prof is not None:
                self.wait_ms = stop_profile(self.prof, PROFILED)
                self.prof = None

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                self.losses.append([state.global_step, float(logs["loss"])])

        def on_train_end(self, args, state, control, **kw):
            write_record(self.t1 - self.t0, self.losses, self.wait_ms)

    return Timing()


def synchronize() -> None:
    import torch

    if torch.cuda.is_available() and not CPU:
        torch.cuda.synchronize()


def start_profile():
    import torch

    synchronize()
    activity = torch.profiler.ProfilerActivity.CPU if CPU else torch.profiler.ProfilerActivity.CUDA
    prof = torch.profiler.profile(activities=[activity])
    prof.__enter__()
    return prof


def stop_profile(prof, steps: int) -> float:
    """Milliseconds per step this rank waited on communication: on GPUs the NCCL time no compute overlaps
    (``gpu_workload.gpu_time``; a rank that drew fewer tokens waits there for the other); on the CPU the
    time in gloo's all-reduce calls (a rough stand-in, for the smoke run)."""
    synchronize()
    prof.__exit__(None, None, None)
    if not CPU:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from gpu_workload import gpu_time

        return gpu_time(prof, steps).get("nccl_exposed", 0.0)
    spans = [e for e in prof.events() if "allreduce" in e.name.lower().replace("_", "")]
    return sum(e.cpu_time_total for e in spans) / 1000 / steps


def step_tokens(kind: int) -> list[int]:
    """Tokens (0: real, 1: padded) of each timed optimizer step on this rank."""
    window = COLLATED[WARMUP * ACCUM:(WARMUP + TIMED) * ACCUM]
    return [sum(mb[kind] for mb in window[i:i + ACCUM]) for i in range(0, len(window), ACCUM)]


def write_record(seconds: float, losses, wait_ms) -> None:
    import torch
    import torch.distributed as dist

    mine = {"real": step_tokens(0), "padded": step_tokens(1), "wait_ms": wait_ms,
            "peak_mem_gib": 0.0 if CPU else torch.cuda.max_memory_allocated() / 2**30}
    ranks = [mine]
    if dist.is_available() and dist.is_initialized():
        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, mine)
    rank = int(os.environ.get("RANK", 0))
    path = os.environ.get("BENCH_OUT")
    if rank != 0 or not path:
        return
    steps = list(zip(*(r["real"] for r in ranks)))  # each timed step: every rank's real tokens
    real = [sum(step) for step in steps]
    spread = [(max(s) - min(s)) / (sum(s) / len(s)) for s in steps] or [0.0]
    waits = [r["wait_ms"] for r in ranks if r["wait_ms"] is not None]
    out = {
        "rank": 0, "world_size": len(ranks), "seconds": seconds,
        "tokens_per_s": sum(real) / seconds,
        "padded_tokens_per_s": sum(sum(r["padded"]) for r in ranks) / seconds,
        "step_ms": 1000 * seconds / TIMED,
        "token_spread": sum(spread) / len(spread),
        "wait_ms": sum(waits) / len(waits) if waits else None, "wait_ms_per_rank": waits,
        "losses": losses, "peak_mem_gib": [r["peak_mem_gib"] for r in ranks],
    }
    with open(f"{path}.rank0.json", "w") as fh:
        json.dump(out, fh)


def train(device_map, output_dir="/tmp/bench-varlen-out", **extra):
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM, Trainer

    cap_memory()
    model = AutoModelForCausalLM.from_pretrained(CHECKPOINT, device_map=device_map, dtype=torch_dtype())
    model = get_peft_model(model, lora_config())
    trainer = Trainer(model=model, args=training_args(output_dir, **extra), train_dataset=dataset(),
                      data_collator=collator(), callbacks=[timing_callback()])
    trainer.train()


def handwritten() -> None:
    """The recipe people write by hand for torchrun: a process group, one device per process,
    ``ddp_find_unused_parameters=False``, non-reentrant checkpointing; the Trainer's own sampler."""
    import torch
    import torch.distributed as dist

    local = int(os.environ.get("LOCAL_RANK", 0))
    if not CPU:
        torch.cuda.set_device(local)
    if int(os.environ.get("WORLD_SIZE", 1)) > 1:
        dist.init_process_group("gloo" if CPU else "nccl")
    train("cpu" if CPU else {"": local}, ddp_find_unused_parameters=False,
          gradient_checkpointing_kwargs={"use_reentrant": False})
    if dist.is_initialized():
        dist.destroy_process_group()


_HEAD = ("import os, sys\nsys.path.insert(0, os.environ['BENCH_DIR'])\n"
         "import torch\nfrom peft import get_peft_model\n"
         "from transformers import AutoModelForCausalLM, Trainer, TrainingArguments\n"
         "import varlen_workload as w\nw.cap_memory()")
_TRAIN = [
    "args = TrainingArguments(\n"
    '    output_dir="/tmp/bench-varlen-nb",\n'
    "    per_device_train_batch_size=w.BATCH,\n"
    "    gradient_accumulation_steps=w.ACCUM,\n"
    "    max_steps=w.STEPS,\n"
    "    learning_rate=2e-4,\n"
    "    logging_steps=1,\n"
    '    save_strategy="no",\n'
    '    report_to="none",\n'
    '    bf16=w.DTYPE == "bf16",\n'
    '    fp16=w.DTYPE == "fp16",\n'
    "    gradient_checkpointing=True,\n"
    "    dataloader_drop_last=True,\n"
    "    use_cpu=w.CPU,\n"
    "    seed=0,\n"
    ")\n"
    "trainer = Trainer(model=model, args=args, train_dataset=w.dataset(), data_collator=w.collator(),\n"
    "                  callbacks=[w.timing_callback()])",
    "trainer.train()",
    'print("done")',
]

#: The notebook as a Kaggle user writes it for the HF Trainer + PEFT: device_map="auto", no DDP code.
NOTEBOOK_CELLS = [
    _HEAD,
    'model = AutoModelForCausalLM.from_pretrained(w.CHECKPOINT, device_map="auto", dtype=w.torch_dtype())\n'
    "model = get_peft_model(model, w.lora_config())",
    *_TRAIN,
]

#: The same notebook the Unsloth way (Unsloth imported first, its loader and LoRA helper).
UNSLOTH_CELLS = [
    "from unsloth import FastLanguageModel\n" + _HEAD,
    "model, tokenizer = FastLanguageModel.from_pretrained(model_name=w.CHECKPOINT, max_seq_length=w.MAXLEN,\n"
    "                                                     dtype=w.torch_dtype(), load_in_4bit=False)\n"
    "model = FastLanguageModel.get_peft_model(model, r=16, lora_alpha=16, lora_dropout=0, bias='none',\n"
    "    target_modules=['q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', 'up_proj', 'down_proj'],\n"
    "    use_gradient_checkpointing='unsloth', random_state=3407)",
    *_TRAIN,
]


def script_under_torchrun(cells: list[str]) -> str:
    """The notebook's code as a plain script for torchrun: Unsloth places each process's model itself; the HF
    route needs the one change the HF docs give (one device per process instead of ``device_map="auto"``)."""
    text = "\n\n".join(cells)
    return text.replace('device_map="auto"', "device_map=w.torchrun_device_map()")


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "handwritten":
        handwritten()
    elif mode == "prepare":
        print(prepare_checkpoint())
    else:
        raise SystemExit(f"unknown mode {mode}")
