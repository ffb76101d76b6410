"""An explicit GPU, literal or computed, becomes this rank's device: the rule and where it has work."""

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
#: The text before a computed GPU index: ``f"cuda:{i}"``, ``"cuda:%d" % i``, ``"cuda:{}".format(i)``,
#: ``"cuda:" + str(i)``.
CUDA_PREFIX = "cuda:"
CUDA_TEMPLATE = re.compile(r"^cuda:(%[dis]|\{\})$")
#: The runtime call that gives each rank its own ``torch.device``.
DEVICE_EXPR = "_nbddp.device()"


class DeviceRule(Rule):
    """An explicit first GPU becomes this rank's device.

    ``"cuda:0"`` (in ``torch.device("cuda:0")``, ``.to("cuda:0")``, ``device="cuda:0"``), ``.cuda(0)`` and
    ``torch.cuda.set_device(0)`` would put every rank on GPU 0; they become ``_nbddp.device()``. So does an
    index the notebook computes (``f"cuda:{gpu}"``, ``"cuda:%d" % i``, ``"cuda:{}".format(i)``,
    ``"cuda:" + str(i)``, ``torch.device("cuda", i)``, ``.cuda(args.gpu)``, ``set_device(local_rank)``): every
    rank computes the same one, or one naming another rank's GPU. A bare
    ``"cuda"`` and ``.cuda()`` already mean the current device, which ``_nbddp.setup()`` made this rank's.
    ``os.environ["CUDA_VISIBLE_DEVICES"] = …`` is dropped: torchrun gives each rank its GPU, and CUDA is
    already initialised when the notebook's code runs.
    """

    # -- where it has work: Python's ast, before libcst reads anything

    name = "device"
    keywords = frozenset({"device_map"})  # its strings are DeviceMap's
    pattern = re.compile(r"cuda:|CUDA_VISIBLE_DEVICES|\.cuda\(\s*\w|set_device\(|device\(\s*[\"']cuda[\"']\s*,")

    @classmethod
    def touches(cls, stmt, facts, nodes) -> bool:
        for node in nodes:
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and CUDA_INDEX.match(node.value):
                return True
            if isinstance(node, ast.Call) and (
                isinstance(node.func, ast.Attribute) and node.func.attr == "cuda"
                or ast_helpers.dotted_name(node.func) in ("torch.cuda.set_device", "torch.device")
            ):
                return True
            if _computed_index(node):
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

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.BaseExpression:
        name = dotted_name(updated.func) or ""
        is_cuda = is_attribute(updated.func, "cuda")
        if (name == "torch.cuda.set_device" or is_cuda) and len(updated.args) == 1 and _positional(updated.args[0]):
            # an index, literal or computed (``.cuda(args.gpu)``, ``set_device(local_rank)``): the rank's own
            self.note(original, f"{code_of(original)} → this rank's device")
            return updated.with_changes(args=[updated.args[0].with_changes(value=fixed_expression(DEVICE_EXPR))])
        if name == "torch.device" and len(updated.args) == 2 and string_value(updated.args[0].value) == "cuda":
            self.note(original, f"{code_of(original)} → this rank's device")  # torch.device("cuda", index)
            return fixed_expression(DEVICE_EXPR)
        if _is_template_call(updated):
            return self._computed(original)
        return updated

    def leave_FormattedString(self, original, updated) -> cst.BaseExpression:
        parts = updated.parts
        if all(isinstance(p, cst.FormattedStringText) for p in parts) and CUDA_INDEX.match(
                text := "".join(p.value for p in parts)):  # f"cuda:0": an explicit GPU all the same
            self.note(original, f"{text!r} → this rank's device")
            return fixed_expression(DEVICE_EXPR)
        if (len(parts) == 2 and isinstance(parts[0], cst.FormattedStringText) and parts[0].value == CUDA_PREFIX
                and isinstance(parts[1], cst.FormattedStringExpression)):
            return self._computed(original)
        return updated

    def leave_BinaryOperation(self, original, updated) -> cst.BaseExpression:
        left = string_value(updated.left)
        if isinstance(updated.operator, cst.Modulo) and left is not None and CUDA_TEMPLATE.match(left) or \
                isinstance(updated.operator, cst.Add) and left == CUDA_PREFIX:
            return self._computed(original)
        return updated

    def _computed(self, original: cst.BaseExpression) -> cst.BaseExpression:
        """A GPU index the notebook computes (``f"cuda:{gpu}"``): every rank would compute the same one, and
        the other rank's GPU besides; each rank's own device instead."""
        self.note(original, f"{code_of(original)} → this rank's device (each rank on its own GPU)")
        return fixed_expression(DEVICE_EXPR)

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


def _positional(arg: cst.Arg) -> bool:
    return arg.keyword is None and not arg.star


def _is_template_call(call: cst.Call) -> bool:
    """``"cuda:{}".format(i)``."""
    func = call.func
    return (is_attribute(func, "format") and (value := string_value(func.value)) is not None
            and CUDA_TEMPLATE.match(value) is not None and len(call.args) == 1)


def _computed_index(node: ast.AST) -> bool:
    """A GPU index computed in a string: ``f"cuda:{i}"``, ``"cuda:%d" % i``, ``"cuda:" + str(i)``,
    ``"cuda:{}".format(i)`` (the whole string is the device; a sentence that names one is not)."""
    def text(n):
        return n.value if isinstance(n, ast.Constant) and isinstance(n.value, str) else None

    if isinstance(node, ast.JoinedStr):
        values = node.values
        return len(values) == 2 and text(values[0]) == CUDA_PREFIX and isinstance(values[1], ast.FormattedValue)
    if isinstance(node, ast.BinOp):
        left = text(node.left)
        return (isinstance(node.op, ast.Mod) and left is not None and CUDA_TEMPLATE.match(left) is not None
                or isinstance(node.op, ast.Add) and left == CUDA_PREFIX)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "format":
        value = text(node.func.value)
        return value is not None and CUDA_TEMPLATE.match(value) is not None
    return False
