"""What the rewrite rules need to know about the whole notebook, gathered with Python's ``ast`` before any rule runs.

A cleaned cell is read into a ``CellCode``: its ``ast`` tree and its top-level ``Statement``s, counted the
way libcst counts them (a compound statement, or one line of simple statements: ``a = 1; b = 2`` is one).
``gather_facts`` walks each top-level statement of every cell once (``_Scan``) and decides, for the whole
notebook: which names hold trainers, which statements and functions train, which statements after training
run on rank 0 only and which must stay on every rank (collectives, and what they read), which dataset
preparation goes under ``main_process_first``, and, for a plain PyTorch loop, which models DDP wraps (and
where) and which loaders get a ``DistributedSampler``. The answers are a ``JobFacts``; its statement sets
hold ``Statement``s, and the rules act on exactly the statements chosen here.

The facts come from CPython's own parser (a few milliseconds for a whole notebook) rather than from libcst,
which the rules use only where they rewrite something. The walk reads the code the way a libcst walk would
(which names a statement binds and reads, which calls it makes): the rules' choices do not depend on which
parser gathered them.
"""

from __future__ import annotations

import ast
import functools
import re
from dataclasses import dataclass, field
from functools import cached_property

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
#: Calls that write files another rank may read, and calls that read files.
_WRITES = frozenset("save_pretrained save_model to_csv to_json to_parquet save_to_disk save_file".split())
_READS = frozenset(
    "from_pretrained load read_csv read_json read_parquet read_pickle load_from_disk load_dataset load_file "
    "safe_open open".split()
)
#: Trainer methods every rank must call together under DDP.
_TRAINER_COLLECTIVES = frozenset({"train", "evaluate", "predict", "fit"})
#: Calls that read or write shared caches and downloads: dataset preparation.
_DATA_PREP = frozenset(
    "load_dataset map filter snapshot_download hf_hub_download dataset_download competition_download".split()
)
#: Runtime calls with barriers inside: they must run on every rank.
_RUNTIME_COLLECTIVES = frozenset({"shell", "shell_cell", "write_file", "main_process_first"})
#: Words in a ``from_pretrained`` owner that say it is not a model.
_NOT_MODELS = ("Tokenizer", "Processor", "Config", "FeatureExtractor", "ImageProcessor", "Dataset")
#: Trainer configurations ``TrainerConfigRule`` completes.
TRAINER_CONFIGS = frozenset(
    {"TrainingArguments", "Seq2SeqTrainingArguments", "UnslothTrainingArguments"}
    | {
        f"{p}Config"
        for p in "SFT DPO GRPO ORPO KTO CPO BCO PPO RLOO Reward PRM GKD OnlineDPO XPO Nash Unsloth".split()
    }
)
#: An explicit GPU: ``"cuda:0"``.
CUDA_INDEX = re.compile(r"^cuda:\d+$")

_COMPOUND = (ast.If, ast.For, ast.AsyncFor, ast.While, ast.Try, ast.TryStar, ast.With, ast.AsyncWith,
             ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Match)
_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


# ------------------------------------------------------------------------------------ name decisions
# What a rule decides from names alone; the ast checks and the libcst rules both ask these.


def is_trainer_class(name: str | None) -> bool:
    return bool(name) and name.endswith("Trainer")


#: A helper's name that says it returns a trainer: ``create_trainer``, ``get_trainer``, ``build_sft_trainer``.
_TRAINER_FACTORY = re.compile(r"^(?:get|create|build|make|setup|set_up|init|prepare|new)_?\w*trainer$", re.I)


def is_trainer_factory(name: str | None) -> bool:
    return bool(name) and _TRAINER_FACTORY.match(name) is not None


def is_model_loader_owner(owner: str | None) -> bool:
    """Whether ``owner.from_pretrained(…)`` loads a model (not a tokenizer, processor or config).

    Covers ``AutoModel*``, ``*For*`` (``LlamaForCausalLM``), ``AutoPeftModel*``, ``PeftModel`` and Unsloth's
    ``FastLanguageModel``/``FastModel``/``FastVisionModel``.
    """
    if not owner or any(word in owner for word in _NOT_MODELS):
        return False
    return "Model" in owner or "For" in owner or owner.startswith(("Auto", "Fast", "Peft"))


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


