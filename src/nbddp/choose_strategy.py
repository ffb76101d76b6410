"""Which way to spread a job over the GPUs, from what its script loads and how it trains.

``decide(shape, cwd, requested)`` takes what the converter read from the script (``Script.shape``,
``convert/facts/shape.py``; ``ast``, no import of the user's libraries): the model it loads (the id or
folder given to a loader's ``from_pretrained``; its ``config.json`` from the folder or the Hugging Face
cache, never the network), the dtype and 4/8-bit quantization, the LoRA rank and target modules, the
per-device batch size, the sequence length and gradient checkpointing. ``estimate`` turns these into the bytes one rank needs under each strategy, and
``choose`` picks for ``auto``: DDP where one GPU holds a whole replica, else FSDP (weights, gradients and
optimizer states sharded over the ranks), else split (one process, the model's layers spread over every
GPU). The ``Decision`` says what it picked and why (``summary()``).

The model's sizes are read as transformers reads them (``model_config``: its config class and
``attribute_map``); a model whose sizes cannot be read is of unknown size, and any other slip on the way
falls back (``decide``).

Light on purpose: nothing here imports torch; the GPUs' free memory comes from a child process, so the
kernel never initialises CUDA (transformers' configuration module, imported for a config.json, imports
torch where it is installed, which initialises nothing).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable
from pathlib import Path

from .convert.facts.shape import JobShape, ShapeUnread, read_shape
from .errors import NbddpError, printable
from .gpus import cap_free, read_machine
from .model_config import Dims, SizeUnknown, read_json
from .options import STRATEGIES

GiB = 2**30
#: What a GPU keeps for itself beyond the tensors: the CUDA context, the allocator's slack, NCCL's buffers.
OVERHEAD_BYTES = int(0.9 * GiB)
#: The share of a GPU's free memory the estimate may fill: estimates are rough, out-of-memory is costly.
HEADROOM = 0.9

_DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2, "float64": 8}
#: Optimizers whose two states take 2 bytes a parameter instead of 8.
_EIGHT_BIT_OPTIM = ("8bit", "bnb")


@dataclass(frozen=True)
class Estimate:
    """Bytes one rank needs, and how they add up (``parts``: name → bytes for a DDP rank)."""

    params: int
    trainable: int
    ddp: int
    fsdp: int  # per rank, sharded over ``world`` ranks
    split_total: int  # all GPUs together, one process
    world: int
    parts: dict[str, int] = field(default_factory=dict)
    source: str = ""
    predicting: bool = False  # sized for a notebook that only predicts: FSDP is no choice for it


@dataclass(frozen=True)
class Decision:
    """The strategy a job runs with, why, and the estimate behind it (None where the size was unknown)."""

    strategy: str
    reason: str
    requested: str = "auto"
    estimate: Estimate | None = None
    gpu_free: tuple[int, ...] = ()
    notes: tuple[str, ...] = ()
    fallback: str = ""  # why nbddp could not decide and fell back to DDP (then always said)

    def summary(self) -> str:
        lines = [f"nbddp: strategy {self.strategy}" + ("" if self.requested == self.strategy else
                                                       f" ({self.requested} chose it)") + f": {self.reason}"]
        e = self.estimate
        if e:
            parts = ", ".join(f"{name} {_gib(n)}" for name, n in e.parts.items() if n)
            fsdp = "" if e.predicting else f"fsdp over {e.world} {_gib(e.fsdp)}; "
            lines.append(f"nbddp: memory per GPU: ddp {_gib(e.ddp)} ({parts}); {fsdp}"
                         f"split {_gib(e.split_total)} in all ({e.source})")
        if self.gpu_free:
            lines.append(f"nbddp: GPUs: {len(self.gpu_free)}, smallest free {_gib(min(self.gpu_free))}")
        lines += [f"nbddp: {note}" for note in self.notes]
        return "\n".join(lines)


def _gib(n: int) -> str:
    return f"{n / GiB:.1f} GiB"


# ---- the model's size ------------------------------------------------------------------------------------


def read_config(model: str, cwd: str | os.PathLike | None = None) -> dict | None:
    """The model's ``config.json``: from its folder, else from the Hugging Face cache; None when neither has it,
    ``SizeUnknown`` when it is there but not readable.

    Never reaches the network: a hub id not in the cache stays unknown.
    """
    try:
        local = Path(cwd or ".") / model / "config.json"
        found = local.is_file()
    except (OSError, ValueError):  # a name no file can have (a NUL byte, too long)
        return None
    if found:
        return read_json(local)
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        cached = try_to_load_from_cache(model, "config.json")
    except Exception:  # not a repository id (a path that does not exist, a malformed name)
        return None
    return read_json(Path(cached)) if isinstance(cached, str) else None


def estimate(shape: JobShape, config: dict, world: int, predicting: bool = False) -> Estimate:
    """Bytes per rank under DDP and FSDP (over ``world`` ranks), and in all under split; ``predicting``: a
    notebook that only predicts (``_inference``)."""
    dims = Dims.of(config)
    dtype = shape.dtype if shape.dtype not in (None, "auto") else dims.dtype
    width = _DTYPE_BYTES.get(dtype.replace("torch.", ""), 2)
    linear, other = dims.params()
    weight_width = {4: 0.5 + 0.04, 8: 1.0 + 0.03}.get(shape.bits, width)  # bnb's scales add a little
    # bitsandbytes leaves embeddings, head and norms unquantized; prepare_model_for_kbit_training casts them to fp32
    weights = int(linear * weight_width + other * (4 if shape.upcast and shape.bits < 16 else width))
    params = linear + other
    source = f"{params / 1e9:.2f}B parameters, {dtype}" + (f", {shape.bits}-bit" if shape.bits < 16 else "")
    if predicting:
        return _inference(dims, shape, weights, width, params, world, source)
    if shape.lora_r:
        trainable = dims.lora_params(shape.lora_r, shape.lora_targets)
        train_width = 4  # PEFT keeps adapters in fp32
    else:
        trainable, train_width = params, width
    # AdamW's two states in the parameter's dtype (fp32 adapters: 8 bytes; a bf16 full fine-tune: 4)
    optim_width = 2 if any(s in shape.optim for s in _EIGHT_BIT_OPTIM) else 2 * train_width
    adapter = trainable * train_width if shape.lora_r else 0
    grads = trainable * train_width
    optimizer = trainable * optim_width
    activations = _activations(dims, shape, min(width, 2))
    parts = {"weights": weights, "adapter": adapter, "gradients": grads, "optimizer": optimizer,
             "activations": activations, "overhead": OVERHEAD_BYTES}
    ddp = sum(parts.values())
    sharded = weights + adapter + grads + optimizer
    layer = int(dims.layer_linear_params() * weight_width)
    fsdp = sharded // max(world, 1) + 2 * layer + activations + OVERHEAD_BYTES  # two layers gathered at a time
    split_total = weights + adapter + grads + optimizer + activations + OVERHEAD_BYTES * max(world, 1)
    return Estimate(params, trainable, ddp, fsdp, split_total, world, parts,
                    source=source + (f", LoRA r={shape.lora_r}" if shape.lora_r else ", full fine-tune"))


def _inference(dims: Dims, shape: JobShape, weights: int, width: int, params: int, world: int, source: str) -> Estimate:
    """A notebook that only predicts holds its weights, the attention cache of a batch (keys and values of every
    layer, ``kv_out`` wide) and one layer's tensors at a time (nothing kept for a backward), and the logits of
    its tokens in the model's width (no loss, so no fp32 copy): no gradients, no optimizer states. Not fitted to measured peaks as training is (the
    batch and length are the training defaults where the notebook says neither; an encoder keeps no cache):
    an upper bound for a loop that generates one prompt at a time. In the weights' width: a model loaded in
    fp32 computes in fp32. FSDP is never chosen for it (``choose``), so its figure is DDP's."""
    tokens = shape.batch * (shape.seq_len or 1024)
    cache = 2 * dims.layers * dims.kv_out * tokens * width
    activations = (12 * dims.hidden + 4 * dims.intermediate + dims.vocab) * tokens * width
    parts = {"weights": weights, "attention cache": cache, "activations": activations, "overhead": OVERHEAD_BYTES}
    ddp = sum(parts.values())
    split_total = weights + cache + activations + OVERHEAD_BYTES * max(world, 1)
    return Estimate(params, 0, ddp, ddp, split_total, world, parts, source=source + ", inference", predicting=True)


