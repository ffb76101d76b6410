"""The GPU scaling workload, shared by every configuration of ``scaling.py`` so they train the same thing.

A Llama-shaped 1.1B model with random weights (hidden 2048, 16 layers, 32 heads, 8 KV heads, intermediate
5632), LoRA r=16 on all linear layers, sequences of 1024 random tokens, batch 4 per GPU, gradient
checkpointing on, bf16 (or fp16 with ``BENCH_DTYPE=fp16``). ``BENCH_STEPS`` steps; throughput is timed
from step ``BENCH_WARMUP`` to the last with the GPU synchronised at both ends.

Used three ways:
- ``python gpu_workload.py handwritten`` under torchrun: the hand-written recipe people paste into a script
  (process group, ``device_map={"": local_rank}``, ``ddp_find_unused_parameters=False``, non-reentrant
  checkpointing), or on one GPU without torchrun;
- ``python gpu_workload.py device_map_auto``: one process, the model split over every GPU;
- imported by the notebook cells nbddp converts (``notebook_cells()``) and by accelerate's
  ``notebook_launcher`` (``train(...)``).
Each process writes ``$BENCH_OUT.rank<N>.json``: tokens/s (rank 0), step losses, peak memory.
"""

from __future__ import annotations

import json
import os
import sys
import time

SEQ = int(os.environ.get("BENCH_SEQ", 1024))
BATCH = int(os.environ.get("BENCH_BATCH", 4))
STEPS = int(os.environ.get("BENCH_STEPS", 60))
WARMUP = int(os.environ.get("BENCH_WARMUP", 10))
DTYPE = os.environ.get("BENCH_DTYPE", "bf16")
LAYERS = int(os.environ.get("BENCH_LAYERS", 16))


CHECKPOINT = os.environ.get("BENCH_CHECKPOINT", "/tmp/bench-llama-1.1b")


def prepare_checkpoint(path: str = CHECKPOINT) -> str:
    """Save the random-weight model once, so every configuration loads it with ``from_pretrained``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if os.path.exists(os.path.join(path, "config.json")):
        return path
    config = LlamaConfig(
        vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=LAYERS,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096,
    )
    torch.manual_seed(0)
    with torch.device("cuda:0"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    return path


def torch_dtype():
    import torch

    return torch.bfloat16 if DTYPE == "bf16" else torch.float16


def lora_config():
    from peft import LoraConfig

    return LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, task_type="CAUSAL_LM",
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])


def build_model(device_map):
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(CHECKPOINT, device_map=device_map, dtype=torch_dtype())
    return get_peft_model(model, lora_config())


def dataset(n: int):
    import torch
    from datasets import Dataset

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 32000, (n, SEQ), generator=g).tolist()
    return Dataset.from_dict({"input_ids": ids, "labels": ids})


def training_args(output_dir: str, **extra):
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=output_dir, per_device_train_batch_size=BATCH, max_steps=STEPS, learning_rate=2e-4,
        logging_steps=5, save_strategy="no", report_to="none", bf16=DTYPE == "bf16", fp16=DTYPE == "fp16",
        gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False},
        dataloader_drop_last=True, seed=0, **extra,
    )


def timing_callback():
    """Times steps WARMUP..STEPS on rank 0 and records every rank's losses and peak memory."""
    import torch
    from transformers import TrainerCallback

    class Timing(TrainerCallback):
        def __init__(self):
            self.t0 = self.t1 = None
            self.losses = []
            self.profile = None

        def on_step_begin(self, args, state, control, **kw):
            if os.environ.get("BENCH_PROFILE") and state.global_step == WARMUP + PROFILE_FROM:
                torch.cuda.synchronize()
                self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
                self.prof.__enter__()

        def on_step_end(self, args, state, control, **kw):
            if getattr(self, "prof", None) is not None and state.global_step == WARMUP + PROFILE_FROM + PROFILE_STEPS:
                torch.cuda.synchronize()
                self.prof.__exit__(None, None, None)
                self.profile = gpu_time(self.prof, PROFILE_STEPS)
                print(f"rank {os.environ.get('RANK', 0)} profile: {json.dumps(self.profile)}", flush=True)
                self.prof = None
            if state.global_step in (WARMUP, STEPS):
                torch.cuda.synchronize()
                if state.global_step == WARMUP:
                    self.t0 = time.perf_counter()
                else:
                    self.t1 = time.perf_counter()

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                self.losses.append([state.global_step, float(logs["loss"])])

        def on_train_end(self, args, state, control, **kw):
            rank = int(os.environ.get("RANK", 0))
            world = int(os.environ.get("WORLD_SIZE", 1))
            steps = STEPS - WARMUP
            out = {
                "rank": rank, "world_size": world,
                "seconds": self.t1 - self.t0,
                "tokens_per_s": steps * BATCH * SEQ * world / (self.t1 - self.t0),
                "step_ms": 1000 * (self.t1 - self.t0) / steps,
                "losses": self.losses,
                "profile": self.profile,
                "peak_mem_gib": max(torch.cuda.max_memory_allocated(d) for d in range(torch.cuda.device_count())) / 2**30
                if world == 1 else torch.cuda.max_memory_allocated() / 2**30,
            }
            path = os.environ.get("BENCH_OUT")
            if path:
                with open(f"{path}.rank{rank}.json", "w") as fh:
                    json.dump(out, fh)

    return Timing()


