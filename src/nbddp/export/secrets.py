"""Find credentials written into notebook cells before an export publishes them.

A Kaggle kernel's code is readable by whoever can open the kernel (by everyone once it is public), so a
token pasted into a cell leaks with it. ``find_secrets`` looks at each cell's raw source, line by line, for
the token formats of the services a fine-tune talks to (Hugging Face, Weights & Biases, Kaggle, OpenAI-style
``sk-…`` keys, GitHub, AWS) and for long literal values assigned to names such as ``*_token``,
``api_key`` or ``password``. ``check_secrets`` turns the first finding into a ``SecretError`` at its cell and
line, with the way Kaggle keeps secrets out of code.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..cells import Cell
from ..errors import SecretError

_QUOTED = r"""["']([^"'\s]{16,})["']"""

#: (what it is, pattern); group 1, when present, is the secret itself, else the whole match.
PATTERNS: tuple[tuple[str, re.Pattern], ...] = (
    ("Hugging Face token", re.compile(r"\bhf_[A-Za-z0-9]{30,}")),
    ("OpenAI-style API key", re.compile(r"\bsk-(?:[A-Za-z0-9]+-)*[A-Za-z0-9_-]{20,}")),
    ("GitHub token", re.compile(r"\b(?:gh[pousr]_[A-Za-z0-9]{36,}|github_pat_[A-Za-z0-9_]{40,})")),
    ("AWS access key id", re.compile(r"\bAKIA[0-9A-Z]{16}\b")),
    ("Kaggle API token", re.compile(r"\bKGAT_[A-Za-z0-9]{20,}")),
    # A W&B key is 40 hex digits, a Kaggle key 32: only recognisable next to the service's name.
    ("Weights & Biases API key", re.compile(r"(?i)wandb.*?[\"'=\s]([0-9a-f]{40})\b")),
    ("Kaggle API key", re.compile(r"(?i)\bkaggle.*?[\"'=\s]([0-9a-f]{32})\b")),
    # name = "long literal", name: "…" in a dict, os.environ["NAME"] = "…", %env NAME=value
    (
        "credential",
        re.compile(
            r"(?i)\b\w*(?:token|api_?key|secret|passw(?:or)?d)\b[\"']?\]?\s*[:=]\s*" + _QUOTED
            + r"|%(?:set_)?env\s+\w*(?:token|api_?key|secret|passw(?:or)?d)\w*[=\s]+([^\s\"']{16,})"
        ),
    ),
)

#: The Kaggle secret a finding would usually be stored as.
_SECRET_NAMES = {
    "Hugging Face token": "HF_TOKEN",
    "Weights & Biases API key": "WANDB_API_KEY",
    "OpenAI-style API key": "OPENAI_API_KEY",
    "Kaggle API token": "KAGGLE_KEY",
    "Kaggle API key": "KAGGLE_KEY",
    "GitHub token": "GITHUB_TOKEN",
    "AWS access key id": "AWS_ACCESS_KEY_ID",
}


@dataclass(frozen=True)
class Finding:
    """One credential-looking value at a cell and line; ``masked`` is the line with the value cut short."""

    cell: int
    line: int
    kind: str
    masked: str


def _looks_random(value: str) -> bool:
    """Keeps ``model_name = "meta-llama/Llama-3.2-1B"``-like values out of the generic rule: letters and digits."""
    return bool(re.search(r"[0-9]", value) and re.search(r"[A-Za-z]", value)) and "/" not in value and "<" not in value


def find_secrets(cells: list[Cell]) -> list[Finding]:
    """Every line of every cell that holds something credential-shaped, in cell and line order."""
    found = []
    for cell in cells:
        for n, text in enumerate(cell.source.splitlines(), start=1):
            for kind, pattern in PATTERNS:
                match = pattern.search(text)
                if not match:
                    continue
                secret = next((g for g in match.groups() if g), match.group(0))
                if kind == "credential" and not _looks_random(secret):
                    continue
                found.append(Finding(cell.index, n, kind, text.replace(secret, secret[:6] + "…").strip()))
                break
    return found


def check_secrets(cells: list[Cell]) -> None:
    """Raise ``SecretError`` at the first credential found, naming every other place too."""
    found = find_secrets(cells)
    if not found:
        return
    first = found[0]
    name = _SECRET_NAMES.get(first.kind, "MY_SECRET")
    others = "".join(f"\n  also cell {f.cell}, line {f.line}: {f.kind}" for f in found[1:])
    article = "an" if first.kind[0] in "AEIOU" else "a"
    message = (
        f"{article} {first.kind} is written in the notebook; the export would publish it with the kernel's code:\n"
        f"    {first.masked}{others}\n"
        f"Store it as a Kaggle secret (notebook editor → Add-ons → Secrets, name {name}) and read it at run time:\n"
        f"    from kaggle_secrets import UserSecretsClient\n"
        f"    os.environ[\"{name}\"] = UserSecretsClient().get_secret(\"{name}\")\n"
        f"or export anyway with --allow-secrets."
    )
    raise SecretError(message, cell=first.cell, line=first.line)