def _activations(dims: Dims, shape: JobShape, width: int) -> int:
    """Activation memory of one step, fitted to peaks measured on a GPU (``benchmarks/memory_estimate.py``,
    ``benchmarks/results/memory_estimate.md``: six shapes from 0.5B to 8B, LoRA and full, 4 and 16 bits,
    with and without checkpointing; the estimate lands within 0.97–1.14 of each peak, the allocator's slack
    left to ``HEADROOM``): a layer keeps about 12·h + 4·i values a token (attention's inputs and outputs, the
    gated MLP's four i-wide tensors; SDPA keeps no s² term); under checkpointing each layer keeps its input
    and a few h-wide tensors (4·h) while two layers are recomputed whole; the loss holds 14 bytes a token
    and vocabulary entry (16-bit logits, transformers' fp32 copy, the log-softmax and its gradient). Unsloth's
    checkpointing (its default, ``"unsloth"``) moves each layer's saved input to the host as the forward goes
    (``Unsloth_Offloaded_Gradient_Checkpointer``), so only the two recomputed layers stay, and its loss is
    chunked (``_loss_bytes``). Without these, the public Unsloth Kaggle Llama 3.1 8B notebook was estimated at
    19.2 GiB a rank and sent to split on two T4s, though it trains on one."""
    tokens = shape.batch * (shape.seq_len or 1024)
    per_layer = (12 * dims.hidden + 4 * dims.intermediate) * tokens * width
    if shape.offloaded:
        layers = 2 * per_layer
    elif shape.checkpointing:
        layers = 4 * dims.hidden * tokens * width * dims.layers + 2 * per_layer
    else:
        layers = per_layer * dims.layers
    return int(layers + _loss_bytes(dims, shape, tokens))


