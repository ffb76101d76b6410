"""Classes the notebook defines itself whose methods train (``loss.backward()`` in a method), and the calls that
run those methods: a training loop nbddp does not distribute, refused before launch at the call.

A Kaggle notebook often writes its own ``class Trainer:`` (or ``Fitter``, ``Engine``) holding the model, the
optimizer and a ``train()`` method with the loop. Its name is not transformers' ``Trainer``, which distributes
itself; its loop sits in a method, where nbddp neither wraps the model nor shards the loader. Launched as it is,
every rank would train on every sample with no gradient sync: two GPUs doing one GPU's work twice, in silence.
A class that derives from a library's trainer (``class MyTrainer(Trainer)`` of transformers) is that trainer.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

from ..ast_helpers import last_name
from .training import is_trainer_class


@dataclass(frozen=True)
class OwnTraining:
    """A call that runs a training method of the notebook's own class: where it is, and what it calls."""

    position: int  # the cell's position among the cleaned cells
    line: int  # the call's line in the cleaned cell
    owner: str  # the class
    method: str


def own_class(node: ast.ClassDef, own: dict[str, frozenset[str]]) -> frozenset[str] | None:
    """The training methods of a class the notebook defines (those whose body calls ``.backward()``, or calls
    another such method through ``self``, and those its own base classes have), or None where it derives from a
    library's trainer (its base's name ends in ``Trainer`` and is no class of the notebook's)."""
    bases = [last_name(b) for b in node.bases]
    if any(is_trainer_class(b) and b not in own for b in bases):
        return None
    methods = {m.name: m for m in node.body if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))}
    training = set().union(*(own.get(b, ()) for b in bases)) - methods.keys()
    training |= {name for name, m in methods.items() if any(_calls(m, "backward"))}
    while grown := {name for name, m in methods.items() if name not in training
                    and any(_self_call(c) in training for c in ast.walk(m) if isinstance(c, ast.Call))}:
        training |= grown
    return frozenset(training)


def _calls(node: ast.AST, attr: str):
    return (c for c in ast.walk(node) if isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute)
            and c.func.attr == attr)


def _self_call(call: ast.Call) -> str | None:
    func = call.func
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "self":
        return func.attr
    return None


def owner_called(call: ast.Call, instances: dict[str, str], own: dict[str, frozenset[str]]) -> str | None:
    """The notebook's class whose training method ``call`` runs (``trainer.train(…)`` on an instance of it,
    ``Fitter(…).fit(…)``), or None."""
    func = call.func
    if not isinstance(func, ast.Attribute):
        return None
    held = func.value
    if isinstance(held, ast.Name):
        owner = instances.get(held.id)
    elif isinstance(held, ast.Call):
        owner = last_name(held.func)
    else:
        return None
    return owner if owner in own and func.attr in own[owner] else None


def refusal(found: OwnTraining) -> str:
    return (f"{found.owner}.{found.method}() trains in a method of the notebook's own class {found.owner}, a loop "
            "nbddp does not distribute: every rank would train on every sample, with no gradient sync. Move the "
            "loop into a function or a cell (for batch in train_loader: … loss.backward()), where nbddp wraps the "
            "model and gives each rank its share of the loader, or run the notebook in its kernel, in one process")
