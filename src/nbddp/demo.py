"""The embedded default: a tiny model, its tokenizer and a learnable dataset, all made locally.

Nothing here downloads. ``tiny_model()`` writes a randomly initialised Llama-architecture model and a
character-level tokenizer into a cache folder once and returns its path, so a notebook loads it the way
it would load any hub model: ``AutoModelForCausalLM.from_pretrained(path, device_map=...)``.
``arithmetic_dataset()`` gives short sums whose answers a LoRA adapter learns in a few dozen steps.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from pathlib import Path

# Characters the tokenizer knows: digits, the operators and the words of the prompt template.
_ALPHABET = list("0123456789+-=?: ") + list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.,\n")
_SPECIAL = ["<pad>", "<s>", "</s>", "<unk>"]

#: Small enough for a CPU step in a few tens of milliseconds, large enough to learn sums.
TINY_CONFIG = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    tie_word_embeddings=False,
)


def cache_dir() -> Path:
    """Where the tiny model is kept: ``$NBDDP_CACHE`` or ``~/.cache/nbddp``."""
    return Path(os.environ.get("NBDDP_CACHE") or Path.home() / ".cache" / "nbddp")


def build_tokenizer():
    """A character-level ``PreTrainedTokenizerFast`` built with the ``tokenizers`` library."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(_SPECIAL + _ALPHABET)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", vocab["<s>"])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )


def build_model(tokenizer=None, seed: int = 0):
    """A randomly initialised ``LlamaForCausalLM`` of ``TINY_CONFIG``'s shape.

    The caller's random state is left as it was, so a script that builds the model on its first run (the
    cache is empty) and one that loads it afterwards draw the same numbers from then on.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = tokenizer or build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **TINY_CONFIG,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaForCausalLM(config)


def tiny_model(path: str | os.PathLike | None = None) -> str:
    """Write the tiny model and tokenizer to ``path`` (default: the cache) once; return the path.

    Safe when several ranks call it at once: the first process of each machine writes (into a private
    temporary folder, renamed into place) while the others wait. The files are written directly, not with
    ``save_pretrained``, which under a process group writes only on global rank 0.
    """
    from .runtime import is_local_main_process, main_process_first

    target = Path(path) if path else cache_dir() / "tiny-llama"
    with main_process_first():
        if is_local_main_process() and not (target / "config.json").exists():
            _write_tiny_model(target)
    return str(target)


def _write_tiny_model(target: Path) -> None:
    from safetensors.torch import save_file

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-llama-", dir=target.parent))
    try:
        tokenizer = build_tokenizer()
        model = build_model(tokenizer)
        model.config.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
        tokenizer.save_pretrained(tmp)
        try:
            os.rename(tmp, target)
        except OSError:  # another machine sharing this folder renamed first
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def arithmetic_examples(n: int = 512, seed: int = 0) -> list[dict]:
    """``n`` prompt/answer pairs of two-digit sums, e.g. ``{"prompt": "12+7=", "completion": "19"}``."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, 49), rng.randint(0, 49)
        rows.append({"prompt": f"{a}+{b}=", "completion": str(a + b)})
    return rows


def arithmetic_dataset(n: int = 512, seed: int = 0):
    """A ``datasets.Dataset`` with a ``text`` column: ``"Q: 12+7=? A: 19"``, one sum a row."""
    from datasets import Dataset

    rows = [{"text": f"Q: {r['prompt']}? A: {r['completion']}"} for r in arithmetic_examples(n, seed)]
    return Dataset.from_list(rows)