# --------------------------------------------------------------------------------------- ast helpers


def dotted_name(node: ast.AST) -> str | None:
    """``a.b.C`` for a Name/Attribute chain, else None."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = dotted_name(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


def last_name(node: ast.AST) -> str | None:
    """The last part of a call's name: ``AutoModel`` for ``transformers.AutoModel``, ``train`` for ``t.train``."""
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Name):
        return node.id
    return None


def is_dead_if(node: ast.AST) -> bool:
    """``if False:`` / ``if 0:``: code a notebook keeps switched off."""
    if not isinstance(node, ast.If) or not isinstance(node.test, ast.Constant):
        return False
    value = node.test.value
    # ``0`` written as such (libcst's Integer("0")), not ``00`` or ``0x0``
    return value is False or type(value) is int and value == 0 and node.test.end_col_offset - node.test.col_offset == 1


#: Samplers a ``DistributedSampler`` stands in for: (shuffles).
PLAIN_SAMPLERS = {"RandomSampler": True, "SequentialSampler": False}


def plain_sampler(call: ast.Call) -> str | None:
    """``RandomSampler``/``SequentialSampler`` when a DataLoader's ``sampler=`` is ``X(dataset)`` of one."""
    given = keyword(call, "sampler")
    value = given.value if given is not None else None
    if isinstance(value, ast.Call) and last_name(value.func) in PLAIN_SAMPLERS and len(value.args) == 1 \
            and not value.keywords and keyword(call, "batch_sampler") is None:
        return last_name(value.func)
    return None


def keyword(call: ast.Call, key: str) -> ast.keyword | None:
    return next((k for k in call.keywords if k.arg == key), None)


def is_compound(node: ast.stmt) -> bool:
    return isinstance(node, _COMPOUND)


def _is_literal(node: ast.AST, *values) -> bool:
    return isinstance(node, ast.Constant) and any(node.value is v for v in values)


# ------------------------------------------------------------------------------------ cells, statements


@dataclass(eq=False)
class Statement:
    """One top-level statement of a cleaned cell, as libcst counts statements.

    ``nodes`` are its ast statements (several for ``a = 1; b = 2``), ``first`` its first line in the cell (a
    decorator's line for a decorated definition). The rest is filled in by ``gather_facts``.
    """

    cell: CellCode
    index: int
    nodes: list[ast.stmt]
    first: int
    #: the calls it makes itself (outside function bodies, lambdas and ``if False:``), in source order
    calls: list[ast.Call] = field(default_factory=list)
    #: those of ``calls`` that are not inside a class body either
    plain_calls: list[ast.Call] = field(default_factory=list)
    #: names it binds at the notebook's top level, and names it reads (attributes and keywords are not reads)
    binds: set[str] = field(default_factory=set)
    reads: set[str] = field(default_factory=set)

    @cached_property
    def text(self) -> str:
        """Its source, with the comments and blank lines up to the next statement."""
        statements = self.cell.statements
        end = statements[self.index + 1].first - 1 if self.index + 1 < len(statements) else len(self.cell.lines)
        return "".join(self.cell.lines[self.first - 1 : end])

    def __repr__(self) -> str:
        return f"<Statement {self.index} of cell {self.cell.position}, line {self.first}>"


