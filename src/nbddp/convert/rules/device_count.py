"""``torch.cuda.device_count()`` in the notebook's own loop → the GPUs this rank uses: the rule and where it has work."""

from __future__ import annotations

import ast
import re

from .. import ast_helpers
from ..cst_helpers import cst, dotted_name, fixed_expression
from ..engine.rule import Rule

#: The spellings of ``torch.cuda.device_count`` a notebook calls.
DEVICE_COUNT = frozenset({"torch.cuda.device_count", "cuda.device_count"})
#: The runtime call that counts the GPUs this rank uses.
RANK_DEVICE_COUNT = "_nbddp.device_count"


class DeviceCountRule(Rule):
    """``torch.cuda.device_count()`` → ``_nbddp.device_count()``: the GPUs this rank uses.

    A kernel with two GPUs counts both, and sizes its work for one process spanning them:
    ``batch_size = 32 * torch.cuda.device_count()`` is a step of 64 samples that DataParallel splits into 32
    per GPU. A rank uses one GPU: counting two, each rank would take 64 and the step across the ranks 128,
    twice the kernel's, silently. ``_nbddp.device_count()`` is 1 in a rank of a DDP or FSDP job (each rank 32,
    the step 64 as in the kernel; ``if device_count() > 1: DataParallel(…)`` does not fire and nbddp's own
    wrap does its work), every GPU in the single process of ``split``, and 0 without CUDA, as torch says.
    ``from torch.cuda import device_count`` binds the runtime's count after the import.

    Not in a notebook that calls DataParallel: there the count stays torch's (every GPU), as the kernel's
    ``DataParallel(model, device_ids=list(range(n)))`` and ``batch_size = 32 * n`` saw it, and each training
    loader's batch, the step DataParallel split over those GPUs, is shared out over the ranks instead
    (``rules/sampler.py``: ``_nbddp.data_parallel_batch``).

    Only the notebook's own loop: a trainer's ``per_device_train_batch_size`` is per GPU in the kernel as in
    a rank, and Accelerate's ``notebook_launcher`` processes saw every GPU in the kernel too, so there the
    count stays torch's. Libraries count for themselves and are not affected.
    """

    # -- where it has work: Python's ast, before libcst reads anything

    name = "device_count"
    pattern = re.compile(r"device_count")

    @classmethod
    def wanted(cls, cell, facts) -> bool:
        return facts.plain_loop and not facts.accelerators and not facts.data_parallel and super().wanted(cell, facts)

    @classmethod
    def touches(cls, stmt, facts, nodes) -> bool:
        return any(
            isinstance(node, ast.Call) and ast_helpers.dotted_name(node.func) in DEVICE_COUNT
            or isinstance(node, ast.ImportFrom) and _imports_device_count(node.module, (a.name for a in node.names))
            for node in nodes
        )

    # -- what it does: libcst

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.BaseExpression:
        if dotted_name(updated.func) not in DEVICE_COUNT or updated.args:
            return updated
        self.note(original, f"{dotted_name(updated.func)}() → the GPUs this rank uses (1 in a rank: the kernel "
                            f"counted every GPU of one process, and each rank would size its share for all)")
        return updated.with_changes(func=fixed_expression(RANK_DEVICE_COUNT))

    def leave_SimpleStatementLine(self, original, updated):
        bound = [name for small in updated.body for name in _device_count_names(small)]
        if not bound:
            return updated
        self.note(original, f"{', '.join(bound)} → _nbddp.device_count, the GPUs this rank uses (1 in a rank)")
        rebinds = [cst.Assign(targets=[cst.AssignTarget(cst.Name(name))], value=fixed_expression(RANK_DEVICE_COUNT))
                   for name in bound]
        return updated.with_changes(body=[*updated.body, *rebinds])


def _imports_device_count(module: str | None, names) -> bool:
    return module == "torch.cuda" and "device_count" in names


def _device_count_names(small: cst.BaseSmallStatement) -> list[str]:
    """The names ``from torch.cuda import device_count [as x]`` binds."""
    if not isinstance(small, cst.ImportFrom) or small.module is None or dotted_name(small.module) != "torch.cuda" \
            or isinstance(small.names, cst.ImportStar):
        return []
    return [(alias.asname.name.value if alias.asname else "device_count")
            for alias in small.names if dotted_name(alias.name) == "device_count"]
