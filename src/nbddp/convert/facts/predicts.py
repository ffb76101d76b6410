"""Facts about a notebook that predicts and does not train: its prediction loops, and what stops one being split.

A prediction loop is a ``for`` loop at a cell's top level (or in its ``with``/``if`` blocks, not in a function)
that calls a model and accumulates what it gives: ``preds.append(…)``/``.extend(…)`` on a list named before
the loop, or ``correct += …`` on a name. ``rules/predict.py`` gives each rank a contiguous block of its rows
and gathers the accumulators in row order (``runtime/predict.py``); what comes after the last such loop runs
on rank 0 only (``rank0.plan_after_training``, as after training).

A loop whose rows cannot be split is refused before launch, at its cell and line (``PredictRefusal``):
state carried from one row to the next other than an accumulator, a ``break`` (it stops at a row count),
a write into something other than an accumulator inside the loop (it would hold only this rank's rows), a
name the loop binds read after it (each rank holds its own last row's), a shuffled loader (its order is not
its rows'). The names a comprehension or a lambda binds for itself (``" ".join(str(t) for t in out)``) are
its own: no state of the loop, nor read by it after (``_own_names``).

A statement calling ``trainer.predict(…)``/``trainer.evaluate(…)`` is a prediction statement too, left as it is:
the Trainer shards its rows over the ranks and gathers them back in order itself (its loss is one process's
with the ``token_average`` shim). Its last batch, where the rows do not fill every rank's batches, is padded
with repeated rows: the runtime stops such a call, saying why (``runtime/predict.py``).

A statement ``outputs = pipe(texts, **kwargs)`` at a cell's top level, ``pipe`` a ``pipeline(…)`` and
``texts`` a list (``[…]``, ``[… for …]``, ``list(…)``, ``….tolist()``, or a name bound to one), is a prediction
statement too (``split_calls``, kept in ``JobFacts.rule_state[SPLIT_CALLS]``): each rank calls the pipeline on its
own block of the list and every rank gets the whole list of results back, in order (``runtime/predict.split_call``).
Where nothing else predicts, a pipeline call over rows that cannot be split so is refused at its line
(``JobFacts.batched_calls``): not a statement of its own, given a generator or a dataset, or sampling.

A kept job's ``%%ddp`` cell (``plan_kept_predictions``) splits its loops by the same rules, refused alike, but
places nothing on rank 0: every rank gathers the whole results and runs the cell on, as later cells run on
every rank; the names a loop at the cell's top level binds reach every rank from the rank of the last row.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..ast_helpers import DEFS, dotted_name, keyword, last_name
from .kept import writes_once
from .rank0 import plan_shared_saves

if TYPE_CHECKING:
    from ..code import Statement
    from .job_facts import JobFacts

#: Callees that run a model on rows: ``model(x)``, ``net(x)``, ``model.generate(…)``, ``clf.predict(…)``, ``pipe(…)``.
_MODEL_CALL = re.compile(r"model|net$|^net|generate|predict|pipe|classifier|clf|forward|infer", re.IGNORECASE)
#: Calls that make, load or place a model rather than run it: a loop of only these loads models (``for path in
#: ckpts: model = Net(); model.load_state_dict(torch.load(path)); models.append(model)``), it predicts nothing.
_MODEL_SETUP = re.compile(r"^(?:load_state_dict|state_dict|eval|train|to|cuda|cpu|half|float|bfloat16|parameters|"
                          r"named_parameters|requires_grad_|from_pretrained|(?:create|build|load|get|make|init)_\w*"
                          r"(?:model|net)\w*|"  # timm.create_model(…), get_model(…); not model.get_image_features(x)
                          r"append|extend|insert|pop|remove|clear|copy|keys|items|values|update)$")  # models.append(m)


def _calls_a_model(call: ast.Call) -> bool:
    """A call that runs a model (``model(x)``, ``net.predict(x)``, ``pipe(texts)``, ``model.generate(…)``): not a
    class built (``BirdModel(cfg)``) nor a model made, loaded or placed (``_MODEL_SETUP``)."""
    last = last_name(call.func) or ""
    if last[:1].isupper() or _MODEL_SETUP.match(last):
        return False
    return _MODEL_CALL.search(dotted_name(call.func) or last) is not None


#: Methods that accumulate into a list named before the loop.
_LIST_GROWS = frozenset({"append", "extend"})
#: Methods that change what they are called on: outside an accumulator, a write the gather would not see.
_MUTATES = frozenset({"append", "extend", "insert", "update", "add", "write", "writerow", "writerows", "to_csv",
                      "setdefault", "__setitem__"})


@dataclass(frozen=True)
class PredictLoop:
    """A loop to split: its accumulators (name → "list" or "sum", in the order first met)."""

    accumulators: dict[str, str] = field(default_factory=dict)

    @property
    def sums(self) -> set[str]:
        return {n for n, kind in self.accumulators.items() if kind == "sum"}


@dataclass(frozen=True)
class PredictRefusal:
    """Why a prediction loop cannot be split: its cell position, the line of its cleaned code, the reason."""

    position: int
    line: int
    reason: str


def prediction_loop(loop: ast.AST, splitting: frozenset[str] = frozenset()) -> PredictLoop | None:
    """The loop's accumulators where ``loop`` predicts (calls a model, accumulates its output), else None. A loop
    that trains (``backward``) is the training rules'; one that calls a function of ``splitting`` (whose own loop
    is split: ``for fold in folds: preds.append(inference(models[fold], loader))``) runs whole on every rank,
    each call splitting its rows."""
    if not isinstance(loop, ast.For):
        return None
    inside = list(_walk_body(loop.body))
    calls = [n for n in inside if isinstance(n, ast.Call)]
    if any(last_name(c.func) == "backward" or isinstance(c.func, ast.Name) and c.func.id in splitting
           for c in calls):
        return None
    if not any(_calls_a_model(c) for c in calls):
        return None
    names = list(_own_names(loop.body))
    own = {id(n) for n in names}  # ``[r.append(…) for r in rows]`` grows no list named before the loop
    found: dict[str, str] = {}
    for node in inside:
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _LIST_GROWS \
                and isinstance(node.func.value, ast.Name) and id(node.func.value) in own:
            found.setdefault(node.func.value.id, "list")
        elif isinstance(node, ast.AugAssign) and isinstance(node.op, ast.Add) and isinstance(node.target, ast.Name):
            found.setdefault(node.target.id, "sum")
    augmented = {id(n.target) for n in inside if isinstance(n, ast.AugAssign)}
    fresh = _stored(loop.target) | {n.id for n in names if isinstance(n.ctx, ast.Store)
                                    and id(n) not in augmented}  # a list made anew for each row is the row's own
    found = {n: kind for n, kind in found.items() if n not in fresh}
    return PredictLoop(found) if found else None


def loop_names(loop: ast.For, accumulators) -> list[str]:
    """The names a loop binds other than its accumulators (its target, what its rows compute), sorted: after a
    split loop each rank holds its own share's last row in them."""
    bound = _bound_in(loop.body)
    return sorted((bound | _stored(loop.target)) - set(accumulators))


