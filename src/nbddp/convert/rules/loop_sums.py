"""Plain PyTorch: what a loop over a sharded loader adds up is the whole data set's when the loop ends."""

from __future__ import annotations

import ast
import re

from ..ast_helpers import last_name
from ..cst_helpers import code_of, cst
from ..engine.rule import Rule
from ..facts.index_loops import shardable_loop
from ..facts.loaders import loader_name
from ..facts.meters import shape_of


class LoopSumsRule(Rule):
    """Plain PyTorch: ``trn_loss += loss.item() * x.size(0)`` (or ``stats["loss"] += …``, a dict's item at a key
    written out) in a loop over a loader nbddp shards (or over the batch positions or samples ``ShardLoopRule``
    shares out): before the loop ``_nbddp_trn_loss = _nbddp.before_loop(trn_loss)``, after it ``trn_loss =
    _nbddp.over_ranks(trn_loss, since=_nbddp_trn_loss)``.

    Each rank's loop reads its share of the batches (a DistributedSampler), so what it adds up is its share's:
    ``trn_loss / len(data_train)`` printed half the epoch's loss on two ranks, and an early stop or a best
    checkpoint chosen on it was chosen on rank 0's half, the other ranks deciding on theirs. After the loop every
    rank holds what it held before the loop plus what every rank's loop added (``runtime/loop_sums.over_ranks``):
    one process's sum, also for a count kept across epochs (``examples_seen``), which summing the whole value
    would count again each epoch. A sum the code after
    the loop divides by a count of the rank's own — ``len(train_loader)`` (its batches under the sampler), the
    loop's ``enumerate`` index, a counter the loop adds 1 to — is averaged over the ranks instead, so the quotient
    is the whole set's mean (also by a name bound to ``len(train_loader)``: summed, ``total / n_batches`` was twice
    the mean on two ranks). Only names the loop adds to and never sets, with something other than a constant
    (``step += 1`` stays each rank's count). In a notebook that calls DataParallel too: there every rank reads a
    part of each batch (``data_parallel_batch``), so what a loop adds up is its part's, made whole the same way.

    A running-average object the loop updates (``losses.update(loss.item(), n)`` on an ``AverageMeter`` of the
    notebook's own class, ``facts/meters.py``, or one it imports, taken to have that shape) gets the same for the
    attributes its ``update`` adds to (``sum``, ``count``), and what ``update`` derives from them (``avg``) is
    derived again: a ``train_fn`` returning ``losses.avg`` returned rank 0's share's average.
    """

    # -- where it has work: Python's ast, before libcst reads anything

    name = "loop_sums"
    pattern = re.compile(r"\+=|\.update\(")  # a sum, or a meter's update

    @classmethod
    def wanted(cls, cell, facts) -> bool:
        return facts.plain_loop and super().wanted(cell, facts)

    @classmethod
    def touches(cls, stmt, facts, nodes) -> bool:
        return any(isinstance(n, ast.For) and _shared_out(n, facts) and (_sums(n) or _meters(n, facts)) for n in nodes)

    # -- what it does: libcst

    def visit_Module(self, node: cst.Module) -> None:
        # the code after a loop, where its sums are divided: the chunk's statements as the facts read them
        self._tree = ast.Module(body=[n for stmt in self.chunk.statements for n in stmt.nodes], type_ignores=[])

    def leave_For(self, original: cst.For, updated: cst.For):
        tree = ast.parse(code_of(original.with_changes(leading_lines=[]))).body[0]
        loader = _shared_out(tree, self.facts)
        sums = _sums(tree) if loader else []
        meters = _meters(tree, self.facts) if loader else {}
        if not sums and not meters:
            return updated
        own_counts = _own_counts(tree, loader, self.facts)
        means = [name for name in sums if _divided_by(self._tree, name, own_counts)]
        before = [cst.parse_statement(f"{_start(name)} = _nbddp.before_loop({name})\n") for name in sums]
        after = [cst.parse_statement(f"{name} = _nbddp.over_ranks({name}, since={_start(name)}"
                                     f"{', mean=True' if name in means else ''})\n") for name in sums]
        for name, shape in meters.items():
            before.append(cst.parse_statement(f"_nbddp_{name} = _nbddp.before_meter({name}, {shape.summed!r})\n"))
            after.append(cst.parse_statement(f"_nbddp.meter_over_ranks({name}, _nbddp_{name}, {shape.derived!r})\n"))
        summed = [name for name in sums if name not in means]
        said = []
        if summed:
            said.append(f"what it adds to {', '.join(summed)} is summed over the ranks")
        if means:
            said.append(f"what it adds to {', '.join(means)} is averaged over them (divided by a count of each "
                        "rank's own)")
        for name, shape in meters.items():
            derived = ", ".join(attr for attr, _, _ in shape.derived)
            said.append(f"{name}'s {', '.join(shape.summed)} are summed over the ranks"
                        + (f" and its {derived} derived from them again" if derived else ""))
        self.note(original, f"after the loop over {loader}, whose batches are shared out, {' and '.join(said)}: "
                            "what one process adds up, the same on every rank")
        before[0] = before[0].with_changes(leading_lines=updated.leading_lines)
        return cst.FlattenSentinel([*before, updated.with_changes(leading_lines=[]), *after])


