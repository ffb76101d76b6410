"""Plain PyTorch: a training loop that feeds its model whole tensors at every step is refused before launch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..code import CodeError
from ..engine.rule import Rule
from ..facts.index_loops import full_batch_loops, may_train_in_a_loop

if TYPE_CHECKING:
    from ..code import CellCode, Statement
    from ..facts import JobFacts


class FullBatchRule(Rule):
    """Plain PyTorch: ``for epoch in range(n): loss = crit(model(X_train), y_train); loss.backward()`` is refused
    at its cell and line, before anything is launched.

    Each step trains on all of ``X_train``; under DDP every rank would train on the same rows, the replicas
    agree, and two GPUs do one GPU's work in silence. There are no batches to share out: the loop has to feed
    its data in batches (a DataLoader nbddp gives a DistributedSampler, or slices ``X[i:i+bs]`` over batch
    positions that ``ShardLoopRule`` shares out), or run in one process. The decision is
    ``facts/index_loops.full_batch_loops``, refusing only where certain; the runtime's first-batches check
    (``runtime/same_batches.py``) stays the net behind it. It is a rule, not a check of its own in ``script.py``,
    because the engine already turns a rule's ``CodeError`` into the cell's error at the cell's line and source.
    """

    # -- where it has work: Python's ast, before libcst reads anything

    name = "full_batch"
    pattern = None  # ``could_change``: a ``for`` and a ``.backward(`` (index_loops.may_train_in_a_loop)
    keywords = frozenset()  # it reads the loops with ast, never a keyword argument

    @classmethod
    def wanted(cls, cell, facts) -> bool:
        _seen(facts).read(cell)  # every cell: a later loop's tensors may be bound here
        return facts.plain_loop and super().wanted(cell, facts)

    @classmethod
    def could_change(cls, text, facts) -> bool:
        return may_train_in_a_loop(text)

    @classmethod
    def touches(cls, stmt, facts, nodes) -> bool:
        return stmt in facts.loops and bool(_places(stmt, facts))

    # -- what it does: refuse

    def visit_Module(self, node) -> bool:
        for stmt in self.chunk.statements:
            places = _places(stmt, self.facts) if stmt in self.facts.loops else []
            if places:
                self.facts.full_batch_loops.extend(places)
                _, line, tensors = places[0]
                raise CodeError(refusal(tensors), line)
        return True  # the other rules of the walk go on into it


#: The last part of the names a graph's edges go by (PyTorch Geometric's ``edge_index``, a sparse ``adj_t``).
_GRAPH_EDGES = frozenset({"edge_index", "adj", "adj_t"})


def refusal(tensors: list[str]) -> str:
    """What is said, in one line: why the loop cannot run on several GPUs, and the two ways it can (one for a
    graph: its edges are no rows to batch beside its node features)."""
    x = tensors[0]
    why = f"this loop trains on all of {x} at every step on every rank, so two GPUs would do one GPU's work; "
    edges = next((t for t in tensors if t.rpartition(".")[2] in _GRAPH_EDGES), None)
    if edges is not None:
        return why + f"a whole graph ({edges}) has no rows nbddp can share out between the ranks: run it in one " \
                     "process, in the notebook's kernel"
    data = ", ".join(tensors) if len(tensors) > 1 else f"{x}, …"  # every input, then the targets
    return (why + f"feed it in batches (a DataLoader over TensorDataset({data}), or slices {x}[i:i+bs] over "
            f"range(0, len({x}), bs)) and nbddp gives each rank its share, or run it in one process, in the "
            "notebook's kernel")


def _places(stmt: Statement, facts: JobFacts) -> list[tuple[int, int, list[str]]]:
    return full_batch_loops(stmt, facts, lambda name: _seen(facts).binding(name, stmt))


@dataclass
class _Seen:
    """The cells planned so far, by position: where a name a loop feeds whole was last bound. The planner asks
    the rule about the cells in order (``wanted``), so every cell above a loop is read before the loop's own."""

    cells: dict[int, CellCode] = field(default_factory=dict)

    def read(self, cell: CellCode) -> None:
        self.cells[cell.position] = cell

    def binding(self, name: str, stmt: Statement) -> Statement | None:
        """The last top-level statement binding ``name`` before ``stmt``, in its cell or a cell above."""
        here = stmt.cell.position
        above = [stmt.cell.statements[: stmt.index]] + [
            self.cells[p].statements for p in sorted(self.cells, reverse=True) if p < here]
        return next((s for statements in above for s in reversed(statements) if name in s.binds), None)


def _seen(facts: JobFacts) -> _Seen:
    return facts.rule_state.setdefault(FullBatchRule.name, _Seen())
