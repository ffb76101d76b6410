"""What the rewrite rules need to know about the whole notebook, gathered before any rule runs.

``gather_facts`` walks each top-level statement of every cleaned cell once (``_Scan``) and decides, for the
whole notebook: which names hold trainers, which statements and functions train, which statements after
training run on rank 0 only and which must stay on every rank (collectives, and what they read), which
dataset preparation goes under ``main_process_first``, and, for a plain PyTorch loop, which models DDP wraps
and which loaders get a ``DistributedSampler``. The answers are a ``JobFacts``; the statement sets in it hold
the libcst nodes themselves, so the statement rules act on exactly the statements chosen here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import libcst as cst

_OPTIMIZERS = frozenset(
    "SGD Adam AdamW RMSprop Adagrad Adadelta Adamax NAdam RAdam LBFGS SparseAdam ASGD Rprop Lion Adafactor "
    "AdamW8bit Adam8bit PagedAdamW PagedAdamW8bit".split()
)
#: Calls whose effect a person wants once: saving, pushing, generating, printing, plotting, writing files.
_RANK0_ACTIONS = frozenset(
    "save_pretrained save_model save_state save_lora push_to_hub push_to_hub_merged push_to_hub_gguf "
    "save_pretrained_merged save_pretrained_gguf generate fast_generate print pprint display savefig show "
    "imshow plot to_csv to_json to_parquet save".split()
)
#: Trainer methods every rank must call together under DDP.
_TRAINER_COLLECTIVES = frozenset({"train", "evaluate", "predict", "fit"})
#: Calls that read or write shared caches and downloads: dataset preparation.
_DATA_PREP = frozenset(
    "load_dataset map filter snapshot_download hf_hub_download dataset_download competition_download".split()
)
#: Runtime calls with barriers inside: they must run on every rank.
_RUNTIME_COLLECTIVES = frozenset({"shell", "write_file", "main_process_first"})


# --------------------------------------------------------------------------------------------- names


def dotted_name(node: cst.BaseExpression) -> str | None:
    """``a.b.C`` for a Name/Attribute chain, else None."""
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        base = dotted_name(node.value)
        return f"{base}.{node.attr.value}" if base else None
    return None


def last_name(node: cst.BaseExpression) -> str | None:
    """The last part of a call's name: ``AutoModel`` for ``transformers.AutoModel``, ``train`` for ``t.train``."""
    if isinstance(node, cst.Attribute):
        return node.attr.value
    if isinstance(node, cst.Name):
        return node.value
    return None


def is_name(node: cst.CSTNode | None, *values: str) -> bool:
    """A ``Name`` node, with one of ``values`` when given."""
    return isinstance(node, cst.Name) and (not values or node.value in values)


def is_attribute(node: cst.CSTNode | None, *attrs: str) -> bool:
    """An ``owner.attr`` node, with ``attr`` one of ``attrs`` when given."""
    return isinstance(node, cst.Attribute) and (not attrs or node.attr.value in attrs)


def is_trainer_class(name: str | None) -> bool:
    return bool(name) and name.endswith("Trainer")


def is_dead_if(node: cst.CSTNode) -> bool:
    """``if False:`` / ``if 0:``: code a notebook keeps switched off."""
    if not isinstance(node, cst.If):
        return False
    return is_name(node.test, "False") or isinstance(node.test, cst.Integer) and node.test.value == "0"


def keyword(call: cst.Call, key: str) -> cst.Arg | None:
    return next((a for a in call.args if a.keyword is not None and a.keyword.value == key), None)


def has_keyword(call: cst.Call, key: str) -> bool:
    return keyword(call, key) is not None


def code_of(node: cst.CSTNode) -> str:
    return cst.Module([]).code_for_node(node)


# ----------------------------------------------------------------------------------------- walking


