"""The job's strategy in a rank (``NBDDP_STRATEGY``: ddp, fsdp, split or deepspeed; the launcher sets it).

- ``fsdp``: the Trainer's training arguments get ``fsdp=True`` with an FSDP2 ``fsdp_config`` (accelerate's
  plugin then shards each decoder layer with ``fully_shard``); ``_nbddp.ddp(model)`` in a plain loop shards
  with ``fully_shard`` itself (``shard``), and the whole weights are gathered at each rank-0 guard every rank
  reaches, so rank 0's saves write them (``gather_for_rank0_code``); a 4-bit ``BitsAndBytesConfig`` stores
  its weights in the compute dtype (``bnb_4bit_quant_storage``), without which FSDP cannot shard them.
  accelerate picks FSDP only for GPU-like devices and silently falls back to DDP under gloo on CPU; there it
  is told FSDP too, so a CPU job runs what a GPU job runs.
- ``split``: one process; ``_nbddp.device_map()`` is ``"balanced"``, so accelerate spreads the layers over
  every GPU.
- ``deepspeed``: the training arguments get a generated ZeRO config (stage ``NBDDP_DEEPSPEED_STAGE``, 3 by
  default), the rest left to the Trainer's ``"auto"`` values.

A notebook's own ``fsdp``/``deepspeed`` arguments are kept. Libraries are patched when the notebook imports
them; nothing here imports transformers or accelerate itself.
"""

from __future__ import annotations

import os
import weakref
from typing import Callable

from . import settings
from .patching import wrap, when_imported

#: The strategies a rank runs, spelled once: ``--strategy`` takes these and ``auto`` (``options.STRATEGIES``).
STRATEGIES = ("ddp", "fsdp", "split", "deepspeed")

#: The FSDP2 settings the Trainer gets: each decoder layer (the model's ``_no_split_modules``) sharded,
#: a full state dict gathered for saving (written by rank 0 alone).
FSDP_CONFIG = {"version": 2, "auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "state_dict_type": "FULL_STATE_DICT",
               "reshard_after_forward": True}


def current() -> str:
    value = settings.current().strategy  # NBDDP_STRATEGY
    if value not in STRATEGIES:
        raise ValueError(f"NBDDP_STRATEGY must be one of {', '.join(STRATEGIES)}, not {value!r}")
    return value


def install(log: Callable[[str], None] = print) -> None:
    """Patch what the strategy needs, once the notebook imports the library; say it on rank 0."""
    strategy = current()
    if strategy == "fsdp":
        when_imported("transformers.training_args", lambda m: wrap(m.TrainingArguments, "__post_init__", _with_fsdp))
        when_imported("transformers.utils.quantization_config", _store_4bit_in_compute_dtype)
        when_imported("accelerate.state", _fsdp_on_cpu_too)
        _gather_before_rank0_saves()
        log("nbddp: strategy fsdp: the Trainer shards each layer with FSDP2 (fsdp_config version 2), "
            "_nbddp.ddp(model) with fully_shard; saving gathers a full state dict on rank 0")
    elif strategy == "deepspeed":
        when_imported("transformers.training_args", lambda m: wrap(m.TrainingArguments, "__post_init__", _with_deepspeed))
        _gather_before_rank0_saves()
        log(f"nbddp: strategy deepspeed: the Trainer runs ZeRO stage {deepspeed_stage()} from a generated config"
            + ("; a plain loop's _nbddp.ddp(model) stays DDP" if torch_cuda_count() else
               "; but this rank has no GPU, and on the CPU the Trainer leaves DeepSpeed off: it trains DDP"))
    elif strategy == "split":
        _one_plain_process()
        log("nbddp: strategy split: one process, the model spread over every GPU (device_map='balanced'); "
            "layers run one GPU after another")


def _gather_before_rank0_saves() -> None:
    """The saves after training run on rank 0 alone, where a sharded model's weights are not whole: gather them
    as ``train()`` ends and let rank 0's saves write what was gathered."""
    when_imported("transformers.trainer", lambda m: wrap(m.Trainer, "train", _gathering_after_training))
    when_imported("accelerate.accelerator", lambda m: wrap(m.Accelerator, "get_state_dict", _gathered_state_dict))
    when_imported("transformers.modeling_utils",
                  lambda m: wrap(m.PreTrainedModel, "save_pretrained", _saving_the_gathered_state_dict))
    when_imported("peft.peft_model", lambda m: wrap(m.PeftModel, "save_pretrained", _saving_the_gathered_state_dict))


def torch_cuda_count() -> int:
    import torch

    return torch.cuda.device_count()