#: What Unsloth's fused loss is counted at: it never holds the whole logits, but cuts the tokens into chunks
#: sized to half the memory then free (at most 4 GB), so it takes what the rest leaves; counted at one
#: working chunk.
UNSLOTH_LOSS_CHUNK = 2**29


def _loss_bytes(dims: Dims, shape: JobShape, tokens: int) -> int:
    """The loss's memory: 14 bytes a token and vocabulary entry with transformers' loss; Unsloth's chunked
    fused loss (``unsloth_zoo.fused_losses``, 16 bytes a logit in a chunk) no more than ``UNSLOTH_LOSS_CHUNK``."""
    if shape.unsloth:
        return min(16 * tokens * dims.vocab, UNSLOTH_LOSS_CHUNK)
    return 14 * tokens * dims.vocab


# ---- the GPUs and the choice -----------------------------------------------------------------------------

def gpu_free_bytes(timeout_s: float = 60.0) -> tuple[int, ...]:
    """Free bytes on each visible GPU (``gpus.read_machine``: this process never initialises CUDA); () when
    there is none or nothing can say. ``NBDDP_GPU_MEMORY_GIB`` caps each GPU's share, to choose as on a
    smaller GPU (a Kaggle T4's 15 GiB on a larger card, with the ranks capped to match). A job reads the
    machine once and hands its reading to ``decide`` instead."""
    return cap_free(_ask_gpus(timeout_s))


def _gpu_count() -> int:
    """GPUs torch sees, without a CUDA context (NVML's count); 0 without torch (``preflight.gpu_count``)."""
    from .preflight import gpu_count

    return gpu_count()


def _ask_gpus(timeout_s: float) -> tuple[int, ...]:
    return read_machine(timeout_s=timeout_s).free_bytes


