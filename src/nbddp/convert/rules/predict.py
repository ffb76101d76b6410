"""A notebook that predicts and does not train, or a kept job's ``%%ddp`` cell: each rank predicts its own block of
the rows, gathered in order: the rule, where it has work, and the refusal of a loop that cannot be split."""

from __future__ import annotations

import ast

from ..cst_helpers import code_of, cst, fixed_expression, last_name
from ..engine.rule import Rule
from ..facts.kept import writes_once
from ..facts.predicts import SPLIT_CALLS, PredictLoop, loop_names, prediction_loop
from ..refusal import refuse_at
from .rank_zero import MAIN_PROCESS_EXPR

#: The name the rewritten loop binds to its share (``runtime.predict.Rows``).
ROWS = "_nbddp_rows"
#: What a split pipeline call calls instead (``runtime.predict.split_call``).
SPLIT_CALL = "_nbddp.predict.split_call"


class PredictRule(Rule):
    """A prediction loop takes this rank's contiguous block of its rows; after it, what it accumulated is whole.

    ``for batch in test_loader: preds.append(model(batch).argmax(-1))`` run by every rank would predict every
    row on every GPU: the work of one, done twice. Its iterable goes through ``_nbddp.predict.Rows`` (a
    DataLoader rebuilt over a block of whole batches, a list, frame or Dataset sliced), each ``total += …``
    of a sum accumulator records its increment, and the loop's ``else`` gathers: every list gets every rank's
    items in rank order, which is row order, and every sum is replayed through every increment in row order
    (``runtime/predict.py``). The code after the last such loop runs on rank 0 only (``RankZeroRule``), so
    ``submission.csv`` is written once, as one process writes it.

    A pipeline given a whole list or a dataset's column in a statement of its own (``outputs = pipe(texts,
    batch_size=32)``) or a loop walking its results (``for out in pipe(KeyDataset(ds, "text")): …``), chosen by
    ``facts.predicts.split_calls``, calls ``_nbddp.predict.split_call(pipe, texts, batch_size=32)`` instead: each
    rank calls the pipeline on its block of the rows, and every rank gets every block's results, in order.

    In a kept job's ``%%ddp`` cell every statement runs on every rank, and later cells too: each split loop is
    preceded by the import of its runtime (the cell runs without the script's prelude), and at the cell's top
    level its ``else`` also gives every rank the names the loop binds as the rank of the last row left them
    (``Rows.settle``), so every rank holds what the kernel's one process would.
    """

    # -- where it has work: Python's ast, before libcst reads anything

    name = "predict"
    walks_inside = True  # it reads every statement of a loop it splits (the sums' increments)

    @classmethod
    def wanted(cls, cell, facts) -> bool:
        return any(s in facts.predictions for s in cell.statements)

    @classmethod
    def touches(cls, stmt, facts, nodes) -> bool:
        return stmt in facts.predictions

    # -- what it does: libcst

    def __init__(self, facts, chunk):
        super().__init__(facts, chunk)
        self._loop: tuple[cst.For, PredictLoop, list[str]] | None = None
        self._split: list[cst.For] = []  # the loops split so far (originals), for the writes after them
        self._functions: list[bool] = []  # the function definitions the walk is in (whether it walks inside)
        self._kept = facts.kept_cell is not None
        self._split_call: tuple[cst.CSTNode, str] | None = None  # a chosen statement being walked, its pipeline
        self._import_before: cst.CSTNode | None = None  # a kept cell's statement whose pipeline call was split
        #: within the top-level statement walked: whether a call of a function splitting its rows was left yet,
        #: and, for each statement line or ``with`` met, whether it was when the walk reached it
        self._split_called = False
        self._after_split_call: dict[cst.CSTNode, bool] = {}

    def visit_FunctionDef(self, node) -> bool:
        # a function whose body holds a prediction loop splits it each call (``JobFacts.predict_functions``);
        # another function's loops are left whole
        inside = self._loop is None and node.name.value in self.facts.predict_functions
        self._functions.append(inside)
        return inside

    def leave_FunctionDef(self, original, updated):
        self._functions.pop()
        return updated

    def visit_ClassDef(self, node) -> bool:
        return False

    def visit_For(self, node: cst.For) -> bool:
        if self._loop is None:
            found = _prediction_loop(node, self.facts.predict_functions)
            if found is not None:
                self._loop = (node, *found)
        return True

    def leave_For(self, original: cst.For, updated: cst.For):
        if self._loop is None or self._loop[0] is not original:
            return updated
        _, found, bound = self._loop
        self._loop = None
        self._split.append(original)
        names = list(found.accumulators)
        self.note(original, _said(code_of(original.iter), names, self._kept))
        after = [cst.parse_statement(f"{', '.join(names)}, = {ROWS}.gathered()\n")]
        if self._kept and not any(self._functions) and bound:
            after.append(cst.parse_statement(f"{ROWS}.settle(globals(), {', '.join(map(repr, bound))})\n"))
        orelse = updated.orelse
        body = [*orelse.body.body, *after] if orelse is not None else after
        split = updated.with_changes(iter=_rows(updated.iter, names), orelse=cst.Else(body=cst.IndentedBlock(body=body)))
        return _importing_runtime(split) if self._kept else split

    def on_visit(self, node: cst.CSTNode) -> bool:
        """A top-level statement ``split_calls`` chose: its one call of the pipeline is split (``leave_Call``)."""
        visit = super().on_visit(node)
        if node in self._top:
            self._split_called = False
        if isinstance(node, (cst.SimpleStatementLine, cst.With)):
            self._after_split_call[node] = self._split_called
        if self._top.get(node) is not None:
            callee = self.facts.rule_state.get(SPLIT_CALLS, {}).get(self.statement(node))
            self._split_call = (node, callee) if callee is not None else None
        return visit

    def on_leave(self, original: cst.CSTNode, updated: cst.CSTNode):
        """A kept cell's statement whose pipeline call was split: the runtime imported first."""
        updated = super().on_leave(original, updated)
        if self._import_before is original and isinstance(updated, cst.BaseStatement):
            self._import_before = None
            return _importing_runtime(updated)
        return updated

    def leave_Call(self, original: cst.Call, updated: cst.Call):
        """``pipe(texts, …)`` in a statement ``split_calls`` chose (``outputs = pipe(texts, …)``, ``for out in
        pipe(KeyDataset(ds, "text")): …``) → ``_nbddp.predict.split_call(pipe, texts, …)``."""
        if isinstance(updated.func, cst.Name) and updated.func.value in self.facts.predict_functions:
            self._split_called = True  # every rank holds what it returns: a file written after, rank 0 writes
        if self._split_call is None or not (isinstance(updated.func, cst.Name) and updated.args
                                            and updated.func.value == self._split_call[1]):
            return updated
        statement, callee = self._split_call
        self._split_call = None
        after = "every rank holds them" if self._kept else "the code after it runs on rank 0"
        self.note(statement, f"{callee}(…) over many rows (a list, a dataset's column): each rank calls {callee} on "
                             "its own contiguous block of them, in whole batches, and every rank gets every result "
                             f"back in the rows' order ({after})")
        if self._kept:
            self._import_before = statement
        return updated.with_changes(func=cst.parse_expression(SPLIT_CALL), args=[cst.Arg(updated.func), *updated.args])

    def leave_IndentedBlock(self, original: cst.IndentedBlock, updated: cst.IndentedBlock) -> cst.IndentedBlock:
        """After a split loop in the same block (a ``with``, a function), or after a call of a function that splits
        its loop anywhere before in the statement (``for pid in ids: t = extract(pid); torch.save(t, p)``): a
        statement writing a file goes under ``if _nbddp.on_rank0():``. Every rank holds the gathered results there,
        so each would write the same bytes to the same path at once; rank 0 writes them once, as after a loop at a
        cell's top level."""
        body, after_loop, k = list(updated.body), False, 0
        for stmt in original.body:
            if any(stmt is loop for loop in self._split):
                after_loop = True
                k += 1 + self._kept  # a kept cell's split loop comes after its import
                continue
            if (after_loop or self._after_split_call.get(stmt)) and _writes_file(stmt):
                self.note(stmt, "writes its file on rank 0 only (after the split loop or call above, whose results "
                                "every rank gathered)")
                body[k] = cst.If(test=fixed_expression(MAIN_PROCESS_EXPR),
                                 body=cst.IndentedBlock(body=[body[k].with_changes(leading_lines=[])]),
                                 leading_lines=body[k].leading_lines)
            k += 1
        return updated.with_changes(body=body) if body != list(updated.body) else updated

    def leave_AugAssign(self, original: cst.AugAssign, updated: cst.AugAssign):
        if self._loop is None or not isinstance(updated.target, cst.Name) \
                or updated.target.value not in self._loop[1].sums or not isinstance(updated.operator, cst.AddAssign):
            return updated
        name = updated.target.value
        call = cst.Call(func=cst.parse_expression(f"{ROWS}.add"),
                        args=[cst.Arg(cst.SimpleString(repr(name))), cst.Arg(updated.value)])
        return updated.with_changes(value=call)


