"""Rewrite rules: one libcst transformer each, applied to every cleaned cell in order.

Each rule records what it changed as ``(line, message)`` pairs, lines counted in the cleaned cell, so the
script can say what it changed and where. Rules read a shared ``JobFacts`` gathered over all cells first
(which names hold trainers, which cell holds the last training call).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import libcst as cst
import libcst.matchers as m
from libcst.metadata import MetadataWrapper, PositionProvider

#: The runtime call that gives each rank its own device as a ``device_map``.
DEVICE_MAP_EXPR = "_nbddp.device_map()"
#: Guard for code that must run on one process only.
MAIN_PROCESS_EXPR = "_nbddp.is_main_process()"

_NOT_MODELS = ("Tokenizer", "Processor", "Config", "FeatureExtractor", "ImageProcessor", "Dataset")
_TRAINER_CONFIGS = frozenset(
    {"TrainingArguments", "Seq2SeqTrainingArguments"}
    | {
        f"{p}Config"
        for p in "SFT DPO GRPO ORPO KTO CPO BCO PPO RLOO Reward PRM GKD OnlineDPO XPO Nash Unsloth".split()
    }
)


def dotted_name(node: cst.BaseExpression) -> str | None:
    """``a.b.C`` for a Name/Attribute chain, else None."""
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        base = dotted_name(node.value)
        return f"{base}.{node.attr.value}" if base else None
    return None


def last_name(node: cst.BaseExpression) -> str | None:
    name = dotted_name(node)
    return name.rsplit(".", 1)[-1] if name else None


def is_model_loader(call: cst.Call) -> bool:
    """``X.from_pretrained(...)`` where X names a model class (not a tokenizer, processor or config)."""
    if not m.matches(call.func, m.Attribute(attr=m.Name("from_pretrained"))):
        return False
    owner = last_name(call.func.value)
    if not owner or any(word in owner for word in _NOT_MODELS):
        return False
    return "Model" in owner or "For" in owner or owner.startswith(("Auto", "Fast", "Peft"))


def is_trainer_class(name: str | None) -> bool:
    return bool(name) and name.endswith("Trainer")


@dataclass
class JobFacts:
    """What the rules need to know about the whole notebook, gathered by ``gather_facts``."""

    trainer_names: set[str] = field(default_factory=set)
    #: (position of the cell in the job, statement index) of the last top-level training statement.
    last_training: tuple[int, int] | None = None


def is_training_call(node: cst.CSTNode, trainer_names: set[str]) -> bool:
    """``trainer.train(...)`` on a known trainer, ``SomeTrainer(...).train()`` or ``unsloth_train(trainer)``."""
    if not isinstance(node, cst.Call):
        return False
    func = node.func
    if m.matches(func, m.Attribute(attr=m.Name("train"))):
        owner = func.value
        if isinstance(owner, cst.Name) and owner.value in trainer_names:
            return True
        return isinstance(owner, cst.Call) and is_trainer_class(last_name(owner.func))
    return last_name(func) == "unsloth_train"


class _FactsVisitor(cst.CSTVisitor):
    def __init__(self, facts: JobFacts):
        self.facts = facts

    def visit_Assign(self, node: cst.Assign) -> None:
        if isinstance(node.value, cst.Call) and is_trainer_class(last_name(node.value.func)):
            for target in node.targets:
                if isinstance(target.target, cst.Name):
                    self.facts.trainer_names.add(target.target.value)


def gather_facts(modules: list[cst.Module]) -> JobFacts:
    facts = JobFacts()
    for module in modules:
        module.visit(_FactsVisitor(facts))
    for pos, module in enumerate(modules):
        for idx, stmt in enumerate(module.body):
            if _contains_training_call(stmt, facts.trainer_names):
                facts.last_training = (pos, idx)
    return facts


def _contains_training_call(stmt: cst.CSTNode, trainer_names: set[str]) -> bool:
    found = []

    class V(cst.CSTVisitor):
        def visit_Call(self, node):
            if is_training_call(node, trainer_names):
                found.append(node)

    stmt.visit(V())
    return bool(found)


class Rule(m.MatcherDecoratableTransformer):
    """Base: a named transformer that records ``(line, message)`` for each change."""

    METADATA_DEPENDENCIES = (PositionProvider,)
    name = "rule"

    def __init__(self, facts: JobFacts, position: int):
        super().__init__()
        self.facts, self.position = facts, position
        self.changes: list[tuple[int, str]] = []

    def note(self, node: cst.CSTNode, message: str) -> None:
        self.changes.append((self.get_metadata(PositionProvider, node).start.line, message))


def _set_keyword(call: cst.Call, key: str, value: cst.BaseExpression) -> tuple[cst.Call, str | None]:
    """Set ``key=value`` on a call; return the new call and the old value's source (None when absent).

    A new keyword goes last; in a call written one argument per line it gets a line of its own.
    """
    args = list(call.args)
    for i, arg in enumerate(args):
        if arg.keyword is not None and arg.keyword.value == key:
            args[i] = arg.with_changes(value=value)
            return call.with_changes(args=args), cst.Module([]).code_for_node(arg.value)
    new_arg = cst.Arg(
        keyword=cst.Name(key),
        value=value,
        equal=cst.AssignEqual(whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace("")),
    )
    if args and isinstance(args[-1].comma, cst.Comma) and "\n" in cst.Module([]).code_for_node(args[-1].comma):
        # one argument per line with a trailing comma: the new argument takes the last one's line ending,
        # the last one takes the separator used between arguments.
        between = args[-2].comma if len(args) > 1 and isinstance(args[-2].comma, cst.Comma) else cst.Comma(
            whitespace_after=call.whitespace_before_args
        )
        new_arg = new_arg.with_changes(comma=args[-1].comma)
        args[-1] = args[-1].with_changes(comma=between)
    args.append(new_arg)
    return call.with_changes(args=args), None


def has_keyword(call: cst.Call, key: str) -> bool:
    return any(arg.keyword is not None and arg.keyword.value == key for arg in call.args)


class DeviceMapRule(Rule):
    """Model loaders load onto this rank's device.

    ``from_pretrained`` with ``device_map="auto"`` (or none) would put every rank's copy on GPU 0, or split
    one model over all GPUs. Under DDP each rank holds a whole model on its own GPU, so every model loader
    gets ``device_map=_nbddp.device_map()`` (``{"": local_rank}``, or the CPU without GPUs). Tokenizers,
    processors and configs are left alone.
    """

    name = "device_map"

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.Call:
        if not is_model_loader(updated):
            return updated
        new, old = _set_keyword(updated, "device_map", cst.parse_expression(DEVICE_MAP_EXPR))
        loader = dotted_name(updated.func) or "from_pretrained"
        was = f"device_map={old}" if old is not None else "no device_map"
        self.note(original, f"{loader}: {was} → this rank's device")
        return new


class TrainerConfigRule(Rule):
    """Trainer configurations get DDP-safe settings the user did not set.

    ``ddp_find_unused_parameters``: the HF Trainer turns it on for every model that is not a plain
    ``PreTrainedModel`` (every PEFT model), which costs an extra graph traversal each step and, with
    reentrant gradient checkpointing, fails with "marked as ready twice". LoRA adapters are all used in every
    step, so ``False`` is right; a value the user wrote is kept.
    """

    name = "trainer_config"

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.Call:
        if last_name(updated.func) not in _TRAINER_CONFIGS:
            return updated
        if has_keyword(updated, "ddp_find_unused_parameters"):
            return updated
        new, _ = _set_keyword(updated, "ddp_find_unused_parameters", cst.Name("False"))
        self.note(original, f"{last_name(updated.func)}: ddp_find_unused_parameters=False (all LoRA weights train each step)")
        return new


class RankZeroTailRule(Rule):
    """What follows the last training call runs on rank 0 only.

    After ``trainer.train()`` notebooks save, push, print statistics and generate. Run by every rank these
    would write the same files at once, push twice and print once per GPU; wrapped in
    ``if _nbddp.is_main_process():`` they happen once. The other ranks go on to the epilogue.
    """

    name = "rank0_tail"

    def leave_Module(self, original: cst.Module, updated: cst.Module) -> cst.Module:
        last = self.facts.last_training
        if last is None or self.position < last[0]:
            return updated
        start = last[1] + 1 if self.position == last[0] else 0
        tail = list(updated.body[start:])
        if not tail:
            return updated
        guard = cst.If(
            test=cst.parse_expression(MAIN_PROCESS_EXPR),
            body=cst.IndentedBlock(body=[_strip_leading(tail[0])] + tail[1:]),
            leading_lines=tail[0].leading_lines,
        )
        line = self.get_metadata(PositionProvider, original.body[start]).start.line
        self.changes.append((line, "runs on rank 0 only (after training)"))
        return updated.with_changes(body=list(updated.body[:start]) + [guard])


def _strip_leading(stmt):
    # the guard carries the statement's leading blank lines and comments
    return stmt.with_changes(leading_lines=[])


#: The rules in the order they are applied.
RULES: tuple[type[Rule], ...] = (DeviceMapRule, TrainerConfigRule, RankZeroTailRule)


def apply_rules(module: cst.Module, facts: JobFacts, position: int) -> tuple[cst.Module, list[tuple[str, int, str]]]:
    """Run every rule over one cell's module; return it and ``(rule, line, message)`` for each change.

    Each rule sees the module as the rules before it left it; its lines are mapped back to the module as it
    came in, so every change is reported at a line of the cleaned cell.
    """
    from .lines import align

    original = module.code.splitlines()
    changes: list[tuple[str, int, str]] = []
    for rule_cls in RULES:
        rule = rule_cls(facts, position)
        back = align(original, module.code.splitlines())
        module = MetadataWrapper(module).visit(rule)
        for line, msg in rule.changes:
            j = back[line - 1] if 0 < line <= len(back) else None
            changes.append((rule.name, (j if j is not None else line - 1) + 1, msg))
    return module, changes