def choose(est: Estimate | None, gpu_free: tuple[int, ...], *, unsloth: bool = False, why_unknown: str = "") -> Decision:
    """``auto``'s pick: ddp where a replica fits the smallest GPU, else fsdp, else split."""
    if not gpu_free:
        return Decision("ddp", "no GPU visible: DDP over gloo on CPU", estimate=est)
    if est is None:
        return Decision("ddp", f"{why_unknown}; DDP assumed (--strategy fsdp or split to choose otherwise)",
                        gpu_free=gpu_free)
    room = int(min(gpu_free) * HEADROOM)
    if est.ddp <= room:
        return Decision("ddp", f"a whole replica ({_gib(est.ddp)}) fits the smallest GPU ({_gib(min(gpu_free))} free)",
                        estimate=est, gpu_free=gpu_free)
    too_big = f"a whole replica ({_gib(est.ddp)}) does not fit the smallest GPU ({_gib(min(gpu_free))} free)"
    notes = ()
    if unsloth:
        notes = ("Unsloth's loaders build models FSDP cannot shard (their patched layers and 4-bit kernels "
                 "expect whole weights on one GPU): FSDP is not an option",)
    elif est.predicting:
        notes = (PREDICT_NOT_SHARDED,)
    elif len(gpu_free) > 1 and est.fsdp <= room:
        return Decision("fsdp", f"{too_big}; sharded over {len(gpu_free)} GPUs it needs {_gib(est.fsdp)} each",
                        estimate=est, gpu_free=gpu_free)
    if len(gpu_free) > 1 and est.split_total <= int(sum(gpu_free) * HEADROOM):
        return Decision("split", f"{too_big}; split over {len(gpu_free)} GPUs in one process it needs "
                        f"{_gib(est.split_total)} in all", estimate=est, gpu_free=gpu_free,
                        notes=notes + (SPLIT_NOTE,))
    warning = (f"by this estimate nothing fits {len(gpu_free)} GPU(s) ("
               + ("" if est.predicting else f"fsdp {_gib(est.fsdp)} a GPU{', not for Unsloth' if unsloth else ''}; ")
               + f"split {_gib(est.split_total)} in all): load the model in 4 bits, lower the batch size or sequence "
               + ("length" if est.predicting else "length, or turn on gradient checkpointing"))
    return Decision("split", f"{too_big}; split needs the least per GPU", estimate=est, gpu_free=gpu_free,
                    notes=notes + (warning, SPLIT_NOTE))


#: Why a notebook that only predicts is never sharded.
PREDICT_NOT_SHARDED = ("the notebook only predicts: each rank predicts its own rows, and a model sharded over the "
                       "ranks (FSDP) needs every rank in each forward, so FSDP is not an option")

SPLIT_NOTE = ("split runs the layers one GPU after another in a single process: slower than one GPU would be "
              "for a model that fits one, and no faster with more GPUs")


def decide(source: str | JobShape | ShapeUnread, cwd: str | os.PathLike | None = None, requested: str = "auto",
           gpu_free: tuple[int, ...] | None = None, gpu_count: int | None = None, predicting: bool = False) -> Decision:
    """The strategy a job runs with: ``requested`` itself, checked, or ``auto``'s choice with its estimate.

    ``source``: the model's shape the converter read (``Script.shape``), or a script's text to read it from.
    What nbddp reads on the way (the script's facts, a model's config, the GPUs' memory) is read from files a
    person gives it and libraries it does not control: a slip there is not the job's fault. So any exception
    but a refusal (``NbddpError``) falls back: ``auto`` and ``ddp`` to DDP, saying why (``Decision.fallback``);
    another strategy, which needs what failed, is refused naming the cause. ``gpu_free`` and ``gpu_count``: the
    job's one reading of the machine (``gpus.Machine``); where not given, asked here. ``predicting``: the
    notebook only predicts (``Script.predicts``), sized for inference and never sharded.
    """
    if requested not in STRATEGIES:
        raise NbddpError(f"--strategy takes one of {', '.join(STRATEGIES)}, not {requested!r}")
    try:
        shape = read_shape(source) if isinstance(source, str) else source
        if isinstance(shape, ShapeUnread):
            return _fall_back(requested, shape.why)
        return _decide(shape, cwd, requested, gpu_free, gpu_count, predicting)
    except NbddpError:
        raise
    except Exception as exc:  # broad on purpose: see the docstring
        return _fall_back(requested, printable(f"{type(exc).__name__}: {exc}")[:300])


def _fall_back(requested: str, why: str) -> Decision:
    """DDP for ``auto`` and ``ddp`` when nbddp could not read what it decides from; a refusal otherwise."""
    if requested in ("auto", "ddp"):
        return Decision("ddp", f"nbddp could not decide the strategy ({why}); DDP assumed", requested, fallback=why)
    raise NbddpError(f"--strategy {requested} could not be prepared: nbddp could not read what it needs ({why}); "
                     "run with --strategy ddp, and please report this") from None


