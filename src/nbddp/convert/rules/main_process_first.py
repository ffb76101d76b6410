"""Dataset preparation under ``main_process_first``: the rule and where it has work."""

from __future__ import annotations

from ..cst_helpers import cst, fixed_expression
from ..engine.rule import BlockRule

#: Context manager letting the first process of each machine go first (caches, downloads).
MAIN_FIRST_EXPR = "_nbddp.main_process_first()"


class MainProcessFirstRule(BlockRule):
    """Dataset preparation runs under ``with _nbddp.main_process_first():``.

    ``load_dataset``, ``dataset.map(...)`` (tokenization) and ``.filter(...)`` write cache files; run by every
    rank at once they race on the same files. Under the guard the first process of each machine prepares
    and caches, the others wait and then read the cache.
    """

    # -- where it has work: Python's ast, before libcst reads anything

    name = "main_process_first"

    @classmethod
    def wanted(cls, cell, facts) -> bool:
        return any(s in facts.main_first for s in cell.statements)

    @classmethod
    def touches(cls, stmt, facts, nodes) -> bool:
        return stmt in facts.main_first

    # -- what it does: libcst

    def picks(self, stmt) -> bool:
        return stmt in self.facts.main_first

    def block(self, run):
        return cst.With(items=[cst.WithItem(fixed_expression(MAIN_FIRST_EXPR))], body=cst.IndentedBlock(body=self.inside(run)))

    def message(self, run) -> str:
        return "dataset preparation: the first process of each machine runs it first, the others read its cache"
