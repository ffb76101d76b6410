"""Facts about what a plain loop does with the models DDP wraps that only a whole replica allows: pickling one
whole (``torch.save(model, …)``) and running one on rank 0 alone. Under FSDP the wrap shards the model, and
``choose_strategy.refuse_what_it_cannot_run`` refuses both before launch, at the places recorded here."""

from __future__ import annotations

import ast
from typing import TYPE_CHECKING

from ..ast_helpers import dotted_name, keyword, live_calls
from .loaders import call_place
from .rank0 import rank0_runs

if TYPE_CHECKING:
    from ..code import Statement
    from .job_facts import JobFacts


def plan_model_uses(top: list[Statement], facts: JobFacts) -> None:
    """``JobFacts.model_saves``, and ``JobFacts.whole_model_saves`` and ``JobFacts.rank0_forwards`` once the
    wraps are planned."""
    facts.model_saves = {call_place(stmt, call) for stmt in top for call in live_calls(stmt.nodes)
                         if _saves_whole(call, facts.ddp_models)}
    wrapped = {name for names in [*facts.ddp_wrap_after.values(), *facts.ddp_wrap_inside.values()] for name in names}
    if not wrapped:
        return
    facts.whole_model_saves += [(position, line) for position, line, _ in facts.model_saves]
    for run in rank0_runs(top, facts.rank0):
        facts.rank0_forwards += _forwards_in(run, set(wrapped))


def _saves_whole(call: ast.Call, models: set[str]) -> bool:
    """``torch.save(model, …)`` (or ``obj=model``) of a model DDP wraps: the unwrap rule saves the module inside
    (``torch.save(_nbddp.unwrap(model), …)``), the whole model, pickled."""
    if dotted_name(call.func) != "torch.save":
        return False
    if call.args and not isinstance(call.args[0], ast.Starred):
        saved = call.args[0]
    else:
        saved = getattr(keyword(call, "obj"), "value", None)
    return isinstance(saved, ast.Name) and saved.id in models


def _forwards_in(run: list[Statement], sharded: set[str]) -> list[tuple[int, int]]:
    """Where a run of rank-0 statements calls a wrapped model, ``model(…)``, ``model.generate(…)``: under FSDP a
    forward gathers each layer's shards from every rank, and the others are not there. Once a statement of
    the run binds the name to something else (a plain model loaded from the saved weights), it is not counted."""
    found = []
    for stmt in run:
        for node in stmt.nodes:
            found += [(stmt.cell.position, call.lineno) for call in live_calls([node])
                      if _called_model(call.func) in sharded]
            sharded -= {t.id for t in getattr(node, "targets", ()) if isinstance(t, ast.Name)}
    return found


def _called_model(func: ast.expr) -> str | None:
    """``model`` of ``model(…)``, ``model.generate(…)``, ``model.forward(…)``."""
    if isinstance(func, ast.Attribute) and func.attr in ("generate", "forward"):
        func = func.value
    return func.id if isinstance(func, ast.Name) else None

