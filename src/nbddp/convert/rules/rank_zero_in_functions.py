"""Saves after training inside a function that trains, on rank 0 only: the rule and where it has work."""

from __future__ import annotations

import functools

from ..cst_helpers import cst, fixed_expression
from ..engine.rule import Rule
from .rank_zero import MAIN_PROCESS_EXPR


@functools.cache
def _blocks() -> tuple[type, ...]:
    """The nodes a walk goes through to reach a function's body (named at the first use: importing the rule
    loads no libcst)."""
    return (cst.Module, cst.IndentedBlock, cst.BaseCompoundStatement, cst.Else, cst.ExceptHandler,
            cst.ExceptStarHandler, cst.Finally, cst.MatchCase)


class RankZeroInFunctionsRule(Rule):
    """Inside a function or method that trains, saving, pushing, generating, printing and plotting after its
    training call run on rank 0 only.

    Scripts and notebooks that train inside a function of their own (``run_sft.py``'s ``train_function``:
    ``trainer.train()``, ``trainer.save_model()``, ``tokenizer.save_pretrained(out)``) have every rank run
    the whole body: the saves after training would write the same files from every rank at once, and the
    prints come once per GPU. Each run of such statements goes into ``if _nbddp.on_rank0():``, as between two
    training calls at the top level (``RankZeroRule``), with the same exceptions, said in the notes: a
    statement with a collective in it or a call that waits for every rank (``trainer.evaluate()``,
    ``wait_for_everyone()``), and one binding a name the body's every-rank code reads, stay on every rank
    (``facts/rank0.plan_function_bodies`` chooses, by line).
    """

    # -- where it has work: Python's ast, before libcst reads anything

    name = "rank0_functions"
    on_statements = True
    walks_inside = True  # it rewrites blocks inside the statements the facts chose

    @classmethod
    def wanted(cls, cell, facts) -> bool:
        return any(s in facts.rank0_holders for s in cell.statements)

    @classmethod
    def touches(cls, stmt, facts, nodes) -> bool:
        return stmt in facts.rank0_holders

    # -- what it does: libcst

    def __init__(self, facts, chunk):
        super().__init__(facts, chunk)
        here = lambda places: {line: v for (position, line), v in places.items()  # noqa: E731
                               if position == chunk.cell.position and chunk.first <= line < chunk.end}
        self._guard, self._stay = here(facts.rank0_inside), here(facts.all_ranks_inside)
        planned = set(self._guard) | set(self._stay)
        self._lines = chunk.statement_lines() if planned else {}
        #: the parsed compound statements holding a planned statement: the only ones walked into, so every
        #: other node stays the very node parsed (the rules after this one find theirs by it)
        self._leads = {n for n, (a, b) in self._lines.items() if isinstance(n, cst.BaseCompoundStatement)
                       and any(a <= line <= b for line in planned)}

    def on_visit(self, node: cst.CSTNode) -> bool:
        if not super().on_visit(node):
            return False
        if node in self._lines:
            return node in self._leads
        return isinstance(node, _blocks())  # a block, or a statement an earlier rule made

    def leave_Module(self, original: cst.Module, updated: cst.Module) -> cst.Module:
        for old, new in zip(original.body, updated.body):  # the walk rebuilt them: later rules find them still
            if (stmt := self.statement(old)) is not None:
                self.chunk.statement_of[new] = stmt
        return updated

    def leave_IndentedBlock(self, original: cst.IndentedBlock, updated: cst.IndentedBlock) -> cst.IndentedBlock:
        body: list[cst.BaseStatement] = []
        run: list[tuple[cst.BaseStatement, cst.BaseStatement]] = []  # (as parsed, as walked)
        for old, new in zip(original.body, updated.body):
            line = self._lines.get(old, (None,))[0]
            if line in self._guard:
                run.append((old, new))
                continue
            body += self._guarded(run)
            if line in self._stay:
                self.note(old, f"stays on every rank: {self._stay[line]}")
                self.cell_lines[old] = line
            body.append(new)
        body += self._guarded(run)
        return updated.with_changes(body=body)

    def _guarded(self, run: list[tuple[cst.BaseStatement, cst.BaseStatement]]) -> list[cst.BaseStatement]:
        """A run of consecutive rank-0 statements as one ``if _nbddp.on_rank0():`` block (the run emptied)."""
        if not run:
            return []
        (first_old, first), rest = run[0], [new for _, new in run[1:]]
        line = self._lines[first_old][0]
        self.note(first_old, f"runs on rank 0 only (after training, in {self._guard[line]})")
        self.cell_lines[first_old] = line
        inside = [first.with_changes(leading_lines=[]), *rest]
        block = cst.If(test=fixed_expression(MAIN_PROCESS_EXPR), body=cst.IndentedBlock(body=inside),
                       leading_lines=first.leading_lines)
        run.clear()
        return [block]
