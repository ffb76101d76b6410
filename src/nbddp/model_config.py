"""A model's sizes from its ``config.json``, read as transformers reads them.

Every architecture names its sizes its own way (DistilBERT ``dim``, GPT-2 ``n_embd``, T5 and BART
``d_model``); transformers' config classes map the common names onto them (``attribute_map``), so the
config is built through ``transformers.CONFIG_MAPPING[model_type]`` and read by the common names, never by
raw JSON keys. What cannot be read (no transformers, a ``model_type`` this transformers does not know, a
config without a hidden size) is ``SizeUnknown`` with the reason: the strategy then treats the model's size
as unknown instead of failing.

Light on purpose: transformers is imported on first use (its configuration module imports torch where
torch is installed, but never initialises CUDA); nothing here imports torch itself.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

#: Activations of gated MLPs (Llama, Mistral, Qwen: gate, up and down projections); others have two.
_GATED_ACTIVATIONS = ("silu", "swish", "swiglu")
#: The feed-forward width, by the names architectures give it, the common one first.
_FFN_NAMES = ("intermediate_size", "ffn_dim", "encoder_ffn_dim", "d_ff", "n_inner", "hidden_dim")


class SizeUnknown(Exception):
    """The model's sizes cannot be read from its config; the message says why, for the strategy's line."""


def read_json(path: Path) -> dict:
    """A ``config.json`` as a dict; ``SizeUnknown`` when it is not readable JSON holding an object."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise SizeUnknown(f"its config.json cannot be read ({_said(exc)})") from None
    if not isinstance(data, dict):
        raise SizeUnknown(f"its config.json holds a {type(data).__name__}, not an object")
    return data


_COMMON = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
           "vocab_size", "tie_word_embeddings")
#: Llama-like families whose config.json, when it holds these keys, says every size the estimate reads by its
#: own name (no ``attribute_map`` alias, no default of the class left to fill in): read from the JSON itself,
#: because transformers' config classes import torch, which cost a launcher seconds before every job (about
#: 10 s on an H100 machine, ``benchmarks/results/job_overhead_gpu.md``). ``tests/test_model_config.py`` holds
#: each to the same sizes as its config class gives, and any key missing to transformers.
PLAIN_FAMILIES: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("llama", "mistral", "qwen3", "gemma"), _COMMON + ("head_dim", "hidden_act")),
    "gemma2": _COMMON + ("head_dim", "hidden_activation"),
    **dict.fromkeys(("qwen2", "phi3"), _COMMON + ("hidden_act",)),
}


class PlainConfig:
    """A config.json of a ``PLAIN_FAMILIES`` model read as its config class would read it: attributes by name,
    None for what it does not say."""

    def __init__(self, raw: dict):
        self.__dict__.update(raw)

    def __getattr__(self, name: str):
        return None

    def get_text_config(self):
        return self


def plain_config(raw: dict) -> PlainConfig | None:
    """``raw`` as a ``PlainConfig`` where its family and keys allow it, else None (transformers reads it)."""
    needs = PLAIN_FAMILIES.get(raw.get("model_type"))  # type: ignore[arg-type]
    if needs is None or any(key not in raw for key in needs) or "text_config" in raw:
        return None
    return PlainConfig(raw)


def transformers_config(raw: dict):
    """The transformers config object for ``raw``: its ``model_type``'s class, or the base class (which reads
    the common names as they are) for a config that names no ``model_type``."""
    try:
        from transformers import CONFIG_MAPPING, PretrainedConfig
    except ImportError:
        raise SizeUnknown("transformers is not installed here to read its config.json") from None
    model_type = raw.get("model_type")
    if model_type is None:
        cls = PretrainedConfig
    elif not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        import transformers

        raise SizeUnknown(f"its model_type {model_type!r} is not one transformers {transformers.__version__} knows")
    else:
        cls = CONFIG_MAPPING[model_type]
    try:
        return cls.from_dict(dict(raw))
    # a config class checks its values as it likes (ValueError, TypeError, AttributeError, KeyError...): any of
    # them means only that the size stays unknown
    except Exception as exc:
        raise SizeUnknown(f"transformers cannot build its {cls.__name__} ({_said(exc)})") from None