@dataclass(eq=False)
class CellCode:
    """A cleaned cell's code, its ast and its top-level statements: what the facts and the rules work on."""

    code: str
    tree: ast.Module
    #: the cell's place among the converted cells (0-based)
    position: int = 0
    statements: list[Statement] = field(default_factory=list)

    @classmethod
    def read(cls, code: str, tree: ast.Module | None = None, position: int = 0) -> CellCode:
        """Read cleaned code (already parsed into ``tree`` when the caller has it)."""
        cell = cls(code, tree if tree is not None else ast.parse(code), position)
        cell.statements = [
            Statement(cell, i, group, _first_line(group[0])) for i, group in enumerate(group_lines(cell.tree.body, cell))
        ]
        return cell

    @cached_property
    def lines(self) -> list[str]:
        return self.code.splitlines(keepends=True)

    @cached_property
    def default_indent(self) -> str:
        """The indentation of the cell's first indented block, as libcst detects it ("    " without one).

        A statement parsed on its own with libcst would otherwise guess its own, and a block a rule adds would
        be indented differently from the rest of the cell.
        """
        first = None  # the first line that starts an indented block: a statement's, or a ``case``'s
        for node in _statements(self.tree.body):
            if isinstance(node, ast.Match):
                line, col = node.cases[0].pattern.lineno, None
            elif node.col_offset:
                line, col = node.lineno, node.col_offset
            else:
                continue
            if first is None or line < first:
                text = self.lines[line - 1]
                if col is None or len(text.encode()) - len(text.lstrip().encode()) == col:
                    first = line
        if first is None:
            return "    "
        text = self.lines[first - 1]
        return text[: len(text) - len(text.lstrip())]

    def source(self, node: ast.AST) -> str:
        if node.lineno == node.end_lineno:  # ast's own way splits the whole cell into lines each time
            return self.line_bytes(node.lineno)[node.col_offset : node.end_col_offset].decode()
        return ast.get_source_segment(self.code, node) or ""

    def line_bytes(self, line: int) -> bytes:
        return self.lines[line - 1].encode()


def compound_bodies(node: ast.stmt) -> list[list[ast.stmt]]:
    """The statement lists of a compound statement: its body, ``else``, ``finally``, handlers and cases."""
    bodies = [getattr(node, name, None) or [] for name in ("body", "orelse", "finalbody")]
    return bodies + [h.body for h in getattr(node, "handlers", ())] + [c.body for c in getattr(node, "cases", ())]


def _statements(body: list[ast.stmt]):
    """Every statement in a block, nested ones included (not those inside expressions: there are none)."""
    for node in body:
        yield node
        if is_compound(node):
            for inner in compound_bodies(node):
                yield from _statements(inner)


def _first_line(node: ast.stmt) -> int:
    decorators = getattr(node, "decorator_list", None)
    return decorators[0].lineno if decorators else node.lineno


def group_lines(body: list[ast.stmt], cell: CellCode) -> list[list[ast.stmt]]:
    """The statements of a block as libcst counts them: simple statements on one logical line are one."""
    groups: list[list[ast.stmt]] = []
    for node in body:
        if groups and not is_compound(node) and not is_compound(groups[-1][-1]) and _same_line(groups[-1][-1], node, cell):
            groups[-1].append(node)
        else:
            groups.append([node])
    return groups


def _same_line(before: ast.stmt, after: ast.stmt, cell: CellCode) -> bool:
    """Whether ``after`` follows ``before`` on its logical line (``a = 1; b = 2``)."""
    if after.lineno != before.end_lineno and not cell.lines[before.end_lineno - 1].rstrip().endswith("\\"):
        return False
    between = b"".join(cell.line_bytes(n) for n in range(before.end_lineno, after.lineno + 1))
    start = before.end_col_offset
    end = len(between) - len(cell.line_bytes(after.lineno)) + after.col_offset
    return b";" in re.sub(rb"#[^\n]*", b"", between[start:end])


# ------------------------------------------------------------------------------------------- facts