class _Calls(cst.CSTVisitor):
    """Every call under a node, outside ``if False:`` blocks; function and class bodies only when asked."""

    def __init__(self, into_defs: bool):
        self.into_defs, self.found = into_defs, []

    def visit_Call(self, node: cst.Call) -> None:
        self.found.append(node)

    def visit_If(self, node: cst.If) -> bool:
        return not is_dead_if(node)

    def visit_FunctionDef(self, node) -> bool:
        return self.into_defs

    def visit_ClassDef(self, node) -> bool:
        return self.into_defs

    def visit_Lambda(self, node) -> bool:
        return self.into_defs


def calls_in(node: cst.CSTNode, into_defs: bool = False) -> list[cst.Call]:
    v = _Calls(into_defs)
    node.visit(v)
    return v.found


# ------------------------------------------------------------------------------------------- facts


@dataclass
class JobFacts:
    """What the rules need to know about the whole notebook, gathered by ``gather_facts``.

    The statement sets hold the top-level statement nodes of the modules the facts were gathered from.
    """

    trainer_names: set[str] = field(default_factory=set)
    #: functions whose body trains (``loss.backward()``, ``trainer.train()``, or a call to another such function)
    training_functions: set[str] = field(default_factory=set)
    #: functions whose body makes a call every rank must make (training, ``trainer.evaluate()``, …)
    collective_functions: set[str] = field(default_factory=set)
    #: plain PyTorch: names whose parameters an optimizer gets (the models DDP wraps)
    ddp_models: set[str] = field(default_factory=set)
    #: plain PyTorch: names bound to a DataLoader that gets a DistributedSampler
    sharded_loaders: set[str] = field(default_factory=set)
    #: names imported from ``torch.cuda.amp`` (``autocast``, ``GradScaler``)
    cuda_amp_names: set[str] = field(default_factory=set)
    #: the notebook distributes itself (Accelerate, its own DistributedDataParallel)
    self_distributed: bool = False
    #: a plain PyTorch loop (backward in the notebook's own code, no HF/TRL/Lightning trainer)
    plain_loop: bool = False
    #: top-level statements that train, in notebook order
    training: list[cst.BaseStatement] = field(default_factory=list)
    #: top-level statements after the first training call that run on rank 0 only
    rank0: set[cst.BaseStatement] = field(default_factory=set)
    #: rank-0 statements after the last training call (the tail), a subset of ``rank0``
    tail: set[cst.BaseStatement] = field(default_factory=set)
    #: statements after training that stay on every rank, with the reason (said in --explain)
    all_ranks: dict[cst.BaseStatement, str] = field(default_factory=dict)
    #: names the notebook's top-level code binds (not functions' or classes' own names)
    module_names: set[str] = field(default_factory=set)
    #: top-level dataset preparation run under ``main_process_first``
    main_first: set[cst.BaseStatement] = field(default_factory=set)
    #: top-level statement → model names wrapped in DDP right after it
    ddp_wrap_after: dict[cst.BaseStatement, list[str]] = field(default_factory=dict)

    @property
    def last_training(self) -> cst.BaseStatement | None:
        return self.training[-1] if self.training else None


def is_training_call(node: cst.Call, facts: JobFacts) -> bool:
    """``trainer.train()`` on a known trainer, ``SomeTrainer(...).train()``, ``unsloth_train(trainer)``,
    ``loss.backward()``, or a call to a function of the notebook that trains."""
    func = node.func
    if isinstance(func, cst.Attribute):
        owner, attr = func.value, func.attr.value
        if attr == "backward":
            return True
        if attr in ("train", "fit"):
            if isinstance(owner, cst.Name) and owner.value in facts.trainer_names:
                return True
            return isinstance(owner, cst.Call) and is_trainer_class(last_name(owner.func))
        return False
    return isinstance(func, cst.Name) and (func.value == "unsloth_train" or func.value in facts.training_functions)


