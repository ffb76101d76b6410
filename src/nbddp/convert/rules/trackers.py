"""Experiment trackers (TensorBoard's ``SummaryWriter``, W&B, MLflow) make one run, on rank 0: the rule and
where it has work."""

from __future__ import annotations

import re

from .. import ast_helpers
from ..cst_helpers import code_of, cst, dotted_name, fixed_expression, keyword, set_keyword
from ..engine.rule import Rule

#: MLflow's calls that start a run or log to one (a log call with no run starts one).
_MLFLOW = frozenset({"start_run", "end_run", "autolog", "set_tag", "set_tags", "set_experiment", "log_param",
                     "log_params", "log_metric", "log_metrics", "log_artifact", "log_artifacts", "log_dict",
                     "log_figure", "log_text", "log_image", "log_input"})


def _tracked(name: str | None, last: str | None) -> str | None:
    """Which tracker a callee is: "writer" (``SummaryWriter``), "wandb" (``wandb.init``), "mlflow"; else None."""
    if last == "SummaryWriter":
        return "writer"
    if name == "wandb.init":
        return "wandb"
    if name and name.startswith("mlflow.") and last in _MLFLOW:
        return "mlflow"
    return None


class TrackersRule(Rule):
    """A tracker the kernel had one run of is made on rank 0 only.

    Every rank runs the notebook's ``writer = SummaryWriter()``, ``wandb.init(…)`` and ``mlflow.start_run()``:
    TensorBoard would show each curve once per rank, W&B and MLflow one run per rank. ``SummaryWriter`` and
    MLflow's run and log calls go through ``_nbddp.rank0_only(…)`` (on the other ranks a stand-in taking any
    call, so ``writer.add_scalar`` runs unchanged); ``wandb.init`` gets ``mode=_nbddp.rank0_mode(…)``
    ("disabled" on the other ranks, where ``wandb.log`` then does nothing).
    """

    # -- where it has work: Python's ast, before libcst reads anything

    name = "trackers"
    pattern = re.compile(r"\bSummaryWriter\s*\(|\bwandb\.init\s*\(|\bmlflow\.")

    @classmethod
    def touches(cls, stmt, facts, nodes) -> bool:
        return any(_tracked(ast_helpers.dotted_name(c.func), ast_helpers.last_name(c.func))
                   for c in ast_helpers.calls(nodes))

    # -- what it does: libcst

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.Call:
        func = updated.func
        kind = _tracked(dotted_name(func), func.attr.value if isinstance(func, cst.Attribute) else
                        func.value if isinstance(func, cst.Name) else None)
        if kind == "wandb":
            given = keyword(updated, "mode")
            mode = f"_nbddp.rank0_mode({code_of(given.value)})" if given is not None else "_nbddp.rank0_mode()"
            if given is not None:
                args = [a.with_changes(value=fixed_expression(mode)) if a is given else a for a in updated.args]
                new = updated.with_changes(args=args)
            else:
                new, _ = set_keyword(updated, "mode", fixed_expression(mode))
            self.note(original, "wandb.init: one W&B run, on rank 0 (mode \"disabled\" on the other ranks)")
            return new
        if kind is not None:
            self.note(original, f"{code_of(func)}: on rank 0 only, as the kernel made one "
                                "(the other ranks get a stand-in that does nothing)")
            return updated.with_changes(func=cst.Call(func=fixed_expression("_nbddp.rank0_only"), args=[cst.Arg(func)]))
        return updated