@dataclass
class JobFacts:
    """What the rules need to know about the whole notebook, gathered by ``gather_facts``."""

    trainer_names: set[str] = field(default_factory=set)
    #: functions whose body trains (``loss.backward()``, ``trainer.train()``, or a call to another such function)
    training_functions: set[str] = field(default_factory=set)
    #: functions whose body makes a call every rank must make (training, ``trainer.evaluate()``, …)
    collective_functions: set[str] = field(default_factory=set)
    #: plain PyTorch: names whose parameters an optimizer gets (the models DDP wraps)
    ddp_models: set[str] = field(default_factory=set)
    #: plain PyTorch: names bound to a DataLoader that gets a DistributedSampler
    sharded_loaders: set[str] = field(default_factory=set)
    #: plain PyTorch: training loaders a helper of the notebook's imports returns (``create_dataloader(…)``)
    helper_loaders: set[str] = field(default_factory=set)
    #: plain PyTorch: names bound only to a DataLoader that keeps its whole data set on every rank (evaluation)
    whole_loaders: set[str] = field(default_factory=set)
    #: plain PyTorch: names a training loop iterates (``for batch in name``): training loaders, whatever their name
    train_iterated: set[str] = field(default_factory=set)
    #: names imported from ``torch.cuda.amp`` (``autocast``, ``GradScaler``)
    cuda_amp_names: set[str] = field(default_factory=set)
    #: the notebook distributes itself (its own DistributedDataParallel)
    self_distributed: bool = False
    #: names bound to ``Accelerator()``, and the names handed to or bound by their ``prepare(…)``: Accelerate
    #: wraps and shards those; plain loops elsewhere in the notebook are still nbddp's
    accelerators: set[str] = field(default_factory=set)
    accelerate_prepared: set[str] = field(default_factory=set)
    #: the notebook trains a PEFT adapter (``get_peft_model``, a trainer's ``peft_config=``, a PEFT loader):
    #: every trainable weight takes part in each step, so DDP need not look for unused ones
    peft: bool = False
    #: a plain PyTorch loop (backward in the notebook's own code, no HF/TRL/Lightning trainer)
    plain_loop: bool = False
    #: top-level statements that train, in notebook order
    training: list[Statement] = field(default_factory=list)
    #: plain PyTorch: top-level statements that train outside function and class bodies (the training loops)
    loops: set[Statement] = field(default_factory=set)
    #: top-level statements after the first training call that run on rank 0 only
    rank0: set[Statement] = field(default_factory=set)
    #: rank-0 statements before the first training call that write files a later statement reads: the other
    #: ranks wait for them (a barrier after), a subset of ``rank0``
    shared_saves: set[Statement] = field(default_factory=set)
    #: rank-0 statements after the last training call (the tail), a subset of ``rank0``
    tail: set[Statement] = field(default_factory=set)
    #: statements after training that stay on every rank, with the reason (said in --explain)
    all_ranks: dict[Statement, str] = field(default_factory=dict)
    #: names the notebook's top-level code binds (not functions' or classes' own names)
    module_names: set[str] = field(default_factory=set)
    #: top-level dataset preparation run under ``main_process_first``
    main_first: set[Statement] = field(default_factory=set)
    #: top-level statement → model names wrapped in DDP right after it
    ddp_wrap_after: dict[Statement, list[str]] = field(default_factory=dict)
    #: plain PyTorch, inside a function or loop that builds and trains: (cell position, line of the statement
    #: that makes or moves the model) → model names wrapped in DDP right after it
    ddp_wrap_inside: dict[tuple[int, int], list[str]] = field(default_factory=dict)
    #: top-level statements holding a statement of ``ddp_wrap_inside``
    ddp_wraps_inside: set[Statement] = field(default_factory=set)

    @property
    def last_training(self) -> Statement | None:
        return self.training[-1] if self.training else None


def is_training_call(node: ast.Call, facts: JobFacts) -> bool:
    """``trainer.train()`` on a known trainer, ``SomeTrainer(...).train()``, ``unsloth_train(trainer)``,
    ``loss.backward()``, or a call to a function of the notebook that trains."""
    func = node.func
    if isinstance(func, ast.Attribute):
        owner, attr = func.value, func.attr
        if attr == "backward":
            return True
        if attr in ("train", "fit"):
            if isinstance(owner, ast.Name) and owner.id in facts.trainer_names:
                return True
            return isinstance(owner, ast.Call) and is_trainer_class(last_name(owner.func))
        return False
    if isinstance(func, ast.Name) and func.id == "notebook_launcher":
        return _launches(node, facts)
    return isinstance(func, ast.Name) and (func.id == "unsloth_train" or func.id in facts.training_functions)


def is_collective_call(node: ast.Call, facts: JobFacts) -> bool:
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
    if isinstance(node.func, ast.Name) and node.func.id in facts.collective_functions:
        return True
    return name.startswith(("dist.", "torch.distributed.", "accelerator."))