def _bound_in(body: list[ast.stmt]) -> set[str]:
    """The names ``body`` binds in its own scope: not a comprehension's targets or a lambda's parameters."""
    return {n.id for n in _own_names(body) if isinstance(n.ctx, ast.Store)}


#: Expressions with a scope of their own: their targets (a lambda's parameters) are theirs, not the loop's.
_COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)


def _own_names(nodes: list[ast.AST], functions: bool = False):
    """The ``ast.Name`` nodes of ``nodes``' own scope, in source order: a name a comprehension binds (its
    ``for`` targets) or a lambda (its parameters, a walrus in its body), and the reads of it there, are that
    expression's own, so ``" ".join(str(t) for t in out)`` in a row carries no ``t`` to the next. A walrus in a
    comprehension binds in the enclosing scope, so it is one. Functions and classes defined in ``nodes`` are
    left out, unless ``functions`` (their bodies read names of the scope too, when called)."""
    todo = [(node, frozenset()) for node in reversed(nodes)]
    while todo:
        node, local = todo.pop()
        if isinstance(node, ast.Name):
            if node.id not in local:
                yield node
        elif functions or not isinstance(node, DEFS):
            todo.extend(reversed(_children_in_scope(node, local)))


def _children_in_scope(node: ast.AST, local: frozenset[str]) -> list[tuple[ast.AST, frozenset[str]]]:
    """``node``'s children, each with the names local to the expression scopes around it."""
    if isinstance(node, _COMPREHENSIONS):
        inner = local.union(*(_stored(g.target) for g in node.generators))
        parts = [part for g in node.generators for part in (g.target, g.iter, *g.ifs)]
        parts += [node.key, node.value] if isinstance(node, ast.DictComp) else [node.elt]
        # the first iterable is read in the enclosing scope, the rest in the comprehension's
        return [(part, local if part is node.generators[0].iter else inner) for part in parts]
    if isinstance(node, ast.Lambda):
        args = node.args
        params = {a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg) if a}
        inner = local | params | _stored(node.body)  # a walrus in a lambda binds in the lambda
        return [*((d, local) for d in (*args.defaults, *args.kw_defaults) if d is not None), (node.body, inner)]
    return [(child, local) for child in ast.iter_child_nodes(node)]


def _walk_body(body: list[ast.stmt]):
    """Every node of ``body``, not those of functions or classes defined in it."""
    todo = list(reversed(body))
    while todo:
        node = todo.pop()
        yield node
        if not isinstance(node, (*DEFS, ast.Lambda)):
            todo.extend(reversed(list(ast.iter_child_nodes(node))))