def _writes_file(stmt: cst.CSTNode) -> bool:
    """A statement that writes a file once it has it whole, binding nothing the code after could need: a bare call
    (``df.to_csv(p)``, ``plt.savefig(p)``, ``torch.save(…)``) or a ``with open(p, "w")`` block."""
    if not isinstance(stmt, (cst.SimpleStatementLine, cst.With)) or isinstance(stmt, cst.SimpleStatementLine) and \
            not all(isinstance(small, cst.Expr) for small in stmt.body):
        return False
    try:
        tree = ast.parse(code_of(stmt.with_changes(leading_lines=[])))
    except SyntaxError:
        return False
    node = tree.body[0]
    if isinstance(node, ast.With):  # ``with open(path, "w") as fh:`` (another ``with`` may hold what must run)
        return any(isinstance(item.context_expr, ast.Call) and writes_once(item.context_expr) for item in node.items)
    return any(isinstance(n, ast.Call) and writes_once(n) for n in ast.walk(tree))


def _prediction_loop(node: cst.For, splitting: frozenset[str]) -> tuple[PredictLoop, list[str]] | None:
    """``facts.predicts.prediction_loop`` of this loop, read back with ``ast`` (one decision for facts and rule),
    with the other names it binds."""
    try:
        tree = ast.parse(code_of(node.with_changes(leading_lines=[])))
    except SyntaxError:
        return None
    found = prediction_loop(tree.body[0], splitting)
    return None if found is None else (found, loop_names(tree.body[0], found.accumulators))


