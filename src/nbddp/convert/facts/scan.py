"""The one walk over each top-level statement that gathers what the facts are decided from."""

from __future__ import annotations

import ast
import functools
from typing import TYPE_CHECKING

from ..ast_helpers import dotted_name, is_dead_if, is_literal, keyword, last_name
from .loaders import loader_name, plain_sampler
from .meters import IMPORTED_NAME, meter_shape
from .models import is_optimizer, is_peft, model_of_parameters
from .own_classes import OwnTraining, own_class, owner_called
from .training import is_trainer_factory, makes_trainer

from .job_facts import Seen

if TYPE_CHECKING:
    from ..code import Statement
    from .job_facts import JobFacts


def scan(stmt: Statement, facts: JobFacts, defs: dict[str, list[ast.Call]], seen: Seen) -> None:
    scan = _Scan(facts, defs, stmt, seen)
    scan.visit_all(stmt.nodes)
    # in source order, outer calls first (the order a libcst walk meets them)
    scan.calls.sort(key=lambda c: (c[0].lineno, c[0].col_offset, -c[0].end_lineno, -c[0].end_col_offset))
    stmt.calls = [c for c, _ in scan.calls]
    stmt.plain_calls = [c for c, in_class in scan.calls if not in_class]


class _Scan:
    """One walk over one top-level statement, gathering everything the facts need from it.

    For the statement itself: the calls it makes (outside function bodies, lambdas and ``if False:``), the
    names it binds and the names it reads (attribute names, keywords and annotations of assignments are not
    reads; a function's parameters and a loop's target are). For the notebook: trainer names, what each
    function calls, the models optimizers get, training loaders, ``torch.cuda.amp`` imports, whether the
    notebook distributes itself. One walk per statement: the facts cost one pass over the notebook's ast.
    """

    def __init__(self, facts: JobFacts, defs: dict[str, list[ast.Call]], stmt: Statement, seen: Seen):
        self.facts, self.defs, self.stmt, self.seen = facts, defs, stmt, seen
        self.calls: list[tuple[ast.Call, bool]] = []  # (call, inside a class body)
        self.binds, self.reads = stmt.binds, stmt.reads
        self._def_stack: list[str] = []
        self._scopes = 0  # inside a function or class body
        self._lambdas = 0

    def visit(self, node: ast.AST) -> None:
        handler = _HANDLERS.get(type(node))
        if handler is not None:
            handler(self, node)
        else:
            self.generic(node)

    def generic(self, node: ast.AST) -> None:
        for name in _child_fields(type(node)):
            value = getattr(node, name)
            if isinstance(value, list):
                for item in value:
                    if isinstance(item, ast.AST):
                        self.visit(item)
            elif isinstance(value, ast.AST):
                self.visit(value)

    def visit_all(self, nodes) -> None:
        for node in nodes:
            if node is not None:
                self.visit(node)

    # -- names
    def bind(self, name: str) -> None:
        if not self._scopes:  # a function's or class's own names are not the notebook's
            self.binds.add(name)

    def target(self, node: ast.AST) -> None:
        if isinstance(node, ast.Name):
            self.bind(node.id)
        elif isinstance(node, (ast.Tuple, ast.List)):
            for el in node.elts:
                self.target(el)
        elif isinstance(node, ast.Starred):
            self.target(node.value)
        else:  # x.attr = …, x[i] = …: x is read
            self.visit(node)

    def visit_Name(self, node: ast.Name) -> None:
        self.reads.add(node.id)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        self.visit(node.value)

    def visit_keyword(self, node: ast.keyword) -> None:
        self.visit(node.value)

    def visit_arg(self, node: ast.arg) -> None:
        self.reads.add(node.arg)
        if node.annotation is not None:
            self.visit(node.annotation)

    def visit_Assign(self, node: ast.Assign) -> None:
        for t in node.targets:
            self.target(t)
        self.visit(node.value)
        if isinstance(node.value, ast.Call):
            targets = [t.id for t in node.targets if isinstance(t, ast.Name)]
            call = node.value
            callee = last_name(call.func)
            if makes_trainer(callee, self.facts) or is_trainer_factory(callee):
                self.facts.trainer_names.update(targets)
            if self.facts.own_classes.get(callee):  # an instance of the notebook's own class that trains
                self.facts.own_instances.update(dict.fromkeys(targets, callee))
            if callee in self.facts.meters or callee == IMPORTED_NAME:  # shapes judged in LoopSumsRule
                self.facts.meter_instances.update(dict.fromkeys(targets, callee))
            if callee == "Accelerator":
                self.facts.accelerators.update(targets)
            if is_optimizer(call):
                self.facts.optimizers.update(targets)
            if callee == "prepare" and isinstance(call.func, ast.Attribute):
                bound = [n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)]
                self.seen.prepared.append((call, bound, self.stmt))
            if callee == "DataLoader":
                own = any(k.arg in ("sampler", "batch_sampler") for k in call.keywords)
                shuffle = keyword(call, "shuffle")
                shuffles = None if shuffle is None else not is_literal(shuffle.value, False, None)
                kind = plain_sampler(call)
                if kind is not None:  # RandomSampler(ds) / SequentialSampler(ds): the distributed one replaces it
                    own, shuffles = False, kind == "RandomSampler" or None
                self.seen.loaders.append((own, shuffles, targets))
            elif targets:
                self.seen.assigned.append((targets, call))

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self.target(node.target)
        if node.value is not None:
            self.visit(node.value)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self.target(node.target)
        self.visit(node.target)
        self.visit(node.value)

    def visit_For(self, node: ast.For) -> None:
        self.target(node.target)
        if (name := loader_name(node.iter)) is not None:
            self.seen.fors.append((name, node))
        self.generic(node)

    def visit_withitem(self, node: ast.withitem) -> None:
        self.visit(node.context_expr)
        if node.optional_vars is not None:
            self.target(node.optional_vars)

    def visit_ExceptHandler(self, node: ast.ExceptHandler) -> None:
        if node.type is not None:
            self.visit(node.type)
        if node.name:
            self.bind(node.name)
        self.visit_all(node.body)

    def visit_NamedExpr(self, node: ast.NamedExpr) -> None:
        self.target(node.target)
        self.generic(node)

    def visit_alias(self, node: ast.alias) -> None:
        if node.name == "*":
            return
        self.bind(node.name.split(".")[0] if node.asname is None else node.asname)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.module is not None:
            self.reads.add(node.module.split(".")[0])
            if node.module == "torch.cuda.amp":
                self.facts.cuda_amp_names.update(a.asname or a.name for a in node.names if a.name != "*")
        self.visit_all(node.names)

    def visit_Global(self, node: ast.Global) -> None:
        self.reads.update(node.names)

    def visit_MatchAs(self, node: ast.MatchAs) -> None:
        if node.name:
            self.reads.add(node.name)
        if node.pattern is not None:
            self.visit(node.pattern)

    def visit_MatchStar(self, node: ast.MatchStar) -> None:
        if node.name:
            self.reads.add(node.name)

    def visit_MatchMapping(self, node: ast.MatchMapping) -> None:
        if node.rest:
            self.reads.add(node.rest)
        self.generic(node)

    def visit_MatchClass(self, node: ast.MatchClass) -> None:
        self.reads.update(node.kwd_attrs)
        self.generic(node)

    # -- blocks
    def visit_If(self, node: ast.If) -> None:
        if not is_dead_if(node):
            self.generic(node)

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        if (training := own_class(node, self.facts.own_classes)) is not None:
            self.facts.own_classes[node.name] = training
        if (shape := meter_shape(node)) is not None:
            self.facts.meters[node.name] = shape
        self.bind(node.name)
        self.reads.add(node.name)
        self._scopes += 1
        self.visit_all(node.decorator_list)
        self.visit_all(node.bases)
        self.visit_all(node.keywords)
        self.visit_all(node.body)
        self._scopes -= 1

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self.bind(node.name)
        self.reads.add(node.name)
        self._scopes += 1
        self._def_stack.append(node.name)
        self.defs.setdefault(node.name, [])
        self.visit_all(node.decorator_list)
        self.visit(node.args)
        if node.returns is not None:
            self.visit(node.returns)
        self.visit_all(node.body)
        self._scopes -= 1
        self._def_stack.pop()

    def visit_Lambda(self, node: ast.Lambda) -> None:
        self._lambdas += 1
        self.generic(node)
        self._lambdas -= 1

    # -- calls
    def visit_Call(self, node: ast.Call) -> None:
        if not self._def_stack and not self._lambdas:
            self.calls.append((node, self._scopes > 0))
        if self._def_stack:  # judged once every trainer's name is known
            self.defs[self._def_stack[-1]].append(node)
        if is_optimizer(node):
            for arg in [*node.args, *(k.value for k in node.keywords)]:
                for call in ast.walk(arg):
                    if isinstance(call, ast.Call) and (found := model_of_parameters(call)) is not None:
                        model, part = found
                        self.facts.ddp_models.add(model)
                        if part:
                            self.facts.trained_parts.setdefault(model, set()).add(part)
        name = dotted_name(node.func) or ""
        if name.endswith(("DistributedDataParallel", "DPDDP")) or name == "DDP":  # DPDDP: Opacus's own
            self.facts.self_distributed = True
        if is_peft(node):
            self.facts.peft = True
        if (owner := owner_called(node, self.facts.own_instances, self.facts.own_classes)) is not None:
            self.facts.own_trainings.append(OwnTraining(self.stmt.cell.position, node.lineno, owner, node.func.attr))
        self.generic(node)


_HANDLERS = {
    getattr(ast, name[len("visit_"):]): method
    for name, method in vars(_Scan).items()
    if name.startswith("visit_") and name != "visit_all"
}
_HANDLERS.update({
    ast.AsyncFunctionDef: _Scan.visit_FunctionDef,
    ast.AsyncFor: _Scan.visit_For,
    ast.Nonlocal: _Scan.visit_Global,
})
#: Fields of ast nodes that hold names, numbers or flags, never nodes; and ``ctx``, a node no fact reads.
_NOT_NODES = frozenset({"ctx", "id", "attr", "arg", "name", "asname", "module", "level", "kind", "type_comment",
                        "is_async", "conversion", "simple", "rest"})


@functools.cache
def _child_fields(kind: type) -> tuple[str, ...]:
    """The fields of an ast node type that may hold nodes (``Constant.value`` never does)."""
    return () if kind is ast.Constant else tuple(f for f in kind._fields if f not in _NOT_NODES)
