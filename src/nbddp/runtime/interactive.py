"""What waits for a person in a notebook cannot wait in a rank: ``input()`` and Hugging Face's logins.

Under torchrun no rank has a keyboard: ``input()`` would block (or read end-of-file) on every rank, and
``notebook_login()``/``login()`` without a token would start one browser login per rank. Here ``input()``
raises an error saying what to do, and the Hub's prompting logins pass when a token is already there (the
``HF_TOKEN`` environment variable, which the launcher passes to every rank, or a login saved on the machine
before launch) and raise otherwise; the launcher maps the error to the notebook's cell and line.
"""

from __future__ import annotations

import builtins
import os

from .patching import wrap, when_imported

INPUT_MESSAGE = (
    "input() waits for a person, and the ranks of a training job have no keyboard: set the value in the cell, "
    "or read it from an environment variable (os.environ) given to the job"
)
LOGIN_MESSAGE = (
    "logging in to the Hugging Face Hub without a token (notebook_login(), login()) asks a person, once per "
    "rank: log in before launch (`hf auth login`, or notebook_login() in the kernel) or pass a token as the "
    "HF_TOKEN environment variable"
)


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ


def guard() -> None:
    """In a rank started by torchrun: ``input()`` explains itself, the Hub's logins never prompt; in a kept
    job's rank, the kernel's Stop during the notebook's own training stops it at a step (``serve.listen_for_stop``)."""
    if not under_torchrun():
        return
    if not getattr(builtins.input, "_nbddp", False):
        builtins.input = _no_input
    when_imported("huggingface_hub._login", _patch_hub_logins)
    from . import serve

    serve.listen_for_stop()


def _no_input(prompt: object = "") -> str:
    raise RuntimeError(INPUT_MESSAGE)


_no_input._nbddp = True


def _patch_hub_logins(module) -> None:
    for name in ("notebook_login", "interpreter_login"):
        wrap(module, name, _no_prompt(module, name))


def _no_prompt(module, name: str):
    def make(original):
        def login(*args, **kwargs):
            if module.get_token() is not None:  # HF_TOKEN or a saved login: nothing to ask
                return None
            raise RuntimeError(LOGIN_MESSAGE)

        return login

    make.__qualname__ = f"_no_prompt.{name}"
    return make