def _rows(iterated: cst.BaseExpression, names: list[str]) -> cst.BaseExpression:
    """``(_nbddp_rows := _nbddp.predict.Rows(X, acc=acc, …))`` in place of ``X``; inside ``tqdm(…)`` (and
    ``iter(…)``, so a DataLoader is shared as one, not read whole) the progress bar stays, and ``enumerate(X, k)`` counts from each row's place in the whole."""
    if isinstance(iterated, cst.Call) and last_name(iterated.func) in ("tqdm", "iter") and iterated.args:
        first = iterated.args[0]
        return iterated.with_changes(args=[first.with_changes(value=_rows(first.value, names)), *iterated.args[1:]])
    start = None
    if isinstance(iterated, cst.Call) and last_name(iterated.func) == "enumerate" and iterated.args:
        start = next((code_of(a.value) for a in iterated.args[1:2]), None) or next(
            (code_of(a.value) for a in iterated.args if a.keyword is not None and a.keyword.value == "start"), "0")
        iterated = iterated.args[0].value
        while isinstance(iterated, cst.Call) and last_name(iterated.func) == "iter" and len(iterated.args) == 1:
            iterated = iterated.args[0].value  # enumerate(iter(loader)): the loader, shared as one
    counted = f", {start}" if start is not None else ""  # Rows' second argument, given by place
    kept = "".join(f", {n}={n}" for n in names)
    return cst.parse_expression(f"({ROWS} := _nbddp.predict.Rows({code_of(iterated)}{counted}{kept}))")


def _importing_runtime(statement: cst.BaseStatement) -> cst.FlattenSentinel:
    """``statement`` after ``import nbddp.runtime.predict``: a %%ddp cell runs without the script's prelude,
    which imports the runtime of a predicting notebook."""
    return cst.FlattenSentinel([cst.parse_statement("import nbddp.runtime.predict\n").with_changes(
        leading_lines=statement.leading_lines), statement.with_changes(leading_lines=[])])


def _said(loop: str, names: list[str], kept: bool = False) -> str:
    after = "every rank holds them" if kept else "the code after it runs on rank 0"
    return (f"for … in {loop}: each rank predicts its share of the rows (a DataLoader's: a contiguous block of whole "
            "batches; other rows: the next chunk whenever the rank is free), and after the loop "
            f"{', '.join(names)} hold every rank's results in the rows' order ({after})")


def refuse_unsplittable(facts, cleaned) -> None:
    """A prediction loop the ranks cannot split, refused before launch at its cell and line (``CellError``)."""
    if facts.predict_refusals:
        instead = (KEPT_INSTEAD if facts.kept_cell is not None else
                   "Or run the notebook in its kernel, in one process")
        _refuse(facts.predict_refusals[0], cleaned, "nbddp cannot split this prediction loop over the GPUs", instead)


def refuse_batched(facts, cleaned) -> None:
    """A notebook whose only prediction is a pipeline call over rows that cannot be split (``print(pipe(texts))``,
    ``pipe(KeyDataset(…))``, sampling), refused at that call (``CellError``)."""
    if facts.batched_calls:
        _refuse(facts.batched_calls[0], cleaned, "nbddp cannot split this prediction over the GPUs")


#: What a kept job's ``%%ddp`` cell can do instead: its ranks stay up, holding what they held.
KEPT_INSTEAD = ("The kept job's ranks are kept, and nothing of this cell ran: change the loop and run the cell "
                "again, or %ddp_pull what it needs and run it in the kernel, in one process")


def _refuse(refusal, cleaned, what: str, instead: str = "Or run the notebook in its kernel, in one process") -> None:
    refuse_at(refusal.position, refusal.line, cleaned, f"{what}: {refusal.reason}. {instead}")
