"""An explicit first GPU becomes this rank's device: the rule and where it has work."""

from __future__ import annotations

import ast
import re

from .. import ast_helpers
from ..cst_helpers import (
    code_of,
    cst,
    dotted_name,
    fixed_expression,
    fixed_statement,
    is_attribute,
    is_name,
    string_value,
)
from ..engine.rule import Rule

#: An explicit GPU: ``"cuda:0"``.
CUDA_INDEX = re.compile(r"^cuda:\d+$")
#: The runtime call that gives each rank its own ``torch.device``.
DEVICE_EXPR = "_nbddp.device()"


class DeviceRule(Rule):
    """An explicit first GPU becomes this rank's device.

    ``"cuda:0"`` (in ``torch.device("cuda:0")``, ``.to("cuda:0")``, ``device="cuda:0"``), ``.cuda(0)`` and
    ``torch.cuda.set_device(0)`` would put every rank on GPU 0; they become ``_nbddp.device()``. A bare
    ``"cuda"`` and ``.cuda()`` already mean the current device, which ``_nbddp.setup()`` made this rank's.
    ``os.environ["CUDA_VISIBLE_DEVICES"] = …`` is dropped: torchrun gives each rank its GPU, and CUDA is
    already initialised when the notebook's code runs.
    """

    # -- where it has work: Python's ast, before libcst reads anything

    name = "device"
    keywords = frozenset({"device_map"})  # its strings are DeviceMap's
    pattern = re.compile(r"cuda:\d|CUDA_VISIBLE_DEVICES|\.cuda\(\s*\d|set_device\(\s*\d")

    @classmethod
    def touches(cls, stmt, facts, nodes) -> bool:
        for node in nodes:
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and CUDA_INDEX.match(node.value):
                return True
            if isinstance(node, ast.Call) and (
                isinstance(node.func, ast.Attribute) and node.func.attr == "cuda"
                or ast_helpers.dotted_name(node.func) == "torch.cuda.set_device"
            ):
                return True
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Subscript) and ast_helpers.dotted_name(t.value) == "os.environ" for t in node.targets
            ):
                return True
        return False

    # -- what it does: libcst

    def __init__(self, facts, chunk):
        super().__init__(facts, chunk)
        self._in_device_map = 0  # DeviceMapRule owns device_map values

    def visit_Arg(self, node: cst.Arg) -> None:
        self._in_device_map += is_name(node.keyword, "device_map")

    def leave_Arg(self, original: cst.Arg, updated: cst.Arg) -> cst.Arg:
        self._in_device_map -= is_name(original.keyword, "device_map")
        return updated

    def leave_SimpleString(self, original: cst.SimpleString, updated: cst.SimpleString) -> cst.BaseExpression:
        value = string_value(updated)
        if self._in_device_map or value is None or not CUDA_INDEX.match(value):
            return updated
        self.note(original, f"{value!r} → this rank's device")
        return fixed_expression(DEVICE_EXPR)

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.Call:
        name = dotted_name(updated.func) or ""
        is_cuda = is_attribute(updated.func, "cuda")
        if (name == "torch.cuda.set_device" or is_cuda) and len(updated.args) == 1 and isinstance(
            updated.args[0].value, cst.Integer
        ):
            self.note(original, f"{code_of(original)} → this rank's device")
            return updated.with_changes(args=[updated.args[0].with_changes(value=fixed_expression(DEVICE_EXPR))])
        return updated

    def leave_SimpleStatementLine(self, original, updated):
        if len(updated.body) == 1 and _environ_key(updated.body[0]) == "CUDA_VISIBLE_DEVICES":
            self.note(original, "CUDA_VISIBLE_DEVICES dropped: torchrun gives each rank its GPU")
            return fixed_statement("pass  # nbddp: CUDA_VISIBLE_DEVICES left to torchrun\n").with_changes(
                leading_lines=updated.leading_lines
            )
        return updated


def _environ_key(small: cst.BaseSmallStatement) -> str | None:
    """The key of ``os.environ["KEY"] = …`` (one target, a plain string key), else None."""
    if not isinstance(small, cst.Assign) or len(small.targets) != 1:
        return None
    target = small.targets[0].target
    if not isinstance(target, cst.Subscript) or len(target.slice) != 1:
        return None
    if not (is_attribute(target.value, "environ") and is_name(target.value.value, "os")):
        return None
    index = target.slice[0].slice
    return string_value(index.value) if isinstance(index, cst.Index) else None