def _is_rank0_action(call: ast.Call) -> bool:
    name = dotted_name(call.func) or ""
    return last_name(call.func) in _RANK0_ACTIONS or name.startswith(("plt.", "sns."))


def _is_data_prep(call: ast.Call) -> bool:
    name = last_name(call.func)
    if name in ("map", "filter"):
        return isinstance(call.func, ast.Attribute)  # dataset.map(…), not the builtins
    return name in _DATA_PREP or (name or "").startswith("from_") and "Dataset" in (dotted_name(call.func) or "")


def _is_peft(call: ast.Call) -> bool:
    """``get_peft_model(…)``, ``PeftModel.from_pretrained(…)``/``AutoPeftModel….from_pretrained(…)``, or a
    trainer given ``peft_config=``."""
    name = last_name(call.func)
    if name == "get_peft_model":
        return True
    if name == "from_pretrained" and isinstance(call.func, ast.Attribute):
        return (last_name(call.func.value) or "").startswith(("Peft", "AutoPeft"))
    return is_trainer_class(name) and keyword(call, "peft_config") is not None


def _is_optimizer(call: ast.Call) -> bool:
    name = dotted_name(call.func) or ""
    return last_name(call.func) in _OPTIMIZERS or name.startswith(("torch.optim.", "optim."))


def _model_of_parameters(call: ast.Call) -> str | None:
    """``model`` for ``model.parameters()`` / ``model.named_parameters()``."""
    func = call.func
    if isinstance(func, ast.Attribute) and func.attr in ("parameters", "named_parameters") and isinstance(func.value, ast.Name):
        return func.value.id
    return None


class _Scan:
    """One walk over one top-level statement, gathering everything the facts need from it.

    For the statement itself: the calls it makes (outside function bodies, lambdas and ``if False:``), the
    names it binds and the names it reads (attribute names, keywords and annotations of assignments are not
    reads; a function's parameters and a loop's target are). For the notebook: trainer names, what each
    function calls, the models optimizers get, training loaders, ``torch.cuda.amp`` imports, whether the
    notebook distributes itself. One walk per statement: the facts cost one pass over the notebook's ast.
    """

    def __init__(self, facts: JobFacts, defs: dict[str, list[ast.Call]], stmt: Statement, seen: _Seen):
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
            if is_trainer_class(callee) or is_trainer_factory(callee):
                self.facts.trainer_names.update(targets)
            if callee == "Accelerator":
                self.facts.accelerators.update(targets)
            if callee == "prepare" and isinstance(call.func, ast.Attribute):
                self.seen.prepared.append((call, [n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)]))
            if callee == "DataLoader":
                own = any(k.arg in ("sampler", "batch_sampler") for k in call.keywords)
                shuffle = keyword(call, "shuffle")
                shuffles = None if shuffle is None else not _is_literal(shuffle.value, False, None)
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
        if _is_optimizer(node):
            for arg in [*node.args, *(k.value for k in node.keywords)]:
                for call in ast.walk(arg):
                    if isinstance(call, ast.Call) and (model := _model_of_parameters(call)) is not None:
                        self.facts.ddp_models.add(model)
        name = dotted_name(node.func) or ""
        if name.endswith("DistributedDataParallel") or name == "DDP":
            self.facts.self_distributed = True
        if _is_peft(node):
            self.facts.peft = True
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


@dataclass
class _Seen:
    """What the scan met that is judged once the training functions are known."""

    #: ``DataLoader(…)`` assignments: (own sampler, shuffles, target names)
    loaders: list = field(default_factory=list)
    #: ``names = function(…)``: (target names, the call)
    assigned: list = field(default_factory=list)
    #: ``for … in name``: (name, the loop)
    fors: list = field(default_factory=list)
    #: ``targets = owner.prepare(…)``: (the call, the names it binds)
    prepared: list = field(default_factory=list)


def loader_name(expr: ast.AST) -> str | None:
    """The loader a ``for`` iterates: ``dl`` in ``dl``, ``enumerate(dl)``, ``tqdm(dl, …)``, ``enumerate(tqdm(dl))``."""
    while isinstance(expr, ast.Call) and expr.args and last_name(expr.func) in ("enumerate", "tqdm", "iter"):
        expr = expr.args[0]
    return expr.id if isinstance(expr, ast.Name) else None


