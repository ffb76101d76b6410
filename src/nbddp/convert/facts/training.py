"""Facts about trainers and training: which names hold trainers, which calls and functions train, which
calls every rank must make together."""

from __future__ import annotations

import ast
import re
from typing import TYPE_CHECKING

from ..ast_helpers import dotted_name, last_name

if TYPE_CHECKING:
    from ..code import Statement
    from .job_facts import JobFacts, Seen


#: Trainer methods every rank must call together under DDP.
_TRAINER_COLLECTIVES = frozenset({"train", "evaluate", "predict", "fit"})
#: Runtime calls with barriers inside: they must run on every rank.
_RUNTIME_COLLECTIVES = frozenset({"shell", "shell_cell", "write_file", "main_process_first"})


def is_trainer_class(name: str | None) -> bool:
    return bool(name) and name.endswith("Trainer")


def makes_trainer(name: str | None, facts: JobFacts) -> bool:
    """``name(…)`` makes a trainer that distributes itself: a ``…Trainer`` class, not one of the notebook's own
    with a training loop in its methods (``facts/own_classes.py``: nbddp refuses those)."""
    return is_trainer_class(name) and not facts.own_classes.get(name)


#: A helper's name that says it returns a trainer: ``create_trainer``, ``get_trainer``, ``build_sft_trainer``.
_TRAINER_FACTORY = re.compile(r"^(?:get|create|build|make|setup|set_up|init|prepare|new)_?\w*trainer$", re.I)


def is_trainer_factory(name: str | None) -> bool:
    return bool(name) and _TRAINER_FACTORY.match(name) is not None


def is_training_call(node: ast.Call, facts: JobFacts) -> bool:
    """``trainer.train()`` on a known trainer, ``SomeTrainer(...).train()``, ``unsloth_train(trainer)``,
    ``loss.backward()``, a call to a function of the notebook that trains, or to an imported one that does
    (``is_helper_training``)."""
    func = node.func
    if isinstance(func, ast.Attribute):
        owner, attr = func.value, func.attr
        if attr == "backward":
            return True
        if attr in ("train", "fit"):
            if isinstance(owner, ast.Name) and owner.id in facts.trainer_names:
                return True
            if isinstance(owner, ast.Call) and makes_trainer(last_name(owner.func), facts):
                return True
        return is_helper_training(node, facts)
    if isinstance(func, ast.Name) and func.id == "notebook_launcher":
        return launches(node, facts)
    return isinstance(func, ast.Name) and (func.id == "unsloth_train" or func.id in facts.training_functions) \
        or is_helper_training(node, facts)


#: A function named for training: ``train``, ``engine.train``, ``train_model``, ``fit_one_cycle``.
TRAINS_BY_NAME = re.compile(r"(?:^|_)(?:train|fit)(?:_|$)", re.I)


def is_helper_training(call: ast.Call, facts: JobFacts) -> bool:
    """``engine.train(model=model, …, optimizer=optimizer)``: a function the notebook imports (pytorch_dl's
    ``going_modular.engine``) named for training and given a model an optimizer gets and that optimizer.
    Its loop is out of sight; what it is given is what nbddp distributes."""
    name = last_name(call.func)
    if not name or not TRAINS_BY_NAME.search(name) or name in facts.training_functions:
        return False
    given = {v.id for v in [*call.args, *(k.value for k in call.keywords)] if isinstance(v, ast.Name)}
    return not given.isdisjoint(facts.ddp_models) and not given.isdisjoint(facts.optimizers)


def is_collective_call(node: ast.Call, facts: JobFacts) -> bool:
    """A call every rank must make together: training, ``trainer.evaluate()``/``predict()``, collectives of
    ``torch.distributed`` or Accelerate, and the runtime helpers with barriers inside."""
    if is_training_call(node, facts):
        return True
    name = dotted_name(node.func) or ""
    head, _, attr = name.rpartition(".")
    if head in facts.trainer_names and attr in _TRAINER_COLLECTIVES:
        return True
    if head == "_nbddp" and attr in _RUNTIME_COLLECTIVES:
        return True
    if isinstance(node.func, ast.Name) and node.func.id in facts.collective_functions:
        return True
    return name.startswith(("dist.", "torch.distributed.", "accelerator."))


def launches(call: ast.Call, facts: JobFacts) -> bool:
    """``notebook_launcher(train_fn, …)`` of a training function: each rank runs it (``runtime.launchers``)."""
    return (isinstance(call.func, ast.Name) and call.func.id == "notebook_launcher" and bool(call.args)
            and isinstance(call.args[0], ast.Name) and call.args[0].id in facts.training_functions)


def plan_trainers(seen: Seen, defs: dict[str, list[ast.Call]], facts: JobFacts) -> None:
    """Names bound to what a function of the notebook returns when that function builds a trainer
    (``trainer_x = create_trainer(…)``): their ``.train()`` trains."""
    factories = {name for name, calls in defs.items() if any(makes_trainer(last_name(c.func), facts) for c in calls)}
    for targets, call in seen.assigned:
        if isinstance(call.func, ast.Name) and call.func.id in factories:
            facts.trainer_names.update(targets)


def plan_training_functions(defs: dict[str, list[ast.Call]], facts: JobFacts) -> None:
    """A function trains if it trains directly or calls one that does; likewise for collectives."""
    changed = True
    while changed:
        changed = False
        for name, calls in defs.items():
            if name not in facts.training_functions and any(is_training_call(c, facts) for c in calls):
                facts.training_functions.add(name)
                changed = True
            if name not in facts.collective_functions and any(is_collective_call(c, facts) for c in calls):
                facts.collective_functions.add(name)
                changed = True


def is_plain_loop(training: list[Statement], facts: JobFacts) -> bool:
    """A plain PyTorch loop: the training statements call ``backward`` or a function of the notebook that
    trains (or launch one), with no trainer and no DistributedDataParallel of the notebook's own."""
    return not facts.trainer_names and not facts.self_distributed and any(
        last_name(c.func) == "backward" or last_name(c.func) in facts.training_functions or launches(c, facts)
        or is_helper_training(c, facts)
        for stmt in training for c in stmt.calls
    )