def loops_in(nodes: list[ast.stmt], splitting: frozenset[str] = frozenset()) -> list[ast.For]:
    """The outermost prediction loops of statements, outside the functions and classes they define."""
    out: list[ast.For] = []
    todo = list(nodes)
    while todo:
        node = todo.pop(0)
        if isinstance(node, DEFS):
            continue
        if isinstance(node, ast.For) and prediction_loop(node, splitting) is not None:
            out.append(node)
            continue
        todo.extend(child for child in ast.iter_child_nodes(node) if isinstance(child, ast.stmt))
    return out


def plan_predictions(top: list[Statement], facts: JobFacts) -> None:
    """Where the notebook trains nowhere: its prediction statements (``JobFacts.predictions``), why any of their
    loops cannot be split (``JobFacts.predict_refusals``), and the code after the last one on rank 0."""
    defs = _splitting_defs(top)
    facts.predict_functions = splitting = frozenset(defs)
    split, refused = split_calls(top)
    facts.rule_state[SPLIT_CALLS] = split
    holding = [k for k, stmt in enumerate(top) if stmt in defs.values() or loops_in(stmt.nodes, splitting)
               or any(isinstance(c.func, ast.Name) and c.func.id in splitting for c in stmt.calls)
               or _trainer_predicts(stmt, facts) or stmt in split]
    if not holding:
        facts.batched_calls.extend((refused or one_generate_calls(top) or writing_loops(top))[:1])
        return
    facts.predictions = [top[k] for k in holding]
    _refuse_loops(top, holding, defs, facts)
    _refuse_hidden_calls(top, defs, facts)
    _plan_rank0(top, holding, facts)
    # before the first prediction, as before a training: a download or a save runs once, on rank 0
    plan_shared_saves(top, next((k for k in holding if top[k] not in defs.values()), holding[0]), facts)


def plan_kept_predictions(top: list[Statement], facts: JobFacts) -> None:
    """A kept job's ``%%ddp`` cell (the last of ``top``): its prediction loops, and the functions it defines
    holding one, split as a predicting notebook's are, refused alike. Nothing moves to rank 0: every rank
    gathers the whole results and runs on (a later cell runs on every rank); so does a pipeline call over rows
    (``split_calls``; one that cannot be split runs whole on every rank, as before). Every function of ``top``
    holding a loop counts as splitting (one an earlier ``%%ddp`` cell defined was split there), so a loop
    calling one runs whole on every rank, never a share of calls that each wait for every rank's share. A
    statement that trains is the training rules'; ``trainer.predict`` is left as it is (the Trainer splits)."""
    defs = _splitting_defs(top)
    facts.predict_functions = splitting = frozenset(defs)
    training = set(facts.training)
    split = {stmt: pipe for stmt, pipe in split_calls(top)[0].items()
             if stmt.cell.position == facts.kept_cell and stmt not in training}
    facts.rule_state[SPLIT_CALLS] = split
    holding = [k for k, stmt in enumerate(top) if stmt.cell.position == facts.kept_cell and stmt not in training
               and (stmt in defs.values() or loops_in(stmt.nodes, splitting) or stmt in split)]
    facts.predictions = [top[k] for k in holding]
    _refuse_loops(top, holding, defs, facts, settled=True)


def _splitting_defs(top: list[Statement]) -> dict[str, Statement]:
    """The top-level functions whose body holds a prediction loop, by name."""
    return {stmt.nodes[0].name: stmt for stmt in top if isinstance(stmt.nodes[0], (ast.FunctionDef, ast.AsyncFunctionDef))
            and loops_in(stmt.nodes[0].body)}


def _refuse_loops(top: list[Statement], holding: list[int], defs: dict[str, Statement], facts: JobFacts,
                  settled: bool = False) -> None:
    """Why any loop of the statements ``holding`` cannot be split (``JobFacts.predict_refusals``)."""
    splitting = frozenset(defs)
    for k in holding:
        stmt = top[k]
        function = stmt.nodes[0] if stmt in defs.values() else None
        for loop in loops_in(function.body if function else stmt.nodes, splitting):
            reason = refusal(loop, top, k, function, settled)
            if reason is not None:
                facts.predict_refusals.append(PredictRefusal(stmt.cell.position, loop.lineno, reason))


#: ``JobFacts.rule_state``'s key for the pipeline calls split over the ranks: statement → the pipeline's name.
SPLIT_CALLS = "predict.split_calls"
#: Calls whose rows come one by one, not as a list a rank can take a block of.
_STREAMED = frozenset({"Dataset", "IterableDataset", "iter", "load_dataset"})
#: transformers' views of a column of a dataset (``pt_utils``), the documented way to give a pipeline a dataset:
#: rows by index and a length, so a rank takes a block of them as of a list.
_KEYED = frozenset({"KeyDataset", "KeyPairDataset"})
#: What may wrap a pipeline call a loop walks: its results go through them as they are.
_LOOP_WRAPPERS = frozenset({"tqdm", "enumerate", "list", "iter"})