def _scan(stmt: Statement, facts: JobFacts, defs: dict[str, list[ast.Call]], seen: _Seen) -> None:
    scan = _Scan(facts, defs, stmt, seen)
    scan.visit_all(stmt.nodes)
    # in source order, outer calls first (the order a libcst walk meets them)
    scan.calls.sort(key=lambda c: (c[0].lineno, c[0].col_offset, -c[0].end_lineno, -c[0].end_col_offset))
    stmt.calls = [c for c, _ in scan.calls]
    stmt.plain_calls = [c for c, in_class in scan.calls if not in_class]


def gather_facts(cells: list[CellCode]) -> JobFacts:
    """Look at every cell once and decide what the statement rules do."""
    facts = JobFacts()
    defs: dict[str, list[ast.Call]] = {}  # function name → the calls in its body
    top = [stmt for cell in cells for stmt in cell.statements]
    seen = _Seen()
    for stmt in top:
        _scan(stmt, facts, defs, seen)
    facts.module_names = set().union(*(stmt.binds for stmt in top))
    _plan_trainers(seen, defs, facts)
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

    _plan_accelerate(seen, facts)
    _plan_loaders(seen, defs, facts)
    trains = [any(is_training_call(c, facts) for c in stmt.calls) for stmt in top]
    facts.training = [s for s, t in zip(top, trains) if t]
    if not facts.training:
        return facts
    facts.plain_loop = not facts.trainer_names and not facts.self_distributed and any(
        last_name(c.func) == "backward" or last_name(c.func) in facts.training_functions or _launches(c, facts)
        for stmt, t in zip(top, trains) if t for c in stmt.calls
    )
    first, last = trains.index(True), len(trains) - 1 - trains[::-1].index(True)
    _plan_after_training(top, first, last, facts)
    _plan_shared_saves(top, first, facts)
    _plan_data_prep(top, facts)
    if facts.plain_loop:
        facts.loops = {s for s in top if any(is_training_call(c, facts) for c in s.plain_calls)}
        if facts.ddp_models:
            _plan_ddp_wraps(top, first, facts)
    return facts


def _plan_trainers(seen: _Seen, defs: dict[str, list[ast.Call]], facts: JobFacts) -> None:
    """Names bound to what a function of the notebook returns when that function builds a trainer
    (``trainer_x = create_trainer(…)``): their ``.train()`` trains."""
    factories = {name for name, calls in defs.items() if any(is_trainer_class(last_name(c.func)) for c in calls)}
    for targets, call in seen.assigned:
        if isinstance(call.func, ast.Name) and call.func.id in factories:
            facts.trainer_names.update(targets)


def _plan_accelerate(seen: _Seen, facts: JobFacts) -> None:
    """What an ``Accelerator`` prepares is Accelerate's: no DDP wrap, no sampler from nbddp."""
    for call, targets in seen.prepared:
        if isinstance(call.func.value, ast.Name) and call.func.value.id in facts.accelerators:
            facts.accelerate_prepared.update(targets)
            facts.accelerate_prepared.update(a.id for a in call.args if isinstance(a, ast.Name))
    facts.ddp_models -= facts.accelerate_prepared


def _launches(call: ast.Call, facts: JobFacts) -> bool:
    """``notebook_launcher(train_fn, …)`` of a training function: each rank runs it (``runtime.launchers``)."""
    return (isinstance(call.func, ast.Name) and call.func.id == "notebook_launcher" and bool(call.args)
            and isinstance(call.args[0], ast.Name) and call.args[0].id in facts.training_functions)


def _plan_loaders(seen: _Seen, defs: dict[str, list[ast.Call]], facts: JobFacts) -> None:
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
            shuffles = shuffle is not None and not _is_literal(shuffle.value, False, None)
            if loader_shards(False, shuffles, targets, facts.train_iterated):
                facts.sharded_loaders.update(targets)
            else:
                facts.whole_loaders.update(targets)
        elif callee not in defs and "loader" in callee.lower() and loader_shards(False, None, targets, facts.train_iterated):
            facts.helper_loaders.update(targets)  # a helper's loader: sharded when it runs
    facts.whole_loaders -= facts.sharded_loaders | facts.helper_loaders