#: torchrun's variables that make accelerate (and so the Trainer) take one process for a distributed job.
TORCHRUN_RANK_VARIABLES = ("LOCAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                           "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE")


def _one_plain_process() -> None:
    """Split mode's single process, started by torchrun, is not a distributed job: with torchrun's
    ``LOCAL_RANK`` accelerate would call it one, and refuse a model spread over several GPUs ("You can't
    train a model that has been loaded with device_map='auto' in any distributed mode"). The rank is already
    known (``dist.rank_info``); the variables go."""
    for name in TORCHRUN_RANK_VARIABLES:
        os.environ.pop(name, None)


# ---- fsdp ------------------------------------------------------------------------------------------------


def _with_fsdp(post_init):
    def __post_init__(self, *args, **kwargs):
        if not getattr(self, "fsdp", None) and not getattr(self, "deepspeed", None):
            self.fsdp = True
            self.fsdp_config = {**FSDP_CONFIG, **(self.fsdp_config if isinstance(self.fsdp_config, dict) else {})}
        return post_init(self, *args, **kwargs)

    return __post_init__


def _store_4bit_in_compute_dtype(module) -> bool:
    """FSDP flattens and shards tensors of one dtype: 4-bit weights packed in uint8 cannot be sharded beside
    16-bit ones, so they are stored in the compute dtype (bitsandbytes' ``bnb_4bit_quant_storage``)."""

    def make(init):
        def __init__(self, *args, **kwargs):
            init(self, *args, **kwargs)
            if getattr(self, "load_in_4bit", False) and "bnb_4bit_quant_storage" not in kwargs:
                self.bnb_4bit_quant_storage = self.bnb_4bit_compute_dtype

        return __init__

    return wrap(module.BitsAndBytesConfig, "__init__", make)


def _fsdp_on_cpu_too(module) -> bool:
    """accelerate keeps its FSDP plugin only for GPU-like devices; under gloo (MULTI_CPU) it drops it and
    runs DDP. Told FSDP there too, the CPU job shards as a GPU job does (FSDP2's ``fully_shard`` runs on gloo)."""
    state = module

    def make(init):
        def __init__(self, *args, fsdp_plugin=None, **kwargs):
            init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
            if fsdp_plugin is not None and self.distributed_type == state.DistributedType.MULTI_CPU:
                self.distributed_type = state.DistributedType.FSDP
                self.fsdp_plugin = fsdp_plugin
                # later AcceleratorState() calls copy PartialState's type back over this one
                state.PartialState._shared_state["distributed_type"] = state.DistributedType.FSDP

        return __init__

    return wrap(module.AcceleratorState, "__init__", make)


#: Where a model keeps the whole state dict gathered when its training ended (rank 0; empty elsewhere).
GATHERED = "_nbddp_gathered_state_dict"


def _gathering_after_training(train):
    """Saving comes after training on rank 0 alone (the converter puts it there), but gathering a sharded
    model's state dict is a collective every rank must join: so every rank gathers it as ``train()`` ends,
    while all are still there, and rank 0 keeps it on the CPU for the saves that follow (trainable weights
    only where some are frozen: a LoRA adapter, not the base model)."""

    def wrapper(self, *args, **kwargs):
        for model in (getattr(self, "model", None), getattr(self, "model_wrapped", None)):
            if model is not None:
                model.__dict__.pop(GATHERED, None)  # a second training makes new weights
        result = train(self, *args, **kwargs)
        if getattr(self, "is_fsdp_enabled", False) and _is_sharded(self.model):
            self.model.__dict__[GATHERED] = gather(self.model)
        elif (engine := _zero3_engine(self)) is not None:
            engine.__dict__[GATHERED] = self.model.__dict__[GATHERED] = gather_zero3(engine)
        return result

    return wrapper


def gather(model, frozen_too: bool = False) -> dict:
    """The model's whole state dict on rank 0 (CPU), {} on the others; every rank must call it. Frozen
    weights are left out where some are trainable, unless ``frozen_too``."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    frozen = not frozen_too and any(not p.requires_grad for p in model.parameters())
    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=frozen)
    return get_model_state_dict(model, options=options)


def _zero3_engine(trainer):
    """The Trainer's DeepSpeed engine where ZeRO stage 3 partitions the weights (else None: stage 2 keeps them
    whole on every rank)."""
    engine = getattr(trainer, "model_wrapped", None)
    partitions = getattr(engine, "zero_optimization_partition_weights", None)
    return engine if getattr(trainer, "is_deepspeed_enabled", False) and partitions and partitions() else None


def gather_zero3(engine) -> dict:
    """ZeRO-3's whole weights on rank 0 (CPU), {} on the others; every rank must call it. Only the trainable
    ones where some are frozen (a LoRA adapter: the base model is not gathered), else DeepSpeed's own
    consolidated 16-bit state dict. Keys as ``engine.module.state_dict()`` names them."""
    import deepspeed
    import torch.distributed as dist

    module = engine.module
    trainable = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    if len(trainable) == sum(1 for _ in module.parameters()):
        return engine._zero3_consolidated_16bit_state_dict() or {}
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    with deepspeed.zero.GatheredParameters([p for _, p in trainable], modifier_rank=None):
        return {n: p.detach().to("cpu", copy=True) for n, p in trainable} if rank0 else {}


def _is_sharded(model) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def _gathered_state_dict(get_state_dict):
    def wrapper(self, model, *args, **kwargs):
        gathered = gathered_state_dict(model)
        return gathered if gathered is not None else get_state_dict(self, model, *args, **kwargs)

    return wrapper


def _saving_the_gathered_state_dict(save_pretrained):
    def wrapper(self, *args, **kwargs):
        gathered = gathered_state_dict(self)
        if gathered is not None and kwargs.get("state_dict") is None:
            kwargs["state_dict"] = gathered
        return save_pretrained(self, *args, **kwargs)

    return wrapper


def shard(model):
    """``fully_shard`` each of the model's repeated blocks (its ``_no_split_modules`` classes, else the
    items of its largest ``ModuleList``), then the whole model; returns the model, sharded in place."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    if isinstance(model, FSDPModule):
        return model
    for block in _blocks(model):
        fully_shard(block)
    fully_shard(model)
    _sharded.append(weakref.ref(model))
    model.register_state_dict_post_hook(_whole_once_gathered)
    return model