#: Why a notebook's one ``generate`` call is refused (``one_generate_calls``).
ONE_CALL = ("this generate(…) call predicts its whole batch at once, and the notebook has no loop over its prompts "
            "that nbddp could split; one call's batch cannot be shared by the GPUs without changing its numbers "
            "(each rank's part would be padded and computed at another size than one process's). Predict in a loop "
            "over the prompts or their batches (for batch in batches: out.append(model.generate(**batch))), which "
            "nbddp splits")
_GENERATOR = re.compile(r"model|llm|lm$|net$", re.IGNORECASE)


def one_generate_calls(top: list[Statement]) -> list[PredictRefusal]:
    """``model.generate(…)`` called outside any loop or comprehension (its batch made by a tokenizer, of one prompt
    or of all: the code does not say), for a notebook that predicts nothing nbddp can split: a refusal at each,
    saying the loop that would split. A ``generate`` in a loop that does not accumulate, or of something that is not
    a model, is not one."""
    out = []
    for stmt in top:
        if isinstance(stmt.nodes[0], DEFS):
            continue
        for node in _outside_loops(stmt.nodes):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "generate"
                    and _GENERATOR.search(last_name(node.func.value) or "")):
                out.append(PredictRefusal(stmt.cell.position, node.lineno, ONE_CALL))
    return out


def writing_loops(top: list[Statement]) -> list[PredictRefusal]:
    """For a notebook that predicts nothing nbddp can split: the first loop (its innermost such, a function's
    included) that runs a model and writes each row's result into something named before it
    (``preds[i*bs:(i+1)*bs] = …``, ``test.loc[i, "answer"] = …``) instead of accumulating it; refused there, saying
    so, rather than as a notebook with no training call."""
    for stmt in top:
        found = [loop for node in stmt.nodes for loop in ast.walk(node) if isinstance(loop, ast.For)
                 and prediction_loop(loop) is None and (written := _written_elsewhere(loop, set()))
                 and any(_calls_a_model(c) for c in _walk_body(loop.body) if isinstance(c, ast.Call))
                 and not any(last_name(c.func) == "backward" for c in _walk_body(loop.body) if isinstance(c, ast.Call))]
        if found:
            loop = max(found, key=lambda n: (n.lineno, n.col_offset))  # the innermost of nested ones
            reason = _row_writes_reason(_written_elsewhere(loop, set()))
            return [PredictRefusal(stmt.cell.position, loop.lineno, reason)]
    return []


def _row_writes_reason(written: str) -> str:
    return (f"it writes into {written} row by row, which would hold only each rank's own rows; append to a list "
            "named before the loop (preds.append(…)) and build it after the loop")


def _outside_loops(body: list[ast.stmt]):
    """The nodes of ``body`` outside loops, comprehensions, functions and classes."""
    stop = (*DEFS, ast.Lambda, ast.For, ast.AsyncFor, ast.While, ast.ListComp, ast.SetComp, ast.DictComp,
            ast.GeneratorExp)
    todo = list(reversed(body))
    while todo:
        node = todo.pop()
        if isinstance(node, stop):
            continue
        yield node
        todo.extend(reversed(list(ast.iter_child_nodes(node))))


def split_calls(top: list[Statement]) -> tuple[dict[Statement, str], list[PredictRefusal]]:
    """The pipeline calls over a whole list that each rank can make on its own block of the list: statements
    ``outputs = pipe(texts, …)`` or ``outputs = list(pipe(…))``, and loops over the results ``for out in
    tqdm(pipe(KeyDataset(ds, "text"), batch_size=8)): …`` (→ the pipeline's name), and why the other pipeline
    calls over rows cannot be split so (a refusal at each). A pipeline given one text is left alone, and
    ``generate``, whose batch a tokenizer made (one prompt or many: the code does not say), is not seen."""
    pipes = {t.id: node.value for stmt in top for node in stmt.nodes if isinstance(node, ast.Assign)
             and isinstance(node.value, ast.Call) and last_name(node.value.func) == "pipeline"
             for t in node.targets if isinstance(t, ast.Name)}
    bound = {t.id: node.value for stmt in top for node in stmt.nodes if isinstance(node, ast.Assign)
             for t in node.targets if isinstance(t, ast.Name)}
    split: dict[Statement, str] = {}
    refused: list[PredictRefusal] = []
    for stmt in top:
        if isinstance(stmt.nodes[0], DEFS):
            continue
        for call in (n for node in stmt.nodes for n in _walk_body([node])):
            if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id in pipes
                    and call.args):
                continue
            rows = call.args[0]
            named = bound.get(rows.id) if isinstance(rows, ast.Name) else None
            if not any(f(r) for f in (_list_like, _streamed, _keyed) for r in (rows, named)):
                continue  # one text, or rows the code does not show
            reason = _unsplittable_call(stmt, call, pipes[call.func.id], named)
            if reason is None:
                split[stmt] = call.func.id
            else:
                refused.append(PredictRefusal(stmt.cell.position, call.lineno, reason))
    return split, refused