def _plan_after_training(top: list[Statement], first: int, last: int, facts: JobFacts) -> None:
    """Which statements after the first training call run on rank 0 only.

    After the last training call everything does, except what every rank must run (a collective such as
    ``trainer.evaluate()``) and what binds a name such code reads. Between two training calls only
    statements that save, push, generate, print or plot do (with the same exceptions): the rest prepares
    the next training, which every rank runs. Read backwards, so a name a later all-rank statement needs is
    known when the statement binding it is reached.
    """
    needed: set[str] = set()
    for k in range(len(top) - 1, first, -1):
        stmt = top[k]
        collective = next((c for c in stmt.calls if is_collective_call(c, facts)), None)
        if collective is not None:
            reason = f"{_func_code(stmt.cell, collective)}() needs every rank"
        elif stmt.binds & needed:
            reason = f"binds {', '.join(sorted(stmt.binds & needed))}, which code on every rank uses"
        else:
            reason = None
        if reason is None and (k > last or any(_is_rank0_action(c) for c in stmt.calls)):
            facts.rank0.add(stmt)
            if k > last:
                facts.tail.add(stmt)
            continue
        if k > last:
            facts.all_ranks[stmt] = reason
        needed |= stmt.reads


def _plan_shared_saves(top: list[Statement], first: int, facts: JobFacts) -> None:
    """Saving before training that a later statement reads back (``model.save_pretrained("base")``, then
    ``from_pretrained("base")``) runs on rank 0, and every rank waits for it: ``save_pretrained`` writes on
    rank 0 only, so another rank would read before the files exist; a file every rank wrote could be read
    half written. An expression statement whose files some later statement reads (by any path: the check
    is by kind of call)."""
    for k, stmt in enumerate(top[:first]):
        node = stmt.nodes[0]
        if len(stmt.nodes) != 1 or not isinstance(node, ast.Expr) or not any(_writes(c) for c in stmt.calls):
            continue
        if any(_reads(c) for later in top[k + 1 :] for c in later.calls):
            facts.shared_saves.add(stmt)
            facts.rank0.add(stmt)


def _writes(call: ast.Call) -> bool:
    name = dotted_name(call.func) or ""
    return last_name(call.func) in _WRITES or name in ("torch.save", "np.save", "numpy.save")


def _reads(call: ast.Call) -> bool:
    return last_name(call.func) in _READS


def _func_code(cell: CellCode, call: ast.Call) -> str:
    """The source of a call's callee, with any parentheses around it (``(trainer.evaluate)``)."""
    text = cell.source(call.func)
    if (call.lineno, call.col_offset) == (call.func.lineno, call.func.col_offset):
        return text
    # parenthesised: the text from the call's start through the parentheses that close after the callee
    code = cell.code
    start = _offset(cell, call.lineno, call.col_offset)
    at = _offset(cell, call.func.end_lineno, call.func.end_col_offset)
    opened = code.count("(", start, _offset(cell, call.func.lineno, call.func.col_offset))
    while opened and at < len(code):
        if code[at] == "#":
            at = code.index("\n", at) if "\n" in code[at:] else len(code)
            continue
        opened -= code[at] == ")"
        at += 1
    return code[start:at]


def _offset(cell: CellCode, line: int, col: int) -> int:
    """Character offset in the cell's code of an ast position (line, UTF-8 column)."""
    before = sum(len(ln) for ln in cell.lines[: line - 1])
    return before + len(cell.line_bytes(line)[:col].decode())


def _plan_data_prep(top: list[Statement], facts: JobFacts) -> None:
    """Dataset preparation on every rank goes under ``main_process_first`` (cache files are not raced)."""
    training = set(facts.training)
    for stmt in top:
        if stmt in facts.rank0 or stmt in training or isinstance(stmt.nodes[0], _DEFS):
            continue
        if is_dead_if(stmt.nodes[0]):
            continue
        if any(_is_data_prep(c) for c in stmt.calls) and not any(is_collective_call(c, facts) for c in stmt.calls):
            facts.main_first.add(stmt)


