"""Plain PyTorch: a training DataLoader gets a DistributedSampler: the rule and where it has work."""

from __future__ import annotations

import ast
import re

from .. import ast_helpers
from ..cst_helpers import (
    code_of,
    cst,
    fixed_expression,
    has_keyword,
    is_attribute,
    is_name,
    keyword,
    last_name,
    set_keyword,
    walk,
    wrap_named_arguments,
)
from ..engine.rule import Rule
from ..facts.loaders import PLAIN_SAMPLERS, loader_shards, trained_in


class DistributedSamplerRule(Rule):
    """Plain PyTorch: a training ``DataLoader`` gets a ``DistributedSampler``; ``shuffle`` moves into it.

    Without it every rank would read the whole data set in the same order, so DDP would average identical
    gradients: no speed-up. ``DataLoader(ds, shuffle=True)`` becomes
    ``DataLoader(ds, sampler=_nbddp.distributed_sampler(ds, shuffle=True))`` (a DataLoader refuses both a
    sampler and ``shuffle``). Loaders that shuffle or are named as training loaders get one; validation and
    test loaders stay whole on every rank so their metrics are the full set's. A loader with its own
    ``sampler``/``batch_sampler`` is left alone.
    """

    # -- where it has work: Python's ast, before libcst reads anything

    name = "sampler"
    pattern = re.compile(r"\bDataLoader\s*\(")

    @classmethod
    def wanted(cls, cell, facts) -> bool:
        return facts.plain_loop and super().wanted(cell, facts)

    @classmethod
    def could_change(cls, text, facts) -> bool:
        return super().could_change(text, facts) or any(
            name in text for name in facts.helper_loaders | facts.helper_training_loaders)

    @classmethod
    def touches(cls, stmt, facts, nodes) -> bool:
        return any(ast_helpers.last_name(c.func) == "DataLoader" for c in ast_helpers.calls(nodes)) or bool(
            stmt.binds & facts.helper_loaders) or (bool(facts.helper_training_loaders) and bool(stmt.reads & facts.helper_training_loaders))

    # -- what it does: libcst

    def __init__(self, facts, chunk):
        super().__init__(facts, chunk)
        self._assigned: dict[cst.Call, list[str]] = {}  # a call assigned to names → those names
        self._preparing = 0  # inside ``accelerator.prepare(…)``
        self._functions: list[set[str]] = []  # per enclosing function: the loaders its own training loops iterate

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        self._functions.append(self._trained_in(node.name.value))

    def leave_FunctionDef(self, original: cst.FunctionDef, updated: cst.FunctionDef) -> cst.FunctionDef:
        self._functions.pop()
        return updated

    def _trained_in(self, name: str) -> set[str]:
        """``trained_in`` of the chunk's function ``name`` (its ast), or every training loader if not found."""
        found = next((n for s in self.chunk.statements for top in s.nodes for n in ast.walk(top)
                      if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name), None)
        return self.facts.train_iterated if found is None else trained_in(found, self.facts)

    def visit_Assign(self, node: cst.Assign) -> None:
        if isinstance(node.value, cst.Call):
            self._assigned[node.value] = [t.target.value for t in node.targets if isinstance(t.target, cst.Name)]

    def visit_Call(self, node: cst.Call) -> None:
        self._preparing += self._prepares(node)

    def _prepares(self, call: cst.Call) -> bool:
        """``accelerator.prepare(…)``: Accelerate shards the loaders handed to it."""
        return is_attribute(call.func, "prepare") and is_name(call.func.value) and (
            call.func.value.value in self.facts.accelerators)

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.Call:
        self._preparing -= self._prepares(original)
        if original in self.chunk.helper_trainings:  # the facts' ``helper_trainings``
            updated = self._helper_training(original, updated)
        helper = [t for t in self._assigned.get(original, []) if t in self.facts.helper_loaders]
        if helper and last_name(updated.func) != "DataLoader":
            return self._helper_loader(original, updated, helper[0])
        if last_name(updated.func) != "DataLoader" or not updated.args or self._preparing:
            return updated
        if not self.facts.accelerate_prepared.isdisjoint(self._assigned.get(original, [])):
            return updated
        shuffle = keyword(updated, "shuffle")
        own = has_keyword(updated, "sampler") or has_keyword(updated, "batch_sampler")
        shuffles = None if shuffle is None else not is_name(shuffle.value, "False", "None")
        targets = self._assigned.get(original, [])
        if (plain := _plain_sampler(updated)) is not None:
            return self._replace_sampler(original, updated, plain, targets)
        if not loader_shards(own, shuffles, targets, self.facts.train_iterated):
            if own and loader_shards(False, None, targets, self.facts.train_iterated):
                self.note(original, "DataLoader: has a sampler of its own, left alone: every rank reads what it "
                                    "gives (nbddp says so at the first step if the batches are the same)")
            return updated
        # ``shuffle=shuffle`` in a loader factory: a training loader when it shuffles, else whole (unless
        # named as one, or the factory's own training loop reads it: the caller's loops read the caller's)
        depends = shuffle is not None and _decided_at_run_time(shuffle.value) and not loader_shards(
            own, None, targets, self._functions[-1] if self._functions else self.facts.train_iterated)
        return self._shard(original, updated, depends)

    def _helper_training(self, original: cst.Call, updated: cst.Call) -> cst.Call:
        """``engine.train(…, train_dataloader=train_dataloader)``: the loader goes in through
        ``_nbddp.shard_loader`` (the helper's own epoch loop calls no ``set_epoch``: each epoch deals the
        same shares)."""
        updated, sharded = wrap_named_arguments(updated, self.facts.helper_training_loaders, "_nbddp.shard_loader",
                                                say_name=True)
        for name in sharded:
            self.note(original, f"{name}: handed to an imported training helper, sharded as it goes in (its "
                                "epochs reuse one shuffle of each rank's share: it calls no set_epoch)")
        return updated

    def _helper_loader(self, original: cst.Call, updated: cst.Call, name: str) -> cst.Call:
        """``name = create_dataloader(…)``: the loader goes through ``_nbddp.shard_loader`` when it runs."""
        self.note(original, f"{name}: a helper's loader, sharded when it runs where it is a plain DataLoader "
                            "(else said then)")
        first = cst.Arg(updated, comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
        named = _keyword_arg("name", cst.SimpleString(repr(name)))
        if not self.facts.data_parallel:
            return cst.Call(func=fixed_expression("_nbddp.shard_loader"), args=[first, named])
        self.note(original, f"{name}: its batch is the step DataParallel split over the GPUs: each rank takes its part")
        named = named.with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
        return cst.Call(func=fixed_expression("_nbddp.shard_loader"),
                        args=[first, named, _keyword_arg("data_parallel", cst.Name("True"))])

    def _shard(self, original: cst.Call, updated: cst.Call, depends: bool) -> cst.Call:
        """A training loader with a ``DistributedSampler`` over its dataset, ``shuffle`` moved into it (only
        when ``shuffle`` is true where that is ``depends``: decided at run time)."""
        positional = [a for a in updated.args if a.keyword is None and not a.star]
        dataset_arg = keyword(updated, "dataset") or (positional[0] if positional else None)
        if dataset_arg is None or len(positional) > 2:
            self.note(original, "DataLoader: arguments not understood, left alone (add a DistributedSampler yourself)")
            return updated
        args = list(updated.args)
        dataset = dataset_arg.value
        if not isinstance(dataset, (cst.Name, cst.Attribute, cst.Subscript)):
            # an expression: evaluate it once, name it, and hand the name to the sampler as well
            named = cst.NamedExpr(target=cst.Name("_nbddp_dataset"), value=dataset, lpar=[cst.LeftParen()], rpar=[cst.RightParen()])
            args[args.index(dataset_arg)] = dataset_arg.with_changes(value=named)
            dataset = cst.Name("_nbddp_dataset")
        else:
            dataset = dataset.deep_clone()
        shuffle = keyword(updated, "shuffle")
        shuffle_code = code_of(shuffle.value) if shuffle is not None else "False"
        sampler = f"_nbddp.distributed_sampler({code_of(dataset)}, shuffle={shuffle_code})"
        sampler = cst.parse_expression(f"{sampler} if {shuffle_code} else None" if depends else sampler)
        if shuffle is not None:
            args[args.index(shuffle)] = shuffle.with_changes(keyword=cst.Name("sampler"), value=sampler)
            new = updated.with_changes(args=args)
        else:
            new, _ = set_keyword(updated.with_changes(args=args), "sampler", sampler)
        new = self._data_parallel_batch(original, new)
        if depends:
            self.note(original, f"DataLoader: DistributedSampler when {shuffle_code} (a training loader: each rank "
                                "reads its own share), the whole data set otherwise")
        else:
            self.note(original, f"DataLoader: DistributedSampler(shuffle={shuffle_code}), each rank reads its own share")
        return new

    def _replace_sampler(self, original: cst.Call, updated: cst.Call, plain, targets: list[str]) -> cst.Call:
        """``sampler=RandomSampler(ds)`` → the distributed one, shuffling; ``SequentialSampler(ds)`` too, in
        order, where the loader is a training loader."""
        kind, dataset = plain
        shuffles = PLAIN_SAMPLERS[kind]
        if not shuffles and not loader_shards(False, None, targets, self.facts.train_iterated):
            return updated
        given = keyword(updated, "sampler")
        sampler = cst.parse_expression(f"_nbddp.distributed_sampler({code_of(dataset)}, shuffle={shuffles})")
        args = [a.with_changes(value=sampler) if a is given else a for a in updated.args]
        self.note(original, f"DataLoader: {kind} → DistributedSampler(shuffle={shuffles}), each rank reads its own share")
        return self._data_parallel_batch(original, updated.with_changes(args=args))

    def _data_parallel_batch(self, original: cst.Call, call: cst.Call) -> cst.Call:
        """In a notebook that calls DataParallel, the training loader's ``batch_size`` → each rank's part of it.

        DataParallel split each batch over the kernel's GPUs: a step of ``batch_size`` samples, ``batch_size /
        n`` on each GPU. Each rank taking the whole ``batch_size`` would make a step of ``n`` times the kernel's
        samples and ``n`` times fewer steps: the loss would follow another curve than the kernel's. A loader
        without ``batch_size`` (one sample a step: nothing for DataParallel to split) is left alone."""
        if not self.facts.data_parallel:
            return call
        given = keyword(call, "batch_size")
        positional = [a for a in call.args if a.keyword is None and not a.star]
        arg = given or (positional[1] if len(positional) > 1 else None)
        if arg is None:
            return call
        size = code_of(arg.value)
        wrapped = arg.with_changes(value=cst.parse_expression(f"_nbddp.data_parallel_batch({size})"))
        self.note(original, f"DataLoader: batch_size {size} is the step DataParallel split over the GPUs: each rank "
                            f"takes its part ({size} ÷ ranks), so a step holds the kernel's samples")
        return call.with_changes(args=[wrapped if a is arg else a for a in call.args])


def _keyword_arg(name: str, value: cst.BaseExpression) -> cst.Arg:
    """``name=value``, spaced as a keyword argument is."""
    return cst.Arg(value, keyword=cst.Name(name), equal=cst.AssignEqual(
        whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace("")))


def _plain_sampler(call: cst.Call) -> tuple[str, cst.BaseExpression] | None:
    """(kind, dataset) for ``sampler=RandomSampler(ds)``/``SequentialSampler(ds)`` (``facts.plain_sampler``)."""
    given = keyword(call, "sampler")
    value = given.value if given is not None else None
    if (isinstance(value, cst.Call) and last_name(value.func) in PLAIN_SAMPLERS and len(value.args) == 1
            and value.args[0].keyword is None and not value.args[0].star and not has_keyword(call, "batch_sampler")):
        return last_name(value.func), value.args[0].value
    return None


def _decided_at_run_time(value: cst.BaseExpression) -> bool:
    """A ``shuffle=`` value that is neither a literal nor a call: a parameter or a comparison, read twice safely."""
    if is_name(value, "True", "False", "None") or isinstance(value, (cst.BaseNumber, cst.BaseString)):
        return False
    return not any(isinstance(n, cst.Call) for n in walk(value))
