"""DDP-safe settings in trainer configurations: the rule and where it has work."""

from __future__ import annotations

import re

from .. import ast_helpers
from ..cst_helpers import code_of, cst, fixed_expression, has_star_kwargs, is_name, keyword, last_name, set_keyword
from ..engine.rule import Rule

#: Trainer configurations the rule completes.
TRAINER_CONFIGS = frozenset(
    {"TrainingArguments", "Seq2SeqTrainingArguments", "UnslothTrainingArguments"}
    | {
        f"{p}Config"
        for p in "SFT DPO GRPO ORPO KTO CPO BCO PPO RLOO Reward PRM GKD OnlineDPO XPO Nash Unsloth".split()
    }
)


class TrainerConfigRule(Rule):
    """Trainer configurations get DDP-safe settings the user did not set; values the user set are kept.

    - ``ddp_find_unused_parameters=False`` where the notebook trains a PEFT adapter (``JobFacts.peft``): the
      HF Trainer turns it on for every model that is not a plain ``PreTrainedModel`` (every PEFT model),
      which costs an extra graph traversal each step and, with reentrant gradient checkpointing, fails with
      "marked as ready twice". LoRA adapters are all used in every step, so ``False`` is right there. A full
      fine-tune keeps the Trainer's own choice: its model may skip layers (LayerDrop) or leave heads unused,
      where ``False`` fails at the first step that skips one.
    - ``log_on_each_node=False``: logs come from global rank 0 only, not once per machine.
    - ``gradient_checkpointing_kwargs={"use_reentrant": False}`` when ``gradient_checkpointing=True``:
      reentrant checkpointing and DDP's reducer do not mix.

    A value the user wrote is never replaced; where it is not the DDP-safe one the change list says so. A
    call with ``**kwargs`` gets nothing added (the keys may be in them, and a duplicate would fail).
    """

    # -- where it has work: Python's ast, before libcst reads anything

    name = "trainer_config"
    #: the settings the rule adds where absent, and ``gradient_checkpointing``, which decides one of them
    keywords = frozenset({"ddp_find_unused_parameters", "log_on_each_node", "gradient_checkpointing",
                          "gradient_checkpointing_kwargs"})
    pattern = re.compile(r"\b(?:" + "|".join(sorted(TRAINER_CONFIGS)) + r")\s*\(")

    @classmethod
    def touches(cls, stmt, facts, nodes) -> bool:
        return any(ast_helpers.last_name(c.func) in TRAINER_CONFIGS for c in ast_helpers.calls(nodes))

    # -- what it does: libcst

    _UNUSED = ("ddp_find_unused_parameters", "False", "a PEFT model: every LoRA weight trains each step")
    _LOGS = ("log_on_each_node", "False", "logs from rank 0 only")

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.Call:
        config = last_name(updated.func)
        if config not in TRAINER_CONFIGS:
            return updated
        if has_star_kwargs(updated):
            advice = "set ddp_find_unused_parameters=False yourself" if self.facts.peft else "set log_on_each_node=False yourself"
            self.note(original, f"{config}: has **kwargs, left alone; {advice}")
            return updated
        settings = [self._UNUSED, self._LOGS] if self.facts.peft else [self._LOGS]
        checkpointing = keyword(updated, "gradient_checkpointing")
        if checkpointing is not None and is_name(checkpointing.value, "True"):
            settings.append(("gradient_checkpointing_kwargs", '{"use_reentrant": False}', "DDP needs non-reentrant checkpointing"))
        for key, value, why in settings:
            given = keyword(updated, key)
            if given is None:
                updated, _ = set_keyword(updated, key, fixed_expression(value))
                self.note(original, f"{config}: {key}={value} ({why})")
            elif code_of(given.value) != value:
                self.note(original, f"{config}: kept {key}={code_of(given.value)} as written (DDP-safe: {value})")
        return updated
