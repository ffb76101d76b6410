"""Plain PyTorch: in training code rank 0 prints and saves: the rule and where it has work."""

from __future__ import annotations

import ast
import re

from .. import ast_helpers
from ..cst_helpers import code_of, cst, fixed_expression, is_attribute, is_name
from ..engine.rule import Rule
from .rank_zero import MAIN_PROCESS_EXPR


class LoopOutputRule(Rule):
    """Plain PyTorch: inside the training loop, metrics are printed and checkpoints saved by rank 0 only.

    The notebook's own loop runs on every rank; its ``print(f"epoch {e} loss …")`` would come once per GPU
    and ``torch.save(…, "best.pt")`` would have every rank write the same file at once. In the statements
    that train and in the functions that train, ``print`` becomes ``_nbddp.print0`` and a ``torch.save``
    statement gets ``if _nbddp.on_rank0():`` on its own line.
    """

    # -- where it has work: Python's ast, before libcst reads anything

    name = "loop_output"
    pattern = re.compile(r"\bprint\s*\(|torch\.save|\.savefig\s*\(|\.to_csv\s*\(")

    @classmethod
    def wanted(cls, cell, facts) -> bool:
        code = cell.code
        trains = ".backward(" in code or any(f"{name}(" in code for name in facts.training_functions)
        return facts.plain_loop and trains and super().wanted(cell, facts)

    @classmethod
    def touches(cls, stmt, facts, nodes) -> bool:
        trains = stmt in facts.loops or any(
            isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name in facts.training_functions for n in nodes
        )
        return trains and any(
            isinstance(c.func, ast.Name) and c.func.id == "print" or ast_helpers.dotted_name(c.func) == "torch.save"
            or ast_helpers.last_name(c.func) in _SAVES for c in ast_helpers.calls(nodes)
        )

    # -- what it does: libcst

    def __init__(self, facts, chunk):
        super().__init__(facts, chunk)
        self._training: set[cst.CSTNode] = set()
        self._depth = 0

    def visit_Module(self, node: cst.Module) -> None:
        self._training = {s for s in node.body if self.statement(s) in self.facts.loops}

    def _trains(self, node: cst.CSTNode) -> bool:
        return node in self._training or (
            isinstance(node, cst.FunctionDef) and node.name.value in self.facts.training_functions
        )

    def on_visit(self, node: cst.CSTNode) -> bool:
        if self._trains(node):
            self._depth += 1
        return super().on_visit(node)

    def on_leave(self, original, updated):
        result = super().on_leave(original, updated)
        if self._trains(original):
            self._depth -= 1
        return result

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.Call:
        if self._depth and is_name(updated.func, "print"):
            self.note(original, "print → _nbddp.print0 (rank 0 prints)")
            return updated.with_changes(func=fixed_expression("_nbddp.print0"))
        return updated

    def leave_SimpleStatementLine(self, original, updated):
        if self._depth and len(updated.body) == 1 and _is_torch_save(updated.body[0]):
            what = code_of(updated.body[0].value.func)
            self.note(original, f"{what} in the training loop: rank 0 saves")
            return cst.If(
                test=fixed_expression(MAIN_PROCESS_EXPR),
                body=cst.SimpleStatementSuite(body=list(updated.body), trailing_whitespace=updated.trailing_whitespace),
                leading_lines=updated.leading_lines,
            )
        return updated


#: Other saves a training loop makes that every rank would write at once: a figure, a table. (Not a model's
#: ``save_pretrained``: under FSDP its weights are sharded, and rank 0 alone cannot gather them.)
_SAVES = frozenset({"savefig", "to_csv"})


def _is_torch_save(small: cst.BaseSmallStatement) -> bool:
    """A ``torch.save(…)`` expression statement, or one of ``_SAVES`` (``plt.savefig(f"epoch{e}.png")``)."""
    if not isinstance(small, cst.Expr) or not isinstance(small.value, cst.Call):
        return False
    func = small.value.func
    return is_attribute(func, "save") and is_name(func.value, "torch") or is_attribute(func, *_SAVES)
