"""Facts about data loaders: which ones are training loaders, sharded over the ranks."""

from __future__ import annotations

import ast
from typing import TYPE_CHECKING

from ..ast_helpers import is_literal, keyword, last_name, live_calls
from .training import is_helper_training, is_training_call

if TYPE_CHECKING:
    from .job_facts import JobFacts, Seen


#: Samplers a ``DistributedSampler`` stands in for: (shuffles).
PLAIN_SAMPLERS = {"RandomSampler": True, "SequentialSampler": False}


def loader_shards(own_sampler: bool, shuffles: bool | None, targets: list[str], trained: set[str] = frozenset()) -> bool:
    """Whether a ``DataLoader`` gets a ``DistributedSampler``: it shuffles, it is named as a training loader,
    or a training loop iterates it (``trained``: ``JobFacts.train_iterated``).

    ``own_sampler``: it has a ``sampler``/``batch_sampler`` of its own (left alone). ``shuffles``: None without
    ``shuffle=``, False for ``shuffle=False``/``None``, True for anything else. Loaders that neither shuffle nor
    say "train" (validation, test) stay whole on every rank, so metrics computed from them are the full data
    set's.
    """
    if own_sampler:
        return False
    if shuffles:
        return True
    return any("train" in t.lower() or t in trained for t in targets)


def plain_sampler(call: ast.Call) -> str | None:
    """``RandomSampler``/``SequentialSampler`` when a DataLoader's ``sampler=`` is ``X(dataset)`` of one."""
    given = keyword(call, "sampler")
    value = given.value if given is not None else None
    if isinstance(value, ast.Call) and last_name(value.func) in PLAIN_SAMPLERS and len(value.args) == 1 \
            and not value.keywords and keyword(call, "batch_sampler") is None:
        return last_name(value.func)
    return None


def loader_name(expr: ast.AST) -> str | None:
    """The loader a ``for`` iterates: ``dl`` in ``dl``, ``enumerate(dl)``, ``tqdm(dl, …)``, ``enumerate(tqdm(dl))``."""
    while isinstance(expr, ast.Call) and expr.args and last_name(expr.func) in ("enumerate", "tqdm", "iter"):
        expr = expr.args[0]
    return expr.id if isinstance(expr, ast.Name) else None


def trained_in(function: ast.AST, facts: JobFacts) -> set[str]:
    """The loaders a training loop inside ``function`` itself iterates (``JobFacts.train_iterated`` holds such
    names from anywhere: a parameter of another function may share a factory's local name)."""
    return {name for loop in ast.walk(function) if isinstance(loop, (ast.For, ast.AsyncFor))
            and (name := loader_name(loop.iter)) is not None
            and any(isinstance(c, ast.Call) and is_training_call(c, facts) for c in ast.walk(loop))}


def plan_loaders(seen: Seen, defs: dict[str, list[ast.Call]], facts: JobFacts) -> None:
    """Which loaders are training loaders: those ``loader_shards`` says so of, and those a function of the
    notebook builds (``get_data_loader(ds, shuffle=…)``) when called with ``shuffle=True`` or for a training
    name. Their epoch loops get ``set_epoch``."""
    facts.train_iterated = {name for name, loop in seen.fors
                            if any(isinstance(c, ast.Call) and is_training_call(c, facts) for c in ast.walk(loop))}
    for own, shuffles, targets in seen.loaders:
        if facts.accelerate_prepared.isdisjoint(targets) and loader_shards(own, shuffles, targets, facts.train_iterated):
            facts.sharded_loaders.update(targets)
        else:
            facts.whole_loaders.update(targets)
    factories = {name for name, calls in defs.items() if any(last_name(c.func) == "DataLoader" for c in calls)}
    for targets, call in seen.assigned:
        callee = last_name(call.func) or ""
        if isinstance(call.func, ast.Name) and callee in factories:
            shuffle = keyword(call, "shuffle")
            shuffles = shuffle is not None and not is_literal(shuffle.value, False, None)
            if loader_shards(False, shuffles, targets, facts.train_iterated):
                facts.sharded_loaders.update(targets)
            else:
                facts.whole_loaders.update(targets)
        elif callee not in defs and "loader" in callee.lower() and loader_shards(False, None, targets, facts.train_iterated):
            facts.helper_loaders.update(targets)  # a helper's loader: sharded when it runs
    facts.whole_loaders -= facts.sharded_loaders | facts.helper_loaders


def helper_training_loaders(call: ast.Call) -> list[str]:
    """The training loaders an imported training helper is given: ``train_dataloader=train_dataloader`` in
    ``engine.train(…)``, a name (or keyword) saying both "train" and "loader"/"dl" (not the test loader)."""
    found = []
    for given, value in [(None, a) for a in call.args] + [(k.arg, k.value) for k in call.keywords]:
        said = f"{given or ''} {value.id if isinstance(value, ast.Name) else ''}".lower()
        if isinstance(value, ast.Name) and "train" in said and ("loader" in said or "dl" in said.split("_")[-1]):
            found.append(value.id)
    return found


def plan_helper_training_loaders(top: list, facts: JobFacts) -> None:
    """Loaders handed to an imported training helper (``is_helper_training``) by a training statement are
    sharded when it is called: nbddp cannot see the loop inside, only what goes in. Every call to such a
    helper (``JobFacts.helper_trainings``) is where the sampler rule shards them."""
    for stmt in facts.training:
        for call in stmt.calls:
            if is_helper_training(call, facts):
                facts.helper_training_loaders.update(n for n in helper_training_loaders(call) if n not in facts.sharded_loaders)
    if facts.helper_training_loaders:
        facts.helper_trainings = {call_place(stmt, call) for stmt in top for call in live_calls(stmt.nodes)
                                  if is_helper_training(call, facts)}


def call_place(stmt, call: ast.Call) -> tuple[int, int, int]:
    """(cell position, line, column in characters, as libcst counts them) of a call; ast counts UTF-8 bytes."""
    return stmt.cell.position, call.lineno, len(stmt.cell.line_bytes(call.lineno)[: call.col_offset].decode())


def loader_lengths(nodes, sharded: set[str]) -> dict[str, str]:
    """Names bound only to ``len(<loader>)`` of one loader of ``sharded`` in ``nodes`` and everything under them
    (``n_batches = len(train_loader)``) → that loader. A name bound to anything else anywhere, or to the lengths of
    two loaders, is none: what it counts is not known."""
    lengths: dict[str, str] = {}
    counted: set[int] = set()  # the Name nodes those bindings store to
    for node in nodes:
        for n in ast.walk(node):
            loader = _length_of(n.value) if isinstance(n, ast.Assign) else None
            if loader is None:
                continue
            for target in n.targets:
                if isinstance(target, ast.Name) and lengths.setdefault(target.id, loader) == loader:
                    counted.add(id(target))
    other = {n.id for node in nodes for n in ast.walk(node)
             if isinstance(n, ast.Name) and isinstance(n.ctx, (ast.Store, ast.Del)) and id(n) not in counted}
    return {name: loader for name, loader in lengths.items() if name not in other and loader in sharded}


def _length_of(value: ast.expr) -> str | None:
    """``L`` of ``len(L)``, L a name."""
    if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "len" and \
            len(value.args) == 1 and not value.keywords and isinstance(value.args[0], ast.Name):
        return value.args[0].id
    return None