@dataclass(frozen=True)
class Dims:
    """A model's sizes, as the estimate counts them: its layers' linear modules, embeddings and head."""

    vocab: int
    hidden: int
    intermediate: int
    layers: int
    q_out: int
    kv_out: int
    experts: int
    tied: bool
    dtype: str
    gated: bool = True  # gate, up and down projections (Llama-like); else up and down only
    cross_layers: int = 0  # decoder layers of an encoder-decoder, each with a cross-attention

    @classmethod
    def of(cls, raw: dict) -> "Dims":
        """The sizes of a ``config.json``'s model (its language model's, for a multimodal one)."""
        config = plain_config(raw) or transformers_config(raw)
        try:
            text = config.get_text_config() if hasattr(config, "get_text_config") else config
        except Exception:  # a composite config without a text part
            text = config
        hidden = _size(text, "hidden_size") or _size(config, "hidden_size")
        if not hidden:
            raise SizeUnknown(f"its {type(config).__name__} gives no hidden size")
        heads = _size(text, "num_attention_heads") or 1
        head_dim = _size(text, "head_dim") or _size(text, "d_kv") or max(hidden // heads, 1)
        kv_heads = _size(text, "num_key_value_heads") or heads
        encoder, decoder = _layers(text)
        experts = _first(text, ("num_local_experts", "num_experts", "n_routed_experts")) or 1
        ffn = (_size(text, "moe_intermediate_size") if experts > 1 else 0) or _first(text, _FFN_NAMES) or 4 * hidden
        return cls(
            vocab=_size(text, "vocab_size") or _size(config, "vocab_size"),  # 0: no token embeddings (vision, audio)
            hidden=hidden,
            intermediate=ffn,
            layers=encoder + decoder,
            q_out=heads * head_dim,
            kv_out=kv_heads * head_dim,
            experts=experts,
            tied=bool(raw.get("tie_word_embeddings", _attr(text, "tie_word_embeddings") or False)),
            dtype=_dtype(raw),
            gated=_gated(text),
            cross_layers=decoder,
        )

    def linears(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each of a layer's linear modules, by the names LoRA targets."""
        h, i = self.hidden, self.intermediate
        mlp = {"gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
        if not self.gated:
            del mlp["gate_proj"]
        return {"q_proj": (h, self.q_out), "k_proj": (h, self.kv_out), "v_proj": (h, self.kv_out),
                "o_proj": (self.q_out, h), **mlp}

    def attention_params(self) -> int:
        h = self.hidden
        return 2 * h * self.q_out + 2 * h * self.kv_out

    def layer_linear_params(self) -> int:
        return sum(a * b * (self.experts if name in ("gate_proj", "up_proj", "down_proj") else 1)
                   for name, (a, b) in self.linears().items())

    def params(self) -> tuple[int, int]:
        """(parameters in linear layers that quantization shrinks, the rest: embeddings, head, norms)."""
        linear = self.layers * self.layer_linear_params() + self.cross_layers * self.attention_params()
        other = self.vocab * self.hidden * (1 if self.tied else 2) + (2 * self.layers + 1) * self.hidden
        return linear, other

    def lora_params(self, r: int, targets) -> int:
        names = self.linears()
        if targets in (None, ()):
            chosen = ["q_proj", "v_proj"]  # PEFT's default for Llama-like models
        elif targets == "all-linear" or not isinstance(targets, (tuple, list)):
            chosen = list(names)
        else:
            chosen = [t for t in targets if t in names]
        per_layer = sum(r * sum(names[t]) * (self.experts if t in ("gate_proj", "up_proj", "down_proj") else 1)
                        for t in chosen)
        return self.layers * per_layer


def _said(exc: Exception) -> str:
    """An exception in one line of a reason: its first line, cut short."""
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first[:160]}" if first else type(exc).__name__


def _attr(config, name: str):
    """``config.name`` through its ``attribute_map``; None where the class has no such attribute."""
    try:
        return getattr(config, name, None)
    except Exception:  # a property of a config class that cannot answer for these values
        return None


def _size(config, name: str) -> int:
    """A positive whole size, or 0 where the config has none (None, a list per layer, a string)."""
    value = _attr(config, name)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _first(config, names) -> int:
    return next((n for n in (_size(config, name) for name in names) if n), 0)


def _layers(config) -> tuple[int, int]:
    """(encoder or decoder-only layers, decoder layers of an encoder-decoder) as the config says."""
    if not _attr(config, "is_encoder_decoder"):
        return _size(config, "num_hidden_layers") or 1, 0
    encoder = _first(config, ("encoder_layers", "num_layers", "num_hidden_layers")) or 1
    decoder = _first(config, ("decoder_layers", "num_decoder_layers")) or encoder
    return encoder, decoder


def _gated(config) -> bool:
    """A gated MLP (gate, up and down projections): T5's ``is_gated_act`` where it says; Gemma's, whose gate
    goes through a GELU; a SiLU-family activation; and, where the config names no activation at all, the
    Llama-like layout the estimate was fitted on."""
    if _attr(config, "is_gated_act") is not None:
        return bool(_attr(config, "is_gated_act"))
    if _attr(config, "hidden_activation") is not None or str(_attr(config, "model_type") or "").startswith("gemma"):
        return True
    act = next((a for a in map(lambda n: _attr(config, n), ("hidden_act", "activation_function", "activation"))
                if isinstance(a, str)), None)
    return act is None or act in _GATED_ACTIVATIONS


def _dtype(raw: dict) -> str:
    """The checkpoint's dtype as its config.json writes it (``torch_dtype``, or ``dtype`` since transformers 5)."""
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else {}
    for source in (raw, text):
        for key in ("torch_dtype", "dtype"):
            if isinstance(source.get(key), str):
                return source[key]
    return "float32"
