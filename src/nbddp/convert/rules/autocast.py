"""``torch.cuda.amp`` → ``torch.amp``: the rule and where it has work."""

from __future__ import annotations

import ast
import re

from .. import ast_helpers
from ..cst_helpers import cst, dotted_name, fixed_expression
from ..engine.rule import Rule

class AutocastRule(Rule):
    """``torch.cuda.amp.autocast(...)`` → ``torch.amp.autocast("cuda", ...)``, likewise ``GradScaler``.

    The ``torch.cuda.amp`` spellings are deprecated (a FutureWarning from every rank, every step) and go
    away in later torch releases; ``torch.amp`` takes the device type first. The old ``autocast``'s positional
    arguments (``enabled``, ``dtype``, ``cache_enabled``) become keywords, since ``torch.amp.autocast`` orders
    them differently. ``from torch.cuda.amp import autocast`` becomes ``from torch.amp import autocast``.
    """

    # -- where it has work: Python's ast, before libcst reads anything

    name = "autocast"
    keywords = frozenset()  # it reads positional arguments only
    pattern = re.compile(r"cuda\.amp")
    _KINDS = ("autocast", "GradScaler")

    @classmethod
    def could_change(cls, text, facts) -> bool:
        # a name imported from torch.cuda.amp in another cell counts too
        return super().could_change(text, facts) or any(f"{name}(" in text for name in facts.cuda_amp_names)

    @classmethod
    def touches(cls, stmt, facts, nodes) -> bool:
        for node in nodes:
            if isinstance(node, ast.ImportFrom) and node.module == "torch.cuda.amp":
                return True
            if isinstance(node, ast.Call):
                name = ast_helpers.dotted_name(node.func)
                if name in ("torch.cuda.amp.autocast", "torch.cuda.amp.GradScaler"):
                    return True
                if name in cls._KINDS and name in facts.cuda_amp_names:
                    return True
        return False

    # -- what it does: libcst

    _AUTOCAST_POSITIONAL = ("enabled", "dtype", "cache_enabled")

    def _modern(self, original: cst.Call, updated: cst.Call, kind: str) -> cst.Call:
        args = list(updated.args)
        if kind == "autocast":
            args = [
                a.with_changes(keyword=cst.Name(self._AUTOCAST_POSITIONAL[i]), equal=cst.AssignEqual(
                    whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace("")))
                if a.keyword is None and not a.star and i < len(self._AUTOCAST_POSITIONAL) else a
                for i, a in enumerate(args)
            ]
        cuda = cst.Arg(cst.SimpleString('"cuda"'), comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")) if args else cst.MaybeSentinel.DEFAULT)
        self.note(original, f"torch.cuda.amp.{kind}(…) → torch.amp.{kind}(\"cuda\", …)")
        func = updated.func if isinstance(updated.func, cst.Name) else fixed_expression(f"torch.amp.{kind}")
        return updated.with_changes(func=func, args=[cuda] + args)

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.Call:
        name = dotted_name(updated.func) or ""
        for kind in ("autocast", "GradScaler"):
            if name == f"torch.cuda.amp.{kind}" or name in self.facts.cuda_amp_names and name == kind:
                return self._modern(original, updated, kind)
        return updated

    def leave_ImportFrom(self, original: cst.ImportFrom, updated: cst.ImportFrom) -> cst.ImportFrom:
        if updated.module is not None and dotted_name(updated.module) == "torch.cuda.amp":
            self.note(original, "from torch.cuda.amp → from torch.amp")
            return updated.with_changes(module=fixed_expression("torch.amp"))
        return updated
