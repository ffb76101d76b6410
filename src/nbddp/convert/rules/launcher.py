"""``notebook_launcher(fn, args)`` becomes ``fn(*args)`` in every rank: the rule and where it has work."""

from __future__ import annotations

import re

from .. import ast_helpers
from ..cst_helpers import code_of, cst, keyword, last_name
from ..engine.rule import Rule

#: ``notebook_launcher`` arguments that only say how to start processes: torchrun already started them.
_HOW_TO_START = frozenset({
    "num_processes", "use_port", "master_addr", "node_rank", "num_nodes", "rdzv_backend", "rdzv_endpoint",
    "rdzv_conf", "rdzv_id", "max_restarts", "monitor_interval", "log_line_prefix_template",
})


class LauncherRule(Rule):
    """``notebook_launcher(training_function, args, num_processes=2)`` → ``training_function(*args)``.

    Accelerate's launcher starts its own processes; in a rank of an nbddp job that would start a job inside
    each rank (and wait on the port). Every rank is already one of the job's processes, so each calls the
    function itself and the ``Accelerator()`` inside joins the job. A call with other arguments
    (``mixed_precision=``) is left to the runtime, which does the same in the rank (``runtime.launchers``).
    """

    # -- where it has work: Python's ast, before libcst reads anything

    name = "launcher"
    pattern = re.compile(r"\bnotebook_launcher\s*\(")

    @classmethod
    def touches(cls, stmt, facts, nodes) -> bool:
        return any(ast_helpers.last_name(c.func) == "notebook_launcher" for c in ast_helpers.calls(nodes))

    # -- what it does: libcst

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.BaseExpression:
        if last_name(updated.func) != "notebook_launcher":
            return updated
        positional = [a for a in updated.args if a.keyword is None and not a.star]
        named = {a.keyword.value for a in updated.args if a.keyword is not None}
        if any(a.star for a in updated.args) or len(positional) > 2 or not named <= _HOW_TO_START | {"function", "args"}:
            return updated
        function = keyword(updated, "function") or (positional[0] if positional else None)
        given = keyword(updated, "args") or (positional[1] if len(positional) > 1 else None)
        if function is None:
            return updated
        call = f"{code_of(function.value)}({_spread(given.value) if given is not None else ''})"
        self.note(original, f"notebook_launcher → {call}: every rank of the job is already one of its "
                            "processes (a launcher here would start a job inside each rank)")
        return cst.parse_expression(call)


def _spread(args: cst.BaseExpression) -> str:
    """``(model,)`` → ``model``; ``args`` → ``*args``."""
    if isinstance(args, cst.Tuple) and not any(isinstance(e, cst.StarredElement) for e in args.elements):
        return ", ".join(code_of(e.value) for e in args.elements)
    return f"*{code_of(args)}"