def _start(summed: str) -> str:
    """The name that holds where a sum stood as its loop began: ``_nbddp_trn_loss``, ``_nbddp_stats_loss``."""
    return "_nbddp_" + re.sub(r"\W+", "_", summed).strip("_")


def _shared_out(loop: ast.For, facts) -> str | None:
    """What the loop iterates where nbddp shares it out between the ranks: a loader it shards, or the batch
    positions or samples ``ShardLoopRule`` shares out (``range(0, len(X), bs)``); None for any other loop."""
    if shardable_loop(loop, facts) is not None:
        return ast.unparse(loop.iter)
    return _loader_of(loop.iter, facts)


def _loader_of(iterated: ast.expr, facts) -> str | None:
    """The loader nbddp shards that a ``for`` iterates (``loader_name``: through ``enumerate``/``tqdm``/``iter``)."""
    name = loader_name(iterated)
    if name in facts.sharded_loaders and name not in facts.whole_loaders | facts.accelerate_prepared:
        return name
    return None


def _body_nodes(loop: ast.For):
    """Every node of the loop's body, not inside a function, class or lambda defined there."""
    todo = list(loop.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        yield node
        todo.extend(ast.iter_child_nodes(node))


def _additions(loop: ast.For) -> list[ast.AugAssign]:
    """The loop's ``name += …`` and ``stats["loss"] += …`` statements (``_summed_text``), in source order."""
    added = [n for n in _body_nodes(loop) if isinstance(n, ast.AugAssign) and isinstance(n.op, ast.Add)
             and _summed_text(n.target) is not None]
    return sorted(added, key=lambda n: (n.lineno, n.col_offset))


def _summed_text(target: ast.expr) -> str | None:
    """What a sum is spelled as: a name, or a name's item at a written-out key (``stats["loss"]``); else None."""
    if isinstance(target, ast.Name):
        return target.id
    if isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name) and \
            isinstance(target.slice, ast.Constant) and isinstance(target.slice.value, (str, int)):
        return ast.unparse(target)
    return None


