"""``nn.DataParallel`` → DDP over the ranks: the rule and where it has work."""

from __future__ import annotations

import ast
import re

from .. import ast_helpers
from ..cst_helpers import cst, dotted_name
from ..engine.rule import Rule

#: The spellings of ``torch.nn.DataParallel`` a notebook uses.
DATA_PARALLEL = frozenset({"DataParallel", "nn.DataParallel", "torch.nn.DataParallel",
                           "parallel.DataParallel", "nn.parallel.DataParallel", "torch.nn.parallel.DataParallel"})


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
    """

    # -- where it has work: Python's ast, before libcst reads anything

    name = "data_parallel"
    pattern = re.compile(r"(?<!Distributed)DataParallel\(")

    @classmethod
    def touches(cls, stmt, facts, nodes) -> bool:
        return any(ast_helpers.dotted_name(call.func) in DATA_PARALLEL for call in ast_helpers.calls(nodes))

    # -- what it does: libcst

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.Call:
        if dotted_name(updated.func) not in DATA_PARALLEL:
            return updated
        self.note(original, f"{dotted_name(updated.func)}(…) → DistributedDataParallel over the ranks, one GPU "
                            f"each (DataParallel would split each batch over the GPUs both ranks use); "
                            f".module and the state dict's module. keys stay")
        return updated.with_changes(func=cst.parse_expression("_nbddp.data_parallel"))
