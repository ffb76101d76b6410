"""The model's shape: what a converted script says about the model it loads and how it trains, for the launcher's
choice of strategy (``choose_strategy.decide``), read once by the converter (``Script.shape``).

``read_shape`` reads any Python source with ``ast`` (no import of the user's libraries): the model it loads
(the id or folder given to a loader's ``from_pretrained``), the dtype and 4/8-bit quantization, the LoRA rank
and target modules, the per-device batch size, the sequence length and gradient checkpointing.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

#: Words in a ``from_pretrained`` owner that say it is not a model.
_NOT_MODELS = ("Tokenizer", "Processor", "Config", "FeatureExtractor", "ImageProcessor", "Dataset")
#: Unsloth's loader classes: FSDP cannot shard what they build.
_UNSLOTH = ("FastLanguageModel", "FastModel", "FastVisionModel", "FastTextModel")


@dataclass(frozen=True)
class JobShape:
    """What the script says about its model and training; None where it does not say."""

    model: str | None = None
    unsloth: bool = False
    dtype: str | None = None  # "float16", "bfloat16", "float32", "auto" or None (the checkpoint's)
    bits: int = 16  # 4 or 8 with bitsandbytes
    lora_r: int | None = None
    lora_targets: tuple[str, ...] | str | None = None
    batch: int = 8  # the Trainer's default per-device batch size
    seq_len: int | None = None
    checkpointing: bool = False
    offloaded: bool = False  # Unsloth's "unsloth" checkpointing: each layer's saved input waits in host memory
    optim: str = "adamw_torch"
    upcast: bool = False  # prepare_model_for_kbit_training: what bitsandbytes left unquantized becomes fp32


@dataclass(frozen=True)
class ShapeUnread:
    """Why a script's shape could not be read (``"ValueError: …"``): ``choose_strategy.decide`` falls back as
    for any slip on its way."""

    why: str


def read_shape(script_text: str) -> JobShape:
    """The model and training facts of a converted script (or any Python source)."""
    return shape_of(ast.parse(script_text))


def shape_of(tree: ast.Module) -> JobShape:
    """The model and training facts of a parsed script."""
    strings = _literal_names(tree)
    found: dict = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            _read_call(node, strings, found)
    return JobShape(**found)


def _literal_names(tree: ast.Module) -> dict[str, object]:
    """Top-level ``NAME = literal`` bindings (papermill's parameters, ``model_id = "…"``): the last wins."""
    names: dict[str, object] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                names[node.targets[0].id] = ast.literal_eval(node.value)
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                names.pop(node.targets[0].id, None)
    return names


def _callee(node: ast.Call) -> tuple[str, str]:
    """``(owner, attribute)`` of ``Owner.attr(…)``, ``("", name)`` of ``name(…)``."""
    f = node.func
    if isinstance(f, ast.Attribute):
        owner = f.value.attr if isinstance(f.value, ast.Attribute) else getattr(f.value, "id", "")
        return owner, f.attr
    return "", getattr(f, "id", "")


def _value(node: ast.AST | None, strings: dict) -> object:
    """A literal, a name bound to one, ``torch.float16`` as ``"float16"``; None otherwise."""
    if node is None:
        return None
    if isinstance(node, ast.Name) and node.id in strings:
        return strings[node.id]
    if isinstance(node, ast.Attribute) and getattr(node.value, "id", "") == "torch":
        return node.attr
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None


def _keywords(node: ast.Call, strings: dict) -> dict[str, object]:
    return {k.arg: _value(k.value, strings) for k in node.keywords if k.arg}


def _read_call(node: ast.Call, strings: dict, found: dict) -> None:
    owner, name = _callee(node)
    kw = _keywords(node, strings)
    if name == "from_pretrained" and is_model_loader_owner(owner):
        first = node.args[0] if node.args else next(
            (k.value for k in node.keywords if k.arg in ("pretrained_model_name_or_path", "model_name")), None)
        source = _value(first, strings)
        if isinstance(source, str) and "model" not in found:
            found["model"] = source
            found["unsloth"] = owner in _UNSLOTH
            dtype = kw.get("dtype") or kw.get("torch_dtype")
            found["dtype"] = dtype if isinstance(dtype, str) else None
            if kw.get("load_in_4bit"):
                found["bits"] = 4
            elif kw.get("load_in_8bit"):
                found["bits"] = 8
            if isinstance(kw.get("max_seq_length"), int):  # Unsloth's loaders take it
                found.setdefault("seq_len", kw["max_seq_length"])
    elif name == "BitsAndBytesConfig":
        if kw.get("load_in_4bit"):
            found["bits"] = 4
        elif kw.get("load_in_8bit"):
            found["bits"] = 8
    if name == "prepare_model_for_kbit_training":
        found["upcast"] = True
    if _turns_on_checkpointing(owner, name, kw):
        found["checkpointing"] = True
        # Unsloth's default, "unsloth", offloads to the CPU; True keeps the inputs on the GPU
        found["offloaded"] = owner in _UNSLOTH and kw.get("use_gradient_checkpointing", "unsloth") == "unsloth"
    if name in ("LoraConfig", "get_peft_model") and kw.get("r") is not None:
        found["lora_r"] = int(kw["r"])
        targets = kw.get("target_modules")
        found["lora_targets"] = tuple(targets) if isinstance(targets, (list, tuple)) else targets
    elif name in ("LoraConfig", "get_peft_model") and "lora_r" not in found:
        found["lora_r"] = 8  # PEFT's default rank
    elif name.endswith("Config") and "per_device_train_batch_size" in kw or name == "TrainingArguments":
        _read_trainer_config(kw, found)


def _turns_on_checkpointing(owner: str, name: str, kw: dict) -> bool:
    if name == "gradient_checkpointing_enable":
        return True
    if "use_gradient_checkpointing" in kw:
        return bool(kw["use_gradient_checkpointing"])
    # PEFT's k-bit preparation and Unsloth's get_peft_model checkpoint unless told not to
    return name == "prepare_model_for_kbit_training" or (name == "get_peft_model" and owner in _UNSLOTH)


def _read_trainer_config(kw: dict, found: dict) -> None:
    if isinstance(kw.get("per_device_train_batch_size"), int):
        found["batch"] = kw["per_device_train_batch_size"]
    for key in ("max_seq_length", "max_length"):
        if isinstance(kw.get(key), int):
            found["seq_len"] = kw[key]
    if kw.get("gradient_checkpointing"):
        found["checkpointing"] = True
    if isinstance(kw.get("optim"), str):
        found["optim"] = kw["optim"]


def is_model_loader_owner(owner: str | None) -> bool:
    """Whether ``owner.from_pretrained(…)`` loads a model (not a tokenizer, processor or config): the one answer
    for the shape's model and the ``device_map`` rule (``rules/device_map.py``).

    Covers ``AutoModel*``, ``*For*`` (``LlamaForCausalLM``), ``AutoPeftModel*``, ``PeftModel`` and Unsloth's
    ``FastLanguageModel``/``FastModel``/``FastVisionModel``.
    """
    if not owner or any(word in owner for word in _NOT_MODELS):
        return False
    return "Model" in owner or "For" in owner or owner.startswith(("Auto", "Fast", "Peft"))