def _unsplittable_call(stmt: Statement, call: ast.Call, made: ast.Call, named: ast.AST | None) -> str | None:
    """Why a pipeline call over rows cannot be split over the ranks, or None: ``NAME = pipe(rows, …)``, a
    statement of its own over a list, without sampling."""
    callee, rows = call.func.id, call.args[0]
    if _streamed(rows) or _streamed(named):
        return (f"{callee}(…) is given {ast.unparse(rows)}, rows that come one by one, which nbddp does not split; "
                f"give it a list (texts = list(…)) or a KeyDataset(ds, column) in a statement of its own: outputs = "
                f"{callee}(texts, …)")
    form = _split_form(stmt, call)
    if form is None:
        return (f"{callee}(…) predicts a whole list in one call, which nbddp splits over the GPUs only in a statement "
                f"of its own: outputs = {callee}(texts, …), then use outputs, or a loop over its results (for out in "
                f"{callee}(texts, …): …); or write it as a loop over batches (outputs = []; for batch in batches: "
                f"outputs.extend({callee}(batch)))")
    if form == "loop":
        writes = next((c for n in stmt.nodes[0].body for c in _walk_body([n]) if c is not call
                       if isinstance(c, ast.Call) and (writes_once(c) or _writes_rows(c))), None)
        if writes is not None:
            return (f"the loop over {callee}(…)'s results writes a file as it goes ({ast.unparse(writes.func)}), "
                    "which every rank would do, each holding every result: collect the results in the loop and "
                    "write the file after it")
    sampled = next((k for k in (keyword(call, "do_sample"), keyword(made, "do_sample"))
                    if k is not None and not (isinstance(k.value, ast.Constant) and not k.value.value)), None)
    if sampled is not None:
        return (f"{callee}(…, do_sample={ast.unparse(sampled.value)}) draws random numbers for each row, which split "
                "over the ranks would differ from one process's (its later rows draw where the earlier ones left the "
                "generator); predict without sampling (do_sample=False)")
    return None


def _split_form(stmt: Statement, call: ast.Call) -> str | None:
    """How a statement holds the pipeline call it may split, its only call of that pipeline: ``"assign"``
    (``outputs = pipe(…)``, ``outputs = list(pipe(…))``), ``"loop"`` (a loop walking its results, through
    ``tqdm``/``enumerate``), else None."""
    node = stmt.nodes[0]
    calls = sum(isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == call.func.id
                for n in _walk_body(stmt.nodes))
    if len(stmt.nodes) != 1 or calls != 1:
        return None
    while isinstance(node, ast.With) and len(node.body) == 1:  # ``with torch.no_grad(): preds = pipe(texts)``
        node = node.body[0]
    if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name) \
            and _unwrapped(node.value, {"list"}) is call:
        return "assign"
    if isinstance(node, ast.For) and _unwrapped(node.iter, _LOOP_WRAPPERS) is call and not loops_in([node]):
        return "loop"
    return None


#: Calls that write a row to a file opened before them (``fh.write(…)``, ``writer.writerow(…)``).
_ROW_WRITES = frozenset({"write", "writelines", "writerow", "writerows"})


def _writes_rows(call: ast.Call) -> bool:
    """``fh.write(…)``, ``writer.writerow(…)``, ``print(…, file=fh)``: a row written to a file already open."""
    if isinstance(call.func, ast.Attribute) and call.func.attr in _ROW_WRITES:
        return True
    return isinstance(call.func, ast.Name) and call.func.id == "print" and keyword(call, "file") is not None


def _unwrapped(node: ast.AST, wrappers: set[str] | frozenset[str]) -> ast.AST:
    """``node`` without the calls of ``wrappers`` around it (``tqdm(list(x), total=n)`` → ``x``)."""
    while isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in wrappers and node.args:
        node = node.args[0]
    return node


def _keyed(node: ast.AST | None) -> bool:
    """``KeyDataset(ds, "text")``: a dataset's column, rows by index (``_KEYED``)."""
    return isinstance(node, ast.Call) and last_name(node.func) in _KEYED


def _streamed(node: ast.AST | None) -> bool:
    """A generator expression, an iterator or a dataset that may stream (``load_dataset(…, streaming=True)``):
    rows that come one by one."""
    return isinstance(node, ast.GeneratorExp) or isinstance(node, ast.Call) and last_name(node.func) in _STREAMED


def _list_like(node: ast.AST | None) -> bool:
    """``[…]``, ``[… for …]``, ``list(…)``, ``….tolist()``."""
    return isinstance(node, (ast.List, ast.ListComp)) or isinstance(node, ast.Call) and (
        isinstance(node.func, ast.Name) and node.func.id == "list" or last_name(node.func) == "tolist")


#: A trainer's methods that shard the rows over the ranks and gather them back themselves.
_TRAINER_PREDICTS = frozenset({"predict", "evaluate"})