# ---- a plain loop's saves ---------------------------------------------------------------------------------

#: The models ``shard`` sharded, in the order they were (the same on every rank): a plain loop's.
_sharded: list[weakref.ref] = []
#: The parameters' version counters when a model's state dict was gathered: it is whole while they hold.
GATHERED_AT = "_nbddp_gathered_at"


def gathered_state_dict(model) -> dict | None:
    """The whole state dict gathered for ``model`` while every rank was there (rank 0's; {} on the others),
    or None: none was, or the weights changed since (a plain loop's model trained on)."""
    state = getattr(model, "__dict__", {})
    gathered = state.get(GATHERED)
    if gathered is None or (GATHERED_AT in state and state[GATHERED_AT] != _weights_stamp(model)):
        return None
    return gathered


def gather_for_rank0_code() -> None:
    """Every rank is at a rank-0 guard the converter wrote (``if _nbddp.on_rank0():``), before code
    rank 0 alone runs: the saves after training, a checkpoint in the loop. Gathering a sharded model is a
    collective, so it happens here, while every rank is, for each plain loop's model whose weights changed
    since it was last gathered (the check is local: every rank trains alike, so all agree without asking);
    rank 0 keeps the whole state dict (frozen weights too: a ``state_dict()`` is saved whole) on the CPU."""
    for ref in list(_sharded):
        model = ref()
        if model is None:
            _sharded.remove(ref)
            continue
        stamp = _weights_stamp(model)
        if model.__dict__.get(GATHERED_AT) != stamp:
            model.__dict__.pop(GATHERED, None)  # while gathering, state_dict() is the sharded one
            model.__dict__[GATHERED] = gather(model, frozen_too=True)
            model.__dict__[GATHERED_AT] = stamp


def _weights_stamp(model) -> tuple[int, ...]:
    """Each parameter's version counter: an optimizer's step (or any in-place change) moves it."""
    return tuple(p._version for p in model.parameters())


def _whole_once_gathered(model, state_dict, prefix, local_metadata) -> None:
    """``state_dict()`` of a plain loop's sharded model on rank 0, after every rank gathered it: the whole
    weights, which a ``torch.save`` there writes (its own would be this rank's shards)."""
    gathered = gathered_state_dict(model)
    if gathered and not prefix and gathered.keys() == state_dict.keys():
        state_dict.update(gathered)


def _blocks(model) -> list:
    import torch

    names = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if blocks:
        return blocks
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    return list(max(lists, key=len, default=[]))


def local_numel(model) -> tuple[int, int]:
    """(elements this rank holds, elements of the whole model): a sharded parameter counts its local shard."""
    held = total = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        held += local.numel()
        total += p.numel()
    return held, total


# ---- deepspeed -------------------------------------------------------------------------------------------


def deepspeed_stage() -> int:
    stage = settings.current().deepspeed_stage  # NBDDP_DEEPSPEED_STAGE
    if stage not in ("2", "3"):
        raise ValueError(f"NBDDP_DEEPSPEED_STAGE must be 2 or 3, not {stage!r}")
    return int(stage)


def deepspeed_config(stage: int) -> dict:
    """A ZeRO config whose sizes and precisions the Trainer fills in from its own arguments ("auto")."""
    zero = {"stage": stage, "overlap_comm": True, "contiguous_gradients": True}
    if stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True  # save_model writes whole weights on rank 0
    return {
        "zero_optimization": zero,
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "fp16": {"enabled": "auto"},
        "bf16": {"enabled": "auto"},
    }


def _with_deepspeed(post_init):
    def __post_init__(self, *args, **kwargs):
        if not getattr(self, "deepspeed", None) and not getattr(self, "fsdp", None):
            self.deepspeed = deepspeed_config(deepspeed_stage())
        return post_init(self, *args, **kwargs)

    return __post_init__
