"""Plain PyTorch: a training loop fed without a DataLoader takes its rank's share of the steps: the rule and
where it has work."""

from __future__ import annotations

import ast

from ..cst_helpers import code_of, cst, fixed_expression
from ..engine.rule import Rule
from ..facts.index_loops import SHARDS, may_train_in_a_loop, shardable_loop


class ShardLoopRule(Rule):
    """Plain PyTorch: the innermost training loop that slices tensors by index or walks a list of samples gives
    each rank its own steps.

    ``for i in range(0, len(X), bs): xb = X[perm[i:i+bs]]`` would run whole on every rank: each rank trains
    on the same rows, the replicas agree, and two GPUs do the work of one. The loop's ``range`` goes through
    ``_nbddp.shard_range`` (rank r takes positions r, r + n, r + 2n … of n ranks), a sequence of samples
    through ``_nbddp.shard_items`` (the same positions of the list, tensor, array or Dataset). Every rank
    takes as many steps, so DDP's all-reduce never waits on a rank with one step fewer: the last positions
    that do not fill a round of the ranks (fewer than n) are left out. The permutation the notebook draws
    each epoch is the same on every rank (nbddp seeds them alike), so the shares are disjoint and together
    the data set. Epoch loops and full-batch loops are left alone.
    """

    # -- where it has work: Python's ast, before libcst reads anything

    name = "shard_loop"
    pattern = None  # ``could_change``: a ``for`` and a ``.backward(`` (index_loops.may_train_in_a_loop)

    @classmethod
    def wanted(cls, cell, facts) -> bool:
        return facts.plain_loop and super().wanted(cell, facts)

    @classmethod
    def could_change(cls, text, facts) -> bool:
        return may_train_in_a_loop(text)

    @classmethod
    def touches(cls, stmt, facts, nodes) -> bool:
        return any(shardable_loop(n, facts) for n in nodes)

    # -- what it does: libcst

    def leave_For(self, original: cst.For, updated: cst.For) -> cst.For:
        kind = self._kind(original)
        if kind is None:
            return updated
        loop = code_of(original.iter)
        self.note(original, _said(kind, loop) + (_DATA_PARALLEL_STEP if self.facts.data_parallel else ""))
        return updated.with_changes(iter=_sharded(kind, updated.iter))

    def _kind(self, loop: cst.For) -> str | None:
        """``shardable_loop`` of this loop, read back with ``ast`` (the one decision for the check and here)."""
        try:
            tree = ast.parse(code_of(loop.with_changes(leading_lines=[])))
        except SyntaxError:
            return None
        return shardable_loop(tree.body[0], self.facts)


def _sharded(kind: str, iterated: cst.BaseExpression) -> cst.BaseExpression:
    """``shard_range(range(…))``, ``shard_items(samples)``: what ``enumerate``/``tqdm`` wrap is the one sharded."""
    if isinstance(iterated, cst.Call) and iterated.args and \
            isinstance(iterated.func, cst.Name) and iterated.func.value in ("enumerate", "tqdm", "iter"):
        first = iterated.args[0]
        args = [first.with_changes(value=_sharded(kind, first.value)), *iterated.args[1:]]
        return iterated.with_changes(args=args)
    if kind == "items" and isinstance(iterated, cst.Call) and isinstance(iterated.func, cst.Name) \
            and iterated.func.value == "zip":  # each sequence the same positions
        return iterated.with_changes(args=[a.with_changes(value=_sharded(kind, a.value)) for a in iterated.args])
    return cst.Call(func=fixed_expression(SHARDS[kind]), args=[cst.Arg(iterated)])


#: Said of such a loop in a notebook that calls DataParallel, which split each of the loop's batches over the
#: kernel's GPUs: a rank takes the whole batch where a loader's is shared out (``data_parallel_batch``), since
#: the rows a step takes are the loop's own slices, which no call of nbddp's sees.
_DATA_PARALLEL_STEP = ("; this notebook calls DataParallel, which split each batch over the kernel's GPUs, so a "
                       "step here takes a batch on every rank, the kernel's step times the ranks, and the loss "
                       "follows another curve: divide the loop's batch size by the number of GPUs for the "
                       "kernel's step")


def _said(kind: str, loop: str) -> str:
    what = "batch positions" if kind == "range" else "samples"
    return (f"for … in {loop}: each rank takes its own {what} (every n-th step of n ranks, its rows disjoint "
            "from the others'); every rank takes as many steps, so the last ones that do not fill a round of the "
            "ranks are left out")