def _trainer_predicts(stmt: Statement, facts: JobFacts) -> bool:
    """A statement (not a function's definition) calling ``trainer.predict(…)``/``trainer.evaluate(…)`` of a
    trainer the notebook made: the Trainer splits its rows over the ranks and gathers every rank's predictions
    in order (padding dropped), so the statement runs on every rank as it is; the guard on its rows' count is
    the runtime's (``runtime/predict.py``)."""
    if isinstance(stmt.nodes[0], DEFS):
        return False
    for call in stmt.calls:
        head, _, attr = (dotted_name(call.func) or "").rpartition(".")
        if head in facts.trainer_names and attr in _TRAINER_PREDICTS:
            return True
    return False


def _plan_rank0(top: list[Statement], holding: list[int], facts: JobFacts) -> None:
    """From the first prediction statement on, what runs on rank 0 only: every statement but the prediction
    statements and what they need, read backwards: a statement binding or reading a name a later every-rank
    statement reads (reading it may change it: ``model.eval()``), or making a collective call. So the files
    written between two prediction loops (``display_images(images, path)``) are written once too."""
    from .training import is_collective_call

    last = holding[-1]
    predicting = set(facts.predictions)
    needed: set[str] = set()
    for k in range(len(top) - 1, holding[0] - 1, -1):
        stmt = top[k]
        if stmt in predicting:
            reason = None
        elif any(is_collective_call(c, facts) for c in stmt.calls):
            reason = "a collective call needs every rank"
        elif (stmt.binds | stmt.reads) & needed:
            reason = f"{', '.join(sorted((stmt.binds | stmt.reads) & needed))}: a later prediction loop uses it"
        else:
            facts.rank0.add(stmt)
            if k > last:
                facts.tail.add(stmt)
            continue
        if reason is not None and k > last:
            facts.all_ranks[stmt] = reason
        needed = (needed - stmt.binds) | stmt.reads


def _refuse_hidden_calls(top: list[Statement], defs: dict[str, Statement], facts: JobFacts) -> None:
    """A function whose loop is split, called from another function's body: what runs after it there (on every
    rank) is out of the facts' sight, so it is refused at that call."""
    for stmt in top:
        for node in stmt.nodes:
            for inner in ast.walk(node):
                if not isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                    continue
                for call in ast.walk(inner):
                    if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id in defs \
                            and call.func.id != getattr(inner, "name", None):
                        facts.predict_refusals.append(PredictRefusal(
                            stmt.cell.position, call.lineno,
                            f"{call.func.id}() splits its rows over the ranks, and is called from inside another "
                            "function, whose code after the call nbddp cannot place on rank 0; call it from a cell's "
                            "top level"))


def refusal(loop: ast.For, top: list[Statement], k: int, function: ast.FunctionDef | None = None,
            settled: bool = False) -> str | None:
    """Why ``loop`` (in ``top[k]``, inside ``function`` where given) cannot be split over the ranks, or None.
    ``settled``: a kept cell's loop at its top level, whose names every rank takes from the last row's rank
    after it (``loop_names``), so a later read of them is no reason."""
    found = prediction_loop(loop)
    accumulators = set(found.accumulators)
    for node in _walk_body(loop.body):
        if isinstance(node, ast.Break) and _own_break(loop, node):
            return "it stops with break, after a number of rows that each rank would count on its own share"
        if isinstance(node, (ast.Return, ast.Yield, ast.YieldFrom)):
            return "it returns from inside the loop, after a number of rows that each rank would count on its own share"
    carried = _carried(loop, accumulators) or _accumulator_read(loop, accumulators)
    if carried:
        return (f"{carried} carries a value from one row to the next, and each rank starts its share without the "
                "rows before it; keep each row's prediction independent of the others'")
    written = _written_elsewhere(loop, accumulators)
    if written:
        return _row_writes_reason(written)
    drawn = _draws(loop)
    if drawn:
        return (f"{drawn} draws random numbers in each row, which split over the ranks would differ from one "
                "process's (its later rows draw where the earlier ones left the generator); make each row's result "
                "its own (do_sample=False, a generator seeded per row) or run the notebook in one process")
    shuffled = _shuffled(loop.iter, top[:k + 1] if function is None else [])
    if shuffled:
        return (f"{shuffled} gives its rows in a random order, which each rank would draw for itself; predict in "
                "the rows' order (shuffle=False)")
    appended = _appends_after(loop, function.body if function is not None else top[k].nodes)
    if appended:
        return (f"{appended} after it, in the same block, runs on every rank and would append once per rank; "
                "write in a cell of its own after the loop (it runs on rank 0)")
    if function is None and settled:
        return None
    after = _read_after(loop, accumulators, top[k + 1:]) if function is None else _read_later(loop, accumulators, function)
    if after:
        return (f"{after} is read after the loop, where it holds the last row of each rank's share, not the last "
                "row; take what is needed from an accumulated list instead")
    return None


#: Calls that draw from a global random generator (``torch.randn``, ``np.random.normal``, ``random.choice``).
_RANDOM_HEADS = ("torch.rand", "np.random.", "numpy.random.", "random.")
#: Calls that seed a row by itself: its draws are then its own, not the previous rows'.
_SEEDS = frozenset({"manual_seed", "seed", "set_seed", "seed_everything"})


