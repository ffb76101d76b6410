"""Where each rewrite rule has work, decided with Python's ``ast``: libcst parses only those statements.

Every rule of ``rules.py`` has a check here, under the same name. A check answers three questions, from
cheapest to dearest:

- ``wanted``: may the rule have anything to do in this cell (the cell's text, the notebook's facts)?
- ``could_change``: may it have anything to do in this statement (the statement's text)? The expression
  rules walk only the statements whose text one of them could change.
- ``touches``: does the statement hold something the rule rewrites or notes (its ast)? A check may say yes
  where the rule then does nothing, never the reverse: a statement no check touches keeps its cleaned
  source as it is, without a libcst parse.

``plan_cell`` puts the answers together: which rules a cell runs, step by step, and the runs of consecutive
statements they run on (``Plan.chunks``). ``tests/test_convert_fast.py`` converts the corpus with and without
the checks and expects the same scripts.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field

from .ast_helpers import calls, compound_bodies, dotted_name, is_compound, last_name
from .code import CellCode, Statement, group_lines
from .facts import CUDA_INDEX, TRAINER_CONFIGS, JobFacts, is_model_loader_owner


class Check:
    """Base: where one rule has work. ``pattern``: what a cell's or statement's text must contain."""

    name = "rule"
    pattern: re.Pattern | None = None
    #: the keyword arguments whose presence or value the rule reads in a statement it may change; the
    #: others, where they hold nothing the check touches, are read by libcst as stand-ins
    #: (``Plan.arguments``). None: the rule may read any argument, and any statement inside a block.
    keywords: frozenset[str] | None = None

    @classmethod
    def wanted(cls, cell: CellCode, facts: JobFacts) -> bool:
        return cls.could_change(cell.code, facts)

    @classmethod
    def could_change(cls, text: str, facts: JobFacts) -> bool:
        return cls.pattern is None or cls.pattern.search(text) is not None

    @classmethod
    def touches(cls, stmt: Statement, facts: JobFacts, nodes: list[ast.AST]) -> bool:
        """Whether the rule may rewrite or note something in ``stmt`` (``nodes``: every node in it)."""
        return True


# ----------------------------------------------------------------------------------- statement rules


class MainProcessFirst(Check):
    name = "main_process_first"

    @classmethod
    def wanted(cls, cell, facts) -> bool:
        return any(s in facts.main_first for s in cell.statements)

    @classmethod
    def touches(cls, stmt, facts, nodes) -> bool:
        return stmt in facts.main_first


class RankZero(Check):
    name = "rank0"

    @classmethod
    def wanted(cls, cell, facts) -> bool:
        return any(s in facts.rank0 or s in facts.all_ranks for s in cell.statements)

    @classmethod
    def touches(cls, stmt, facts, nodes) -> bool:
        return stmt in facts.rank0 or stmt in facts.all_ranks  # the latter get a note: "stays on every rank"


class DDPWrap(Check):
    name = "ddp_wrap"

    @classmethod
    def wanted(cls, cell, facts) -> bool:
        return facts.plain_loop and bool(facts.ddp_models)

    @classmethod
    def touches(cls, stmt, facts, nodes) -> bool:
        return stmt in facts.ddp_wrap_after or stmt in facts.ddp_wraps_inside


# ---------------------------------------------------------------------------------- expression rules


class DeviceMap(Check):
    name = "device_map"
    keywords = frozenset({"device_map"})
    pattern = re.compile(r"(?:Model|For[A-Z])\w*\s*\.\s*from_pretrained")

    @classmethod
    def touches(cls, stmt, facts, nodes) -> bool:
        return any(
            isinstance(c.func, ast.Attribute) and c.func.attr == "from_pretrained"
            and is_model_loader_owner(last_name(c.func.value))
            for c in calls(nodes)
        )


class Device(Check):
    name = "device"
    keywords = frozenset({"device_map"})  # its strings are DeviceMap's
    pattern = re.compile(r"cuda:\d|CUDA_VISIBLE_DEVICES|\.cuda\(\s*\d|set_device\(\s*\d")

    @classmethod
    def touches(cls, stmt, facts, nodes) -> bool:
        for node in nodes:
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and CUDA_INDEX.match(node.value):
                return True
            if isinstance(node, ast.Call) and (
                isinstance(node.func, ast.Attribute) and node.func.attr == "cuda"
                or dotted_name(node.func) == "torch.cuda.set_device"
            ):
                return True
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Subscript) and dotted_name(t.value) == "os.environ" for t in node.targets
            ):
                return True
        return False


class Autocast(Check):
    name = "autocast"
    keywords = frozenset()  # it reads positional arguments only
    pattern = re.compile(r"cuda\.amp")
    _KINDS = ("autocast", "GradScaler")

    @classmethod
    def could_change(cls, text, facts) -> bool:
        # a name imported from torch.cuda.amp in another cell counts too
        return super().could_change(text, facts) or any(f"{name}(" in text for name in facts.cuda_amp_names)

    @classmethod
    def touches(cls, stmt, facts, nodes) -> bool:
        for node in nodes:
            if isinstance(node, ast.ImportFrom) and node.module == "torch.cuda.amp":
                return True
            if isinstance(node, ast.Call):
                name = dotted_name(node.func)
                if name in ("torch.cuda.amp.autocast", "torch.cuda.amp.GradScaler"):
                    return True
                if name in cls._KINDS and name in facts.cuda_amp_names:
                    return True
        return False


class TrainerConfig(Check):
    name = "trainer_config"
    #: the settings the rule adds where absent, and ``gradient_checkpointing``, which decides one of them
    keywords = frozenset({"ddp_find_unused_parameters", "log_on_each_node", "gradient_checkpointing",
                          "gradient_checkpointing_kwargs"})
    pattern = re.compile(r"\b(?:" + "|".join(sorted(TRAINER_CONFIGS)) + r")\s*\(")

    @classmethod
    def touches(cls, stmt, facts, nodes) -> bool:
        return any(last_name(c.func) in TRAINER_CONFIGS for c in calls(nodes))


class DistributedSampler(Check):
    name = "sampler"
    pattern = re.compile(r"\bDataLoader\s*\(")

    @classmethod
    def wanted(cls, cell, facts) -> bool:
        return facts.plain_loop and super().wanted(cell, facts)

    @classmethod
    def could_change(cls, text, facts) -> bool:
        return super().could_change(text, facts) or any(name in text for name in facts.helper_loaders)

    @classmethod
    def touches(cls, stmt, facts, nodes) -> bool:
        return any(last_name(c.func) == "DataLoader" for c in calls(nodes)) or bool(stmt.binds & facts.helper_loaders)


class SetEpoch(Check):
    name = "set_epoch"
    pattern = re.compile(r"\bfor\b")

    @classmethod
    def wanted(cls, cell, facts) -> bool:
        code = cell.code
        loaders = "loader" in code.lower() or any(name in code for name in facts.sharded_loaders)
        return facts.plain_loop and loaders and super().wanted(cell, facts)

    @classmethod
    def touches(cls, stmt, facts, nodes) -> bool:
        # an epoch loop (a ``for`` over a plain name) that reads a loader somewhere in its statement
        loops = any(isinstance(n, (ast.For, ast.AsyncFor)) and isinstance(n.target, ast.Name) for n in nodes)
        return loops and any(
            isinstance(n, ast.Name) and (n.id in facts.sharded_loaders or "loader" in n.id.lower()) for n in nodes
        )


class Unwrap(Check):
    name = "unwrap"
    pattern = re.compile(r"state_dict|torch\.save")

    @classmethod
    def wanted(cls, cell, facts) -> bool:
        return facts.plain_loop and bool(facts.ddp_models) and super().wanted(cell, facts)

    @classmethod
    def touches(cls, stmt, facts, nodes) -> bool:
        models = facts.ddp_models
        for call in calls(nodes):
            func = call.func
            if isinstance(func, ast.Attribute) and func.attr in ("state_dict", "load_state_dict"):
                if isinstance(func.value, ast.Name) and func.value.id in models:
                    return True
            elif dotted_name(func) == "torch.save":
                values = [a.value if isinstance(a, ast.Starred) else a for a in call.args] + [k.value for k in call.keywords]
                if any(isinstance(v, ast.Name) and v.id in models for v in values):
                    return True
        return False


class LoopOutput(Check):
    name = "loop_output"
    pattern = re.compile(r"\bprint\s*\(|torch\.save")

    @classmethod
    def wanted(cls, cell, facts) -> bool:
        code = cell.code
        trains = ".backward(" in code or any(f"{name}(" in code for name in facts.training_functions)
        return facts.plain_loop and trains and super().wanted(cell, facts)

    @classmethod
    def touches(cls, stmt, facts, nodes) -> bool:
        trains = stmt in facts.loops or any(
            isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name in facts.training_functions for n in nodes
        )
        return trains and any(
            isinstance(c.func, ast.Name) and c.func.id == "print" or dotted_name(c.func) == "torch.save"
            for c in calls(nodes)
        )


#: Checks of the rules on top-level statements, in the order the rules run.
STATEMENT_CHECKS: tuple[type[Check], ...] = (MainProcessFirst, RankZero, DDPWrap)
#: Checks of the rules on expressions and loops, which run together in one walk.
EXPRESSION_CHECKS: tuple[type[Check], ...] = (
    DeviceMap, Device, Autocast, TrainerConfig, DistributedSampler, SetEpoch, Unwrap, LoopOutput,
)
CHECKS = STATEMENT_CHECKS + EXPRESSION_CHECKS


@dataclass
class Plan:
    """What rewriting one cell takes.

    ``steps``: the checks of the rules to run, each statement rule alone, then the expression rules
    together. ``chunks``: runs of consecutive top-level statements that some rule may change or note; only
    these are parsed with libcst. ``walked``: the statements the expression rules walk (their text matches
    one of them). ``touching``: for each statement an expression rule may change, those rules (the others
    leave it alone); None when every rule walks every walked statement.
    """

    steps: list[tuple[type[Check], ...]]
    chunks: list[list[Statement]]
    walked: set[Statement]
    touching: dict[Statement, tuple[type[Check], ...]] | None = None
    #: simple statements of the chunks that only a statement rule moves into a block: libcst reads a
    #: one-line stand-in for each rather than the statement (``rules._Chunk``)
    stand_ins: frozenset[Statement] = frozenset()
    #: for statements the expression rules may change, runs of keyword arguments none of them reads: libcst
    #: reads one stand-in argument for each run (``rules._Chunk``)
    arguments: dict[Statement, list[list[ast.keyword]]] = field(default_factory=dict)
    #: for statements the expression rules may change, runs of statements inside their blocks that none of
    #: them changes: libcst reads one line for each run, at its indentation (``rules._Chunk``)
    inner: dict[Statement, list[list[ast.stmt]]] = field(default_factory=dict)


def _multiline_fstring(stmt: Statement) -> bool:
    """An f-string over several lines: libcst indents the lines inside its fields (no stand-in for it)."""
    if not _FSTRING.search(stmt.text) or all(node.end_lineno == node.lineno for node in stmt.nodes):
        return False
    return any(isinstance(n, ast.JoinedStr) and n.end_lineno != n.lineno for node in stmt.nodes for n in ast.walk(node))


#: Where an f-string may start (a false "yes" only costs a walk).
_FSTRING = re.compile(r"[fF][rRbB]?['\"]")
#: Statements shorter than this are read by libcst whole: a stand-in would save next to nothing.
_WORTH_STANDING_IN = 100


def plan_cell(cell: CellCode, facts: JobFacts, *, every_statement: bool = False) -> Plan | None:
    """The rules a cell runs and the statements they run on; None when no rule has anything to do there.

    ``every_statement``: run the wanted rules over the whole cell, as if every statement were touched (the
    reference the checks are tested against).
    """
    wanted = [c for c in CHECKS if c.wanted(cell, facts)]
    if not wanted or not cell.statements:
        return None
    expression = tuple(c for c in wanted if c in EXPRESSION_CHECKS)
    walked = {s for s in cell.statements if any(c.could_change(s.text, facts) for c in expression)}
    steps = [(c,) for c in STATEMENT_CHECKS if c in wanted] + ([expression] if expression else [])
    if every_statement:
        return Plan(steps, [list(cell.statements)], walked)
    touching: dict[Statement, tuple[type[Check], ...]] = {}
    walks: dict[Statement, list[ast.AST]] = {}  # every node of each statement an expression rule may change
    statement = [c for c in wanted if c in STATEMENT_CHECKS]
    # where DDPWrapRule rewrites the cell, libcst rebuilds every node it walked, and the expression rules
    # then walk every statement, not only those their text matches
    everywhere = DDPWrap in wanted and any(DDPWrap.touches(s, facts, []) for s in cell.statements)
    chunks: list[list[Statement]] = []
    moved: set[Statement] = set()  # the statements a statement rule moves into a block
    previous = None
    for stmt in cell.statements:
        touched = any(c.touches(stmt, facts, []) for c in statement)
        if touched:
            moved.add(stmt)
        if expression and (everywhere or stmt in walked):
            nodes = [n for node in stmt.nodes for n in ast.walk(node)]
            if rules := tuple(c for c in expression if c.touches(stmt, facts, nodes)):
                touching[stmt], walks[stmt] = rules, nodes
                touched = True
        if touched:
            if previous is not None and previous == stmt.index - 1:
                chunks[-1].append(stmt)
            else:
                chunks.append([stmt])
            previous = stmt.index
    if not chunks:
        return None
    if DDPWrap in wanted:  # DDPWrapRule walks every statement whole
        return Plan(steps, chunks, walked, touching)
    stand_ins = frozenset(
        stmt for chunk in chunks for stmt in chunk
        if stmt not in touching and not any(is_compound(node) for node in stmt.nodes) and not _multiline_fstring(stmt)
    )
    arguments, inner = {}, {}
    for stmt, rules in touching.items():
        if any(rule.keywords is None for rule in rules) or len(stmt.text) < _WORTH_STANDING_IN:
            continue  # a rule that may read anything in the statement, or little to save
        if stmt not in moved and (groups := _untouched_inside(stmt, facts, rules)):
            inner[stmt] = groups
        skip = {id(n) for group in inner.get(stmt, ()) for node in group for n in ast.walk(node)}
        if runs := _unread_arguments(stmt, facts, rules, walks[stmt], over_lines=stmt not in moved, skip=skip):
            arguments[stmt] = runs
    return Plan(steps, chunks, walked, touching, stand_ins, arguments, inner)


def _untouched_inside(stmt: Statement, facts: JobFacts, rules: tuple[type[Check], ...]) -> list[list[ast.stmt]]:
    """Runs of consecutive statements inside ``stmt``'s blocks (on lines of their own) that none of
    ``rules`` touches.

    Such a rule acts on the nodes its check touches and reads nothing around them (its keywords are
    listed), so these statements come back as written; the outermost ones are taken.
    """
    cell, found = stmt.cell, []

    def visit(body: list[ast.stmt]) -> None:
        run: list[ast.stmt] = []  # consecutive statements no rule touches: one stand-in
        for group in group_lines(body, cell):
            first = group[0]
            start = getattr(first, "decorator_list", None) and first.decorator_list[0] or first
            if cell.line_bytes(start.lineno)[: start.col_offset].strip():  # shares its line with a header
                return
            if not any(rule.touches(stmt, facts, [n for node in group for n in ast.walk(node)]) for rule in rules):
                run += group
                continue
            if run:
                found.append(run)
                run = []
            if is_compound(first):
                for sub in compound_bodies(first):
                    visit(sub)
        if run:
            found.append(run)

    for node in stmt.nodes:
        if is_compound(node):
            for body in compound_bodies(node):
                visit(body)
    return found


def _unread_arguments(
    stmt: Statement, facts: JobFacts, rules: tuple[type[Check], ...], nodes: list[ast.AST], over_lines: bool,
    skip: set[int],
) -> list[list[ast.keyword]]:
    """Runs of consecutive keyword arguments in ``stmt``'s calls that none of ``rules`` reads or may change.

    A rule reads the keywords its check lists; an argument holding anything a check touches (a nested
    trainer configuration, a ``"cuda:0"``) is read too. A call's last two arguments are always read (a new
    keyword argument is written the way they are), and so are positional ones. A run is worth a stand-in
    when it has two arguments or a long one. ``over_lines``: a run may span lines (the statement stays
    where it is; a statement rule moving it into a block would indent the lines inside the run). ``skip``:
    the ``id`` of nodes already stood in for; ``nodes``: every node of ``stmt``, outer ones first.
    """
    read = frozenset().union(*(rule.keywords for rule in rules))
    runs: list[list[ast.keyword]] = []
    taken: list[tuple[tuple[int, int], tuple[int, int]]] = []  # the spans of the runs found

    def unread(kw: ast.keyword) -> bool:
        return (kw.arg is not None and kw.arg not in read and (over_lines or kw.lineno == kw.end_lineno)
                and not any(rule.touches(stmt, facts, list(ast.walk(kw.value))) for rule in rules))

    for call in nodes:  # outer calls first: a call inside a run already found is left alone
        if not isinstance(call, ast.Call) or len(call.args) + len(call.keywords) < 3 or id(call) in skip:
            continue
        where = (call.lineno, call.col_offset)
        if any(a <= where < b for a, b in taken):
            continue
        ordered = sorted([*call.args, *call.keywords], key=lambda n: (n.lineno, n.col_offset))[:-2]
        run: list[ast.keyword] = []
        for arg in ordered + [None]:
            if isinstance(arg, ast.keyword) and unread(arg) and (over_lines or not run or arg.lineno == run[0].lineno):
                run.append(arg)
                continue
            if len(run) > 1 or run and (run[0].end_lineno > run[0].lineno or run[0].end_col_offset - run[0].col_offset >= 40):
                runs.append(run)
                taken.append(((run[0].lineno, run[0].col_offset), (run[-1].end_lineno, run[-1].end_col_offset)))
            run = [arg] if isinstance(arg, ast.keyword) and unread(arg) else []
    return runs