def is_collective_call(node: cst.Call, facts: JobFacts) -> bool:
    """A call every rank must make together: training, ``trainer.evaluate()``/``predict()``, collectives of
    ``torch.distributed`` or Accelerate, and the runtime helpers with barriers inside."""
    if is_training_call(node, facts):
        return True
    name = dotted_name(node.func) or ""
    head, _, attr = name.rpartition(".")
    if head in facts.trainer_names and attr in _TRAINER_COLLECTIVES:
        return True
    if head == "_nbddp" and attr in _RUNTIME_COLLECTIVES:
        return True
    if isinstance(node.func, cst.Name) and node.func.value in facts.collective_functions:
        return True
    return name.startswith(("dist.", "torch.distributed.", "accelerator."))


def is_training_statement(stmt: cst.CSTNode, facts: JobFacts) -> bool:
    return any(is_training_call(c, facts) for c in calls_in(stmt))


def _is_rank0_action(call: cst.Call) -> bool:
    name = dotted_name(call.func) or ""
    return last_name(call.func) in _RANK0_ACTIONS or name.startswith(("plt.", "sns."))


def _is_data_prep(call: cst.Call) -> bool:
    name = last_name(call.func)
    if name in ("map", "filter"):
        return isinstance(call.func, cst.Attribute)  # dataset.map(…), not the builtins
    return name in _DATA_PREP or (name or "").startswith("from_") and "Dataset" in (dotted_name(call.func) or "")


def _is_optimizer(call: cst.Call) -> bool:
    name = dotted_name(call.func) or ""
    return last_name(call.func) in _OPTIMIZERS or name.startswith(("torch.optim.", "optim."))