def _draws(loop: ast.For) -> str | None:
    """A call in the body that samples (``do_sample=True``) or draws from a global generator, unless the body
    seeds each row itself; what the static reading misses, the runtime stops (``runtime/predict.py``)."""
    calls = [n for n in _walk_body(loop.body) if isinstance(n, ast.Call)]
    if any(last_name(c.func) in _SEEDS for c in calls):
        return None
    bound = _bound_in(loop.body)
    for call in calls:
        generator = keyword(call, "generator")
        if generator is not None and isinstance(generator.value, ast.Name) and generator.value.id not in bound:
            return f"{ast.unparse(call.func)}(…, generator={generator.value.id}), a generator made before the loop,"
        sample = keyword(call, "do_sample")
        if sample is not None and not (isinstance(sample.value, ast.Constant) and not sample.value.value):
            return ast.unparse(call.func) + "(…, do_sample=…)"
        name = dotted_name(call.func) or ""
        if name.startswith(_RANDOM_HEADS) and keyword(call, "generator") is None:
            return name + "(…)"
    return None


def _appends_after(loop: ast.For, container: list[ast.stmt]) -> str | None:
    """A write appending to a file after ``loop`` in the statement or function holding it (``open(p, "a")``,
    ``to_csv(p, mode="a")``): that code runs on every rank, and each rank's append would land in the file."""
    for node in (n for stmt in container for n in ast.walk(stmt)):
        if not isinstance(node, ast.Call) or node.lineno <= loop.end_lineno:
            continue
        mode = keyword(node, "mode")
        value = mode.value if mode is not None else (node.args[1] if last_name(node.func) == "open"
                                                     and len(node.args) > 1 else None)
        if isinstance(value, ast.Constant) and isinstance(value.value, str) and "a" in value.value:
            return ast.unparse(node)
    return None


def _own_break(loop: ast.For, node: ast.Break) -> bool:
    """A ``break`` of ``loop`` itself, not of a loop inside it."""
    todo = list(loop.body)
    while todo:
        stmt = todo.pop()
        if stmt is node:
            return True
        if isinstance(stmt, (ast.For, ast.While, *DEFS)):
            continue
        todo.extend(c for c in ast.iter_child_nodes(stmt) if isinstance(c, ast.stmt))
    return False


def _stored(target: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(target) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}


def _carried(loop: ast.For, accumulators: set[str]) -> str | None:
    """A name the body binds and reads, in some row, before binding it in that row: the previous row's value."""
    bound_in_body = _bound_in(loop.body)
    candidates = bound_in_body - accumulators
    bound = _stored(loop.target)
    for stmt in loop.body:
        for name in _reads_before_binds(stmt, bound):
            if name in candidates:
                return name
    return None


def _accumulator_read(loop: ast.For, accumulators: set[str]) -> str | None:
    """An accumulator the body reads other than to grow it (``submission.append([i, p]); i += 1``: a row
    counter, ``len(preds)``): on another rank it would count from the start of that rank's share."""
    growing: set[int] = set()
    for node in _walk_body(loop.body):
        if isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name):
            growing.add(id(node.target))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _LIST_GROWS:
            growing.add(id(node.func.value))
    for node in _own_names(loop.body):
        if node.id in accumulators and id(node) not in growing:
            return node.id
    return None


def _reads_before_binds(stmt: ast.stmt, bound: set[str]):
    """Names ``stmt`` reads that ``bound`` (names bound earlier in the row) lacks; ``bound`` grows with what
    ``stmt`` binds. Blocks are read in order; a name a branch binds counts as bound after it."""
    if isinstance(stmt, DEFS):
        bound.add(stmt.name)
        return
    heads: list[ast.AST] = []
    bodies: list[list[ast.stmt]] = []
    if isinstance(stmt, (ast.For, ast.AsyncFor)):
        heads, bodies = [stmt.iter], [stmt.body, stmt.orelse]
        bound |= _stored(stmt.target)
    elif isinstance(stmt, (ast.If, ast.While)):
        heads, bodies = [stmt.test], [stmt.body, stmt.orelse]
    elif isinstance(stmt, (ast.With, ast.AsyncWith)):
        heads, bodies = [i.context_expr for i in stmt.items], [stmt.body]
        for item in stmt.items:
            if item.optional_vars is not None:
                bound |= _stored(item.optional_vars)
    elif isinstance(stmt, ast.Try):
        bodies = [stmt.body, *(h.body for h in stmt.handlers), stmt.orelse, stmt.finalbody]
    else:
        value = getattr(stmt, "value", None)
        heads = [stmt] if not isinstance(stmt, (ast.Assign, ast.AnnAssign)) else [value] if value else []
        if isinstance(stmt, ast.AugAssign) and isinstance(stmt.target, ast.Name) and stmt.target.id not in bound:
            yield stmt.target.id  # grown in this row before it was bound in it: the previous row's value
    for head in heads:
        names = list(_own_names([head]))
        yield from (n.id for n in names if isinstance(n.ctx, ast.Load) and n.id not in bound)
        bound |= {n.id for n in names if isinstance(n.ctx, ast.Store)}  # ``if (out := model(x)) …:``
    if isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
        for target in (stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]):
            for node in ast.walk(target):  # a subscript or attribute target reads its base
                if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id not in bound:
                    yield node.id
            bound |= _stored(target)
    for body in bodies:
        for inner in body:
            yield from _reads_before_binds(inner, bound)