def _places(group: list[ast.stmt], name: str) -> bool:
    """``name = …`` or ``name.to(…)`` / ``name.cuda()``: the statement makes the model or moves it."""
    for small in group:
        if isinstance(small, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in small.targets):
            return True
        if isinstance(small, ast.Expr) and isinstance(small.value, ast.Call):
            func = small.value.func
            if isinstance(func, ast.Attribute) and func.attr in ("to", "cuda") and isinstance(func.value, ast.Name) and func.value.id == name:
                return True
    return False


def placement(groups: list[list[ast.stmt]], name: str) -> list[ast.stmt] | None:
    """The last statement that makes or moves model ``name``: DDP wraps it right after."""
    return next((g for g in reversed(groups) if not is_compound(g[0]) and _places(g, name)), None)


def _plan_ddp_wraps(top: list[Statement], first: int, facts: JobFacts) -> None:
    """Where a plain PyTorch model is wrapped in DDP: after the last statement that makes or moves it before
    a training statement, at the top level and in each block (a function or a fold loop that builds a model
    and trains it). A model made after an earlier training (a second model, a PEFT model built on the first)
    is wrapped before the training that follows it."""
    training = {id(s) for s in facts.training}
    for name in sorted(facts.ddp_models):
        for stmt in _last_placements(top, training, name):
            facts.ddp_wrap_after.setdefault(stmt, []).append(name)
    for stmt in top:
        if is_compound(stmt.nodes[0]):
            before = len(facts.ddp_wrap_inside)
            for block in _blocks(stmt.nodes[0], stmt.cell):
                _plan_block(block, stmt.cell, facts)
            if len(facts.ddp_wrap_inside) > before:
                facts.ddp_wraps_inside.add(stmt)


def _last_placements(top: list[Statement], training: set[int], name: str) -> list[Statement]:
    """The top-level statements that make or move ``name`` last before some training statement."""
    found, last = [], None
    for stmt in top:
        if id(stmt) in training:
            if last is not None:
                found.append(last)
            last = None
        elif not is_compound(stmt.nodes[0]) and _places(stmt.nodes, name):
            last = stmt
    return found


def _plan_block(block: list[ast.stmt], cell: CellCode, facts: JobFacts) -> None:
    groups = group_lines(block, cell)
    first = next((i for i, g in enumerate(groups) if any(is_training_call(c, facts) for c in calls_in(g))), None)
    if first is None:
        return
    for name in sorted(facts.ddp_models):
        at = placement(groups[:first], name)
        if at is not None:
            facts.ddp_wrap_inside.setdefault((cell.position, at[0].lineno), []).append(name)


def _blocks(node: ast.stmt, cell: CellCode):
    """Every indented block (a body on lines of its own) in a compound statement, outside ``if False:``."""
    if is_dead_if(node):
        return
    for body in compound_bodies(node):
        if not body:
            continue
        if isinstance(node, ast.If) and body is node.orelse and _is_elif(body[0], cell):
            yield from _blocks(body[0], cell)  # an elif: its own bodies are the blocks
            continue
        line = cell.lines[body[0].lineno - 1]
        if len(line.encode()) - len(line.lstrip().encode()) == body[0].col_offset:
            yield body
        for inner in body:
            if is_compound(inner):
                yield from _blocks(inner, cell)


def _is_elif(node: ast.stmt, cell: CellCode) -> bool:
    return isinstance(node, ast.If) and cell.line_bytes(node.lineno)[node.col_offset :].startswith(b"elif")


def calls_in(nodes: list[ast.stmt]) -> list[ast.Call]:
    """Every call in statements, outside function and class bodies, lambdas and ``if False:`` blocks."""
    found: list[ast.Call] = []
    todo: list[ast.AST] = list(nodes)
    while todo:
        node = todo.pop()
        if isinstance(node, (*_DEFS, ast.Lambda)) or is_dead_if(node):
            continue
        if isinstance(node, ast.Call):
            found.append(node)
        todo.extend(ast.iter_child_nodes(node))
    return found
