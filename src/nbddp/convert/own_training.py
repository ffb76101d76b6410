"""A training loop in a method of the notebook's own class (``facts/own_classes.py``), refused before launch at
the first call that runs it (``--every-rank`` too: each rank would train a copy alone, never synchronised)."""

from __future__ import annotations

from .facts.own_classes import refusal
from .refusal import refuse_at


def refuse_own_training(facts, cleaned) -> None:
    if facts.own_trainings:
        found = facts.own_trainings[0]
        refuse_at(found.position, found.line, cleaned, refusal(found))