def _decide(shape: JobShape, cwd, requested: str, gpu_free: tuple[int, ...] | None, gpu_count: int | None,
            predicting: bool) -> Decision:
    if predicting and requested in ("fsdp", "deepspeed"):
        raise NbddpError(f"--strategy {requested} cannot run a notebook that only predicts: each rank predicts its "
                         "own rows, and a model sharded over the ranks needs every rank in each forward; use "
                         "--strategy split (the model over every GPU in one process) or ddp")
    if requested == "deepspeed" and not _installed("deepspeed"):
        raise NbddpError("--strategy deepspeed needs DeepSpeed, which is not installed here: pip install deepspeed "
                         "(or use --strategy fsdp, which shards the same way with PyTorch alone)")
    if requested == "deepspeed" and not gpu_free and not (_gpu_count() if gpu_count is None else gpu_count):
        raise NbddpError("--strategy deepspeed needs GPUs: on the CPU the Trainer turns DeepSpeed off and would "
                         "train plain DDP instead; use --strategy ddp or fsdp here")
    if requested == "fsdp" and shape.unsloth:
        raise NbddpError("--strategy fsdp cannot shard a model Unsloth loads (its patched layers and 4-bit kernels "
                         "expect whole weights on one GPU): use --strategy split, or ddp where the model fits one GPU")
    gpus = gpu_free_bytes() if gpu_free is None and requested == "auto" else (gpu_free or ())
    est, unknown, unreadable = _model_estimate(shape, cwd, max(len(gpus), 2), predicting)
    if requested != "auto":
        notes = (SPLIT_NOTE,) if requested == "split" else ()
        return Decision(requested, "asked for with --strategy", requested, est, tuple(gpus),
                        notes + ((unknown,) if unreadable else ()))
    return choose(est, tuple(gpus), unsloth=shape.unsloth, why_unknown=unknown)


def _model_estimate(shape: JobShape, cwd, world: int, predicting: bool) -> tuple[Estimate | None, str, bool]:
    """The estimate for the script's model, or None with why its size is unknown (and whether its config was
    there but could not be read: a model of a kind or a file this transformers cannot read)."""
    if not shape.model:
        return None, "no model loader found in the script", False
    try:
        config = read_config(shape.model, cwd)
        if config is not None:
            return estimate(shape, config, world, predicting), "", False
    except SizeUnknown as exc:
        return None, f"the size of {shape.model} is unknown: {printable(str(exc))}", True
    return None, (f"the size of {shape.model} is unknown here (no config.json in its folder or the Hugging Face "
                  "cache)"), False


#: Why a whole-model save is refused under FSDP, and what to write instead.
WHOLE_MODEL_SAVE = ("torch.save of the whole model cannot work under --strategy fsdp: the model is held in shards "
                    "across the ranks; save its weights, torch.save(model.state_dict(), PATH) (nbddp gathers them "
                    "whole on rank 0), or run with --strategy ddp or split")


#: Why rank 0 alone cannot run a sharded model, and what to do instead.
RANK0_FORWARD = ("rank 0 alone runs the model here (after training), but under --strategy fsdp its weights are held "
                 "in shards across the ranks and every rank must take part in its forward: the job would wait here "
                 "until the collective timeout. Run with --strategy ddp or split, or load the saved state dict "
                 "(torch.save(model.state_dict(), PATH)) into a plain model and run that one")


def settle(script, cwd, requested: str, gpu_free: tuple[int, ...] | None = None,
           say: Callable[[Decision], None] | None = None, gpu_count: int | None = None) -> Decision:
    """The strategy a converted ``Script`` runs with, for every front end that launches or exports one:
    ``decide`` on the converter's ``Script.shape``, the decision handed to ``say`` (the launcher shows it), then
    refused where the notebook does what the strategy cannot run (``refuse_what_it_cannot_run``): after the
    choice is said, so a refusal of ``auto``'s choice is read with it."""
    decision = decide(script.shape, cwd, requested, gpu_free=gpu_free, gpu_count=gpu_count,
                      predicting=getattr(script, "predicts", False))
    if say is not None:
        say(decision)
    refuse_what_it_cannot_run(decision, script)
    return decision


def refuse_what_it_cannot_run(decision: Decision, script) -> None:
    """Before launch (``nbddp run``, a magic, an export), what a plain loop's model cannot do under FSDP once
    training is over, at the notebook's cell and line: be pickled whole (``torch.save(model, …)``), run on
    rank 0 alone. ``script`` is the converted ``Script``: the converter's facts recorded where its notebook
    does either (``Script.whole_model_saves``, ``Script.rank0_forwards``)."""
    if decision.strategy != "fsdp":
        return
    for places, why in ((script.whole_model_saves, WHOLE_MODEL_SAVE), (script.rank0_forwards, RANK0_FORWARD)):
        if places:
            cell, line = places[0]
            raise NbddpError(f"cell {cell}, line {line}: {why}" if line else f"cell {cell}: {why}")


def _installed(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None