class _Scan(cst.CSTVisitor):
    """One walk over one top-level statement, gathering everything the facts need from it.

    For the statement itself: the calls it makes (outside function bodies, lambdas and ``if False:``), the
    names it binds and the names it reads (attribute names and keywords are not reads). For the notebook:
    trainer names, what each function calls, the models optimizers get, training loaders, ``torch.cuda.amp``
    imports, whether the notebook distributes itself. One walk, because libcst walks are what conversion
    time is spent on.
    """

    def __init__(self, facts: JobFacts, defs: dict[str, list[cst.Call]]):
        self.facts, self.defs = facts, defs
        self.calls: list[cst.Call] = []
        self.binds: set[str] = set()
        self.reads: set[str] = set()
        self._def_stack: list[str] = []
        self._scopes = 0  # inside a function or class body
        self._lambdas = 0

    # -- names
    def target(self, node: cst.BaseExpression) -> None:
        if isinstance(node, cst.Name):
            if not self._scopes:  # a function's or class's own names are not the notebook's
                self.binds.add(node.value)
        elif isinstance(node, (cst.Tuple, cst.List)):
            for el in node.elements:
                self.target(el.value)
        elif isinstance(node, cst.StarredElement):
            self.target(node.value)
        else:  # x.attr = …, x[i] = …: x is read
            node.visit(self)

    def visit_Name(self, node: cst.Name) -> None:
        self.reads.add(node.value)

    def visit_Attribute(self, node: cst.Attribute) -> bool:
        node.value.visit(self)
        return False

    def visit_Arg(self, node: cst.Arg) -> bool:
        node.value.visit(self)
        return False

    def visit_Assign(self, node: cst.Assign) -> bool:
        for t in node.targets:
            self.target(t.target)
        node.value.visit(self)
        if isinstance(node.value, cst.Call):
            targets = [t.target.value for t in node.targets if isinstance(t.target, cst.Name)]
            callee = last_name(node.value.func)
            if is_trainer_class(callee):
                self.facts.trainer_names.update(targets)
            if callee == "DataLoader" and loader_shards(node.value, targets):
                self.facts.sharded_loaders.update(targets)
        return False

    def visit_AnnAssign(self, node: cst.AnnAssign) -> bool:
        self.target(node.target)
        if node.value is not None:
            node.value.visit(self)
        return False

    def visit_AugAssign(self, node: cst.AugAssign) -> None:
        self.target(node.target)

    def visit_For(self, node: cst.For) -> None:
        self.target(node.target)

    def visit_AsName(self, node: cst.AsName) -> bool:
        self.target(node.name)
        return False

    def visit_NamedExpr(self, node: cst.NamedExpr) -> None:
        self.target(node.target)

    def visit_ClassDef(self, node: cst.ClassDef) -> None:
        if not self._scopes:
            self.binds.add(node.name.value)
        self._scopes += 1

    def leave_ClassDef(self, node: cst.ClassDef) -> None:
        self._scopes -= 1

    def visit_ImportAlias(self, node: cst.ImportAlias) -> bool:
        if node.asname is None:
            if not self._scopes:
                self.binds.add((dotted_name(node.name) or "").split(".")[0])
        else:
            self.target(node.asname.name)
        return False

    def visit_ImportFrom(self, node: cst.ImportFrom) -> None:
        if node.module is not None and dotted_name(node.module) == "torch.cuda.amp" and not isinstance(node.names, cst.ImportStar):
            for alias in node.names:
                self.facts.cuda_amp_names.add((alias.asname.name if alias.asname else alias.name).value)

    # -- blocks
    def visit_If(self, node: cst.If) -> bool:
        return not is_dead_if(node)

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        if not self._scopes:
            self.binds.add(node.name.value)
        self._scopes += 1
        self._def_stack.append(node.name.value)
        self.defs.setdefault(node.name.value, [])

    def leave_FunctionDef(self, node: cst.FunctionDef) -> None:
        self._scopes -= 1
        self._def_stack.pop()

    def visit_Lambda(self, node: cst.Lambda) -> None:
        self._lambdas += 1

    def leave_Lambda(self, node: cst.Lambda) -> None:
        self._lambdas -= 1

    # -- calls
    def visit_Call(self, node: cst.Call) -> None:
        if not self._def_stack and not self._lambdas:
            self.calls.append(node)
        if self._def_stack:  # judged once every trainer's name is known
            self.defs[self._def_stack[-1]].append(node)
        if _is_optimizer(node):
            for arg in node.args:
                for call in calls_in(arg, into_defs=True) + ([arg.value] if isinstance(arg.value, cst.Call) else []):
                    if is_attribute(call.func, "parameters", "named_parameters") and is_name(call.func.value):
                        self.facts.ddp_models.add(call.func.value.value)
        name = dotted_name(node.func) or ""
        if name.endswith(("DistributedDataParallel", "Accelerator")) or name == "DDP":
            self.facts.self_distributed = True


def loader_shards(call: cst.Call, targets: list[str]) -> bool:
    """Whether a ``DataLoader`` gets a ``DistributedSampler``: it shuffles, or it is named as a training loader.

    Loaders that neither shuffle nor say "train" (validation, test) stay whole on every rank, so metrics
    computed from them are the full data set's.
    """
    if has_keyword(call, "sampler") or has_keyword(call, "batch_sampler"):
        return False
    shuffle = keyword(call, "shuffle")
    if shuffle is not None and not is_name(shuffle.value, "False", "None"):
        return True
    return any("train" in t.lower() for t in targets)