def _sums(loop: ast.For) -> list[str]:
    """What the loop adds to (``x += …`` or ``stats["loss"] += …``, not a constant) and never sets otherwise, in
    source order, as spelled. An item's mapping counts as set where the loop binds it, sets an item of it, or calls
    a method of it (``stats.clear()``)."""
    nodes = list(_body_nodes(loop))
    set_ = {t.id for n in nodes if isinstance(n, (ast.Assign, ast.AnnAssign, ast.For, ast.With, ast.NamedExpr))
            for t in ast.walk(n) if isinstance(t, ast.Name) and isinstance(t.ctx, ast.Store)}
    set_ |= {t.id for t in ast.walk(loop.target) if isinstance(t, ast.Name)}
    set_ |= {n.target.id for n in nodes if isinstance(n, ast.AugAssign) and isinstance(n.target, ast.Name)
             and not isinstance(n.op, ast.Add)}
    additions = _additions(loop)
    added_to = {id(n.target) for n in additions}
    changed = {n.value.id for n in nodes if isinstance(n, ast.Subscript) and isinstance(n.ctx, (ast.Store, ast.Del))
               and isinstance(n.value, ast.Name) and id(n) not in added_to}
    changed |= {owner for owner, _ in _method_calls(nodes)}
    sums = []
    for n in additions:
        owner = n.target.id if isinstance(n.target, ast.Name) else n.target.value.id
        if not isinstance(n.value, ast.Constant) and owner not in set_ and \
                (isinstance(n.target, ast.Name) or owner not in changed):
            sums.append(_summed_text(n.target))
    return list(dict.fromkeys(sums))


def _method_calls(nodes) -> list[tuple[str, str]]:
    """``(name, method)`` of each ``name.method(…)`` call among ``nodes``."""
    return [(n.func.value.id, n.func.attr) for n in nodes if isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute) and isinstance(n.func.value, ast.Name)]


def _meters(loop: ast.For, facts) -> dict:
    """The notebook's running-average objects the loop updates (``losses.update(loss.item(), n)`` on an instance
    of a ``facts/meters`` class) → their class's shape; not one the loop binds or calls any other method of
    (``losses.reset()``), whose sums would not run from the loop's start to its end."""
    nodes = list(_body_nodes(loop))
    calls = _method_calls(nodes)
    bound = {t.id for n in nodes for t in ast.walk(n) if isinstance(t, ast.Name) and isinstance(t.ctx, ast.Store)}
    bound |= {t.id for t in ast.walk(loop.target) if isinstance(t, ast.Name)}
    updated = dict.fromkeys(name for name, method in calls if method == "update" and name in facts.meter_instances)
    shapes = {name: shape_of(facts.meter_instances[name], facts.meters, facts.own_classes) for name in updated}
    return {name: shape for name, shape in shapes.items() if shape is not None and name not in bound
            and all(method == "update" for owner, method in calls if owner == name)}


def _own_counts(loop: ast.For, loader: str, facts) -> set[str]:
    """What counts the rank's own batches or rows: ``len(<loader>)``, a name bound to it (``n_batches =
    len(train_loader)``, in any cell), the loop's ``enumerate`` index, a name the loop adds a constant to (``n +=
    1``)."""
    own = {f"len({loader})"} | {name for name, of in facts.loader_lengths.items() if of == loader}
    if isinstance(loop.iter, ast.Call) and last_name(loop.iter.func) == "enumerate" and \
            isinstance(loop.target, ast.Tuple) and isinstance(loop.target.elts[0], ast.Name):
        own.add(loop.target.elts[0].id)
    own |= {_summed_text(n.target) for n in _additions(loop) if isinstance(n.value, ast.Constant)}
    return own


def _divided_by(tree: ast.AST, name: str, own_counts: set[str]) -> bool:
    """Whether the code divides ``name`` by one of ``own_counts`` (``loss_sum / len(train_loader)``,
    ``total / (i + 1)``)."""
    spelled = (ast.Name, ast.Subscript, ast.Call)  # how a sum and a count are written: compared as spelled
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            divided, by = node.left, node.right
        elif isinstance(node, ast.AugAssign) and isinstance(node.op, ast.Div):  # train_loss /= len(loader)
            divided, by = node.target, node.value
        else:
            continue
        if any(isinstance(n, spelled) and ast.unparse(n) == name for n in ast.walk(divided)) and any(
                isinstance(n, spelled) and ast.unparse(n) in own_counts for n in ast.walk(by)):
            return True
    return False