PROFILE_FROM, PROFILE_STEPS = 5, 10  # with BENCH_PROFILE=1: steps WARMUP+5 .. WARMUP+15, kept out of the timing


def merged(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(a, b) for a, b in out]


def gpu_time(prof, steps: int) -> dict:
    """Where the GPU's time went over the profiled steps, in ms per step, from the kernels' own timeline.

    ``busy``: any kernel or copy running; ``nccl_exposed``: only communication running (what DDP costs the
    GPU beyond overlapped all-reduce); ``idle``: nothing running (waiting for the CPU or for the other rank);
    ``nccl_total``: all communication kernels, overlapped or not.
    """
    import torch

    every, compute, nccl = [], [], []
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        span = (e.time_range.start, e.time_range.end)
        every.append(span)
        (nccl if "nccl" in e.name.lower() else compute).append(span)
    if not every:
        return {}
    length = lambda spans: sum(b - a for a, b in merged(spans))  # noqa: E731
    window = max(b for _, b in every) - min(a for a, _ in every)
    busy, compute_busy = length(every), length(compute)
    per_step = lambda us: round(us / steps / 1000, 2)  # noqa: E731
    return {"window": per_step(window), "busy": per_step(busy), "compute": per_step(compute_busy),
            "nccl_exposed": per_step(busy - compute_busy), "nccl_total": per_step(length(nccl)),
            "idle": per_step(window - busy)}


def train(device_map, output_dir="/tmp/bench-out", **extra):
    from transformers import Trainer

    model = build_model(device_map)
    trainer = Trainer(model=model, args=training_args(output_dir, **extra), train_dataset=dataset(BATCH * STEPS * 8),
                      callbacks=[timing_callback()])
    trainer.train()
    return trainer


def handwritten():
    """The recipe people write by hand for torchrun (also runs as one process on one GPU).

    ``BENCH_KNOBS`` (JSON) adds DDP options for exploring defaults: TrainingArguments fields
    (``ddp_broadcast_buffers``, ``ddp_bucket_cap_mb``, ``ddp_static_graph``, ``average_tokens_across_devices``)
    and ``comm_hook: "bf16"|"fp16"``, ``gradient_as_bucket_view: true`` applied when DDP is built.
    """
    import torch
    import torch.distributed as dist

    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    if int(os.environ.get("WORLD_SIZE", 1)) > 1:
        dist.init_process_group("nccl")
    shims = os.environ.get("BENCH_SHIMS")
    if shims:  # nbddp's runtime shims, by name, in the hand-written recipe (e.g. on one GPU)
        from nbddp.runtime.shims import apply_all

        apply_all(names=tuple(shims.split(",")))
    knobs = json.loads(os.environ.get("BENCH_KNOBS", "{}"))
    _patch_ddp(knobs.pop("comm_hook", None), knobs.pop("gradient_as_bucket_view", None))
    train({"": local}, ddp_find_unused_parameters=False, **knobs)
    if dist.is_initialized():
        dist.destroy_process_group()


def _patch_ddp(comm_hook, as_view):
    if not comm_hook and not as_view:
        return
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    init = DDP.__init__

    def patched(self, *a, **kw):
        if as_view:
            kw["gradient_as_bucket_view"] = True
        init(self, *a, **kw)
        if comm_hook:
            hook = default_hooks.bf16_compress_hook if comm_hook == "bf16" else default_hooks.fp16_compress_hook
            self.register_comm_hook(None, hook)

    DDP.__init__ = patched


def launcher_fn():
    import torch

    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    train({"": local}, ddp_find_unused_parameters=False)


#: The notebook nbddp converts: what a Kaggle user writes (device_map="auto", checkpointing, no DDP code).
NOTEBOOK_CELLS = [
    "import os, sys\nsys.path.insert(0, os.environ['BENCH_DIR'])\n"
    "import torch\nfrom peft import get_peft_model\nfrom transformers import AutoModelForCausalLM, Trainer, TrainingArguments\n"
    "import gpu_workload as w",
    'model = AutoModelForCausalLM.from_pretrained(w.CHECKPOINT, device_map="auto", dtype=w.torch_dtype())\n'
    "model = get_peft_model(model, w.lora_config())",
    "args = TrainingArguments(\n"
    '    output_dir="/tmp/bench-nbddp",\n'
    "    per_device_train_batch_size=w.BATCH,\n"
    "    max_steps=w.STEPS,\n"
    "    learning_rate=2e-4,\n"
    "    logging_steps=5,\n"
    '    save_strategy="no",\n'
    '    report_to="none",\n'
    '    bf16=w.DTYPE == "bf16",\n'
    '    fp16=w.DTYPE == "fp16",\n'
    "    gradient_checkpointing=True,\n"
    "    dataloader_drop_last=True,\n"
    "    seed=0,\n"
    ")\n"
    "trainer = Trainer(model=model, args=args, train_dataset=w.dataset(w.BATCH * w.STEPS * 8), callbacks=[w.timing_callback()])",
    "trainer.train()",
    'print("done")',
]


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "handwritten":
        handwritten()
    elif mode == "device_map_auto":
        train("balanced")
    elif mode == "prepare":
        print(prepare_checkpoint())
    else:
        raise SystemExit(f"unknown mode {mode}")