def gather_facts(modules: list[cst.Module]) -> JobFacts:
    """Look at every cell once and decide what the statement rules do."""
    facts = JobFacts()
    defs: dict[str, list[cst.Call]] = {}  # function name → the calls in its body
    top: list[cst.BaseStatement] = []
    scans: list[_Scan] = []
    for module in modules:
        for stmt in module.body:
            scan = _Scan(facts, defs)
            stmt.visit(scan)
            top.append(stmt)
            scans.append(scan)
    facts.module_names = set().union(*(scan.binds for scan in scans))
    # a function trains if it trains directly or calls one that does; likewise for collectives
    changed = True
    while changed:
        changed = False
        for name, calls in defs.items():
            if name not in facts.training_functions and any(is_training_call(c, facts) for c in calls):
                facts.training_functions.add(name)
                changed = True
            if name not in facts.collective_functions and any(is_collective_call(c, facts) for c in calls):
                facts.collective_functions.add(name)
                changed = True

    trains = [any(is_training_call(c, facts) for c in scan.calls) for scan in scans]
    facts.training = [s for s, t in zip(top, trains) if t]
    if not facts.training:
        return facts
    facts.plain_loop = not facts.trainer_names and not facts.self_distributed and any(
        last_name(c.func) == "backward" or last_name(c.func) in facts.training_functions
        for scan, t in zip(scans, trains) if t for c in scan.calls
    )
    first, last = trains.index(True), len(trains) - 1 - trains[::-1].index(True)
    _plan_after_training(top, scans, first, last, facts)
    _plan_data_prep(top, scans, facts)
    if facts.plain_loop:
        for name in sorted(facts.ddp_models):
            at = placement(top[:first], name)
            if at is not None:
                facts.ddp_wrap_after.setdefault(at, []).append(name)
    return facts


def _plan_after_training(top: list[cst.BaseStatement], scans: list[_Scan], first: int, last: int, facts: JobFacts) -> None:
    """Which statements after the first training call run on rank 0 only.

    After the last training call everything does, except what every rank must run (a collective such as
    ``trainer.evaluate()``) and what binds a name such code reads. Between two training calls only
    statements that save, push, generate, print or plot do (with the same exceptions): the rest prepares
    the next training, which every rank runs. Read backwards, so a name a later all-rank statement needs is
    known when the statement binding it is reached.
    """
    needed: set[str] = set()
    for k in range(len(top) - 1, first, -1):
        stmt, scan = top[k], scans[k]
        collective = next((c for c in scan.calls if is_collective_call(c, facts)), None)
        if collective is not None:
            reason = f"{code_of(collective.func)}() needs every rank"
        elif scan.binds & needed:
            reason = f"binds {', '.join(sorted(scan.binds & needed))}, which code on every rank uses"
        else:
            reason = None
        if reason is None and (k > last or any(_is_rank0_action(c) for c in scan.calls)):
            facts.rank0.add(stmt)
            if k > last:
                facts.tail.add(stmt)
            continue
        if k > last:
            facts.all_ranks[stmt] = reason
        needed |= scan.reads


def _plan_data_prep(top: list[cst.BaseStatement], scans: list[_Scan], facts: JobFacts) -> None:
    """Dataset preparation on every rank goes under ``main_process_first`` (cache files are not raced)."""
    for stmt, scan in zip(top, scans):
        if stmt in facts.rank0 or stmt in facts.training or isinstance(stmt, (cst.FunctionDef, cst.ClassDef)):
            continue
        if is_dead_if(stmt):
            continue
        if any(_is_data_prep(c) for c in scan.calls) and not any(is_collective_call(c, facts) for c in scan.calls):
            facts.main_first.add(stmt)


def _places(stmt: cst.CSTNode, name: str) -> bool:
    """``name = …`` or ``name.to(…)`` / ``name.cuda()``: the statement makes the model or moves it."""
    if not isinstance(stmt, cst.SimpleStatementLine):
        return False
    for small in stmt.body:
        if isinstance(small, cst.Assign) and any(is_name(t.target, name) for t in small.targets):
            return True
        if isinstance(small, cst.Expr) and isinstance(small.value, cst.Call):
            func = small.value.func
            if is_attribute(func, "to", "cuda") and is_name(func.value, name):
                return True
    return False


def placement(stmts: list[cst.BaseStatement], name: str) -> cst.BaseStatement | None:
    """The last statement that makes or moves model ``name``: DDP wraps it right after."""
    return next((s for s in reversed(stmts) if _places(s, name)), None)