def _written_elsewhere(loop: ast.For, accumulators: set[str]) -> str | None:
    """Something named before the loop that the body writes into other than by an accumulator: a subscript or
    attribute assigned, a method that changes its object (``df.loc[i, "p"] = …``, ``results.update(…)``,
    ``f.write(…)``)."""
    fresh = _bound_in(loop.body) | _stored(loop.target)
    own = {id(n) for n in _own_names(loop.body)}  # not a comprehension's item: ``[r.append(…) for r in rows]``
    for node in _walk_body(loop.body):
        targets = []
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        for target in targets:
            if isinstance(target, (ast.Subscript, ast.Attribute)):
                base = _base(target)
                if base is not None and base.id not in fresh:
                    return ast.unparse(target)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _MUTATES:
            base = _base(node.func.value)
            plain_accumulator = isinstance(node.func.value, ast.Name) and base.id in accumulators \
                and node.func.attr in _LIST_GROWS
            if base is not None and id(base) in own and base.id not in fresh and not plain_accumulator:
                return ast.unparse(node.func.value)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print" \
                and keyword(node, "file") is not None:
            return "a file (print(…, file=…))"
    return None


def _base(node: ast.AST) -> ast.Name | None:
    """The name an attribute, subscript or call chain starts from (``df`` of ``df.loc[i]``)."""
    while isinstance(node, (ast.Subscript, ast.Attribute, ast.Call)):
        node = node.value if not isinstance(node, ast.Call) else node.func
    return node if isinstance(node, ast.Name) else None


def _iterated(expr: ast.AST) -> ast.AST:
    """What a loop header iterates under ``enumerate``/``tqdm``/``zip``'s first argument."""
    while isinstance(expr, ast.Call) and last_name(expr.func) in ("enumerate", "tqdm", "iter") and expr.args:
        expr = expr.args[0]
    return expr


def _shuffled(iterated: ast.AST, before: list[Statement]) -> str | None:
    """The loop's rows in a random order: a DataLoader bound with ``shuffle=True``, or ``….sample(…)`` /
    ``permutation`` / ``shuffle`` in the header itself."""
    expr = _iterated(iterated)
    for node in ast.walk(expr):
        if isinstance(node, ast.Call) and last_name(node.func) in ("sample", "permutation", "shuffle", "randperm"):
            return ast.unparse(node)
    name = expr.id if isinstance(expr, ast.Name) else None
    if name is None:
        return None
    for stmt in reversed(before):
        if name not in stmt.binds:
            continue
        for node in stmt.nodes:
            for call in ast.walk(node):
                if isinstance(call, ast.Call) and last_name(call.func) == "DataLoader":
                    shuffle = getattr(keyword(call, "shuffle"), "value", None)
                    if shuffle is not None and not (isinstance(shuffle, ast.Constant) and not shuffle.value):
                        return f"{name} (DataLoader(…, shuffle={ast.unparse(shuffle)}))"
        return None
    return None


def _read_later(loop: ast.For, accumulators: set[str], function: ast.FunctionDef) -> str | None:
    """In a function: a name the loop binds (not an accumulator) whose first use after the loop reads it."""
    bound = (_bound_in(loop.body) | _stored(loop.target)) - accumulators
    later = sorted((n.lineno, n.col_offset, isinstance(n.ctx, ast.Load), n.id) for n in _own_names(function.body)
                   if n.id in bound and n.lineno > loop.end_lineno)
    first: dict[str, bool] = {}
    for _, _, load, name in later:
        first.setdefault(name, load)
    return next((name for name, load in sorted(first.items()) if load), None)


def _read_after(loop: ast.For, accumulators: set[str], after: list[Statement]) -> str | None:
    """A name the loop binds (not an accumulator) that a later top-level statement reads before binding it."""
    bound = (_bound_in(loop.body) | _stored(loop.target)) - accumulators
    for stmt in after:
        if isinstance(stmt.nodes[0], DEFS):
            bound -= stmt.binds
            continue
        read = sorted((stmt.reads - stmt.binds) & bound)
        if read:  # ``[x for x in out]`` after the loop reads its own x, not the loop's
            read = sorted(set(read) & {n.id for n in _own_names(stmt.nodes, functions=True)
                                       if isinstance(n.ctx, ast.Load)})
        if read:
            return read[0]
        bound -= stmt.binds
        if not bound:
            return None
    return None
