"""``nn.DataParallel`` → DDP over the ranks: the rule and where it has work (the names the notebook binds to it:
``facts/data_parallel.py``)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from .. import ast_helpers
from ..cst_helpers import cst, dotted_name
from ..engine.rule import Rule
from ..facts.data_parallel import Names

if TYPE_CHECKING:
    from ..code import Statement
    from ..facts import JobFacts


class DataParallelRule(Rule):
    """``nn.DataParallel(model, device_ids=…)`` → ``_nbddp.data_parallel(model, device_ids=…)``.

    DataParallel is how a kernel with two GPUs uses both in one process: it splits each batch over every GPU
    it sees. In a rank that GPU pair is shared with the other rank, so it would replicate onto the other
    rank's GPU (and its parameters sit on the rank's own one, not on ``cuda:0``): the first forward fails.
    ``_nbddp.data_parallel`` wraps the model in DistributedDataParallel over the ranks instead, one GPU each,
    which does what DataParallel did, and keeps what the notebook's later code relies on: ``model.module``
    and the ``module.`` prefix of the state dict's keys (rank 0's model after training is a one-GPU
    DataParallel again, ``_nbddp.unwrap``). Under ``if torch.cuda.device_count() > 1:`` on a CPU machine
    the branch never runs and nbddp's own wrap does the same. In a single process (``split``) the notebook's
    DataParallel is made as written. ``isinstance(…, nn.DataParallel)`` and ``DistributedDataParallel`` stay.
    A call is DataParallel's by the name the notebook bound before it, in any cell above (``DP =
    nn.DataParallel``, ``from torch.nn import DataParallel as DP``, ``import torch.nn as tnn``); a name bound to
    something else (``from torch_geometric.nn import DataParallel``, ``DP`` rebound) is left alone.
    """

    # -- where it has work: Python's ast, before libcst reads anything

    name = "data_parallel"
    pattern = re.compile(r"(?<!Distributed)DataParallel\s*\(")

    @classmethod
    def wanted(cls, cell, facts) -> bool:
        _names(facts).read(cell)
        return cls.could_change(cell.code, facts)

    @classmethod
    def could_change(cls, text, facts) -> bool:
        aliases = _names(facts).aliases
        return super().could_change(text, facts) or bool(aliases) and re.search(
            rf"\b(?:{'|'.join(map(re.escape, sorted(aliases)))})\s*\(", text) is not None

    @classmethod
    def touches(cls, stmt, facts, nodes) -> bool:
        spelled = _names(facts).spellings(stmt)
        return bool(spelled) and any(ast_helpers.dotted_name(call.func) in spelled for call in ast_helpers.calls(nodes))

    # -- what it does: libcst

    #: the notebook's statement being walked, a top-level one or one a statement rule moved into a block
    _stmt: Statement | None = None

    def on_visit(self, node: cst.CSTNode) -> bool:
        self._stmt = self.chunk.statement_of.get(node, self._stmt)
        return super().on_visit(node)

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.Call:
        spelled = dotted_name(updated.func)
        if spelled is None or spelled not in self._spellings():
            return updated
        self.note(original, f"{spelled}(…) → DistributedDataParallel over the ranks, one GPU "
                            f"each (DataParallel would split each batch over the GPUs both ranks use); "
                            f".module and the state dict's module. keys stay")
        return updated.with_changes(func=cst.parse_expression("_nbddp.data_parallel"))

    def _spellings(self) -> frozenset[str]:
        """The spellings of DataParallel in the statement being walked (where none is known, those of every
        statement of the chunk)."""
        names = _names(self.facts)
        if self._stmt is not None:
            return names.spellings(self._stmt)
        return frozenset().union(*(names.spellings(s) for s in self.chunk.statements))


def _names(facts: JobFacts) -> Names:
    return facts.rule_state.setdefault(DataParallelRule.name, Names())


