"""Rewrite rules: one libcst transformer each, run on the statements of a cell where they have work.

Each rule notes what it changed (the node and a message); ``rewrite`` turns the notes into lines of the
cleaned cell, so the script can say what it changed and where. Rules read a shared ``JobFacts`` gathered with
Python's ast over all cells first (``facts.py``: which names hold trainers, which statements train, which
top-level statements run on rank 0 only), and run only where their check (``checks.py``, same name) says
they may have work: libcst parses just those runs of statements (``Plan.chunks``), and every other line of
the cell stays as it was cleaned.

Two kinds of rule:

- *statement rules* (``MainProcessFirstRule``, ``RankZeroRule``, ``DDPWrapRule``) act on top-level
  statements that ``gather_facts`` picked out. They run first, one after the other, and find their
  statements through the chunk (``Rule.statement``), so the choice is made once for the whole notebook.
- *expression rules* rewrite calls, arguments and loops wherever they are, together in one walk.

No rule looks inside an ``if False:`` block: notebooks keep optional steps there (GGUF export, pushing to
the Hub), and they stay exactly as written.
"""

from __future__ import annotations

import ast
import functools
import io
import re
import tokenize

import libcst as cst
from libcst.metadata import MetadataWrapper, PositionProvider

from . import checks
from .facts import CUDA_INDEX, PLAIN_SAMPLERS, TRAINER_CONFIGS, CellCode, JobFacts, Statement, is_model_loader_owner, loader_shards
from .lines import align

__all__ = ["EXPRESSION_RULES", "RULES", "STATEMENT_RULES", "Rule", "UnreadableCode", "rewrite"]

#: The runtime call that gives each rank its own device as a ``device_map``.
DEVICE_MAP_EXPR = "_nbddp.device_map()"
#: The runtime call that gives each rank its own ``torch.device``.
DEVICE_EXPR = "_nbddp.device()"
#: Guard for code that must run on one process only.
MAIN_PROCESS_EXPR = "_nbddp.is_main_process()"
#: Context manager letting the first process of each machine go first (caches, downloads).
MAIN_FIRST_EXPR = "_nbddp.main_process_first()"


# ------------------------------------------------------------------------------------- libcst helpers


def _subclasses(*bases: type) -> frozenset[type]:
    found, todo = set(), list(bases)
    while todo:
        cls = todo.pop()
        found.add(cls)
        todo += cls.__subclasses__()
    return frozenset(found)


#: Whitespace, comments, operators and punctuation: no rule rewrites them, so no walk goes into them (about
#: half of a statement's nodes).
_TRIVIA = _subclasses(
    cst.BaseParenthesizableWhitespace, cst.TrailingWhitespace, cst.EmptyLine, cst.Newline, cst.Comment,
    cst.Semicolon, cst.Colon, cst.Comma, cst.Dot, cst.AssignEqual, cst.ImportStar, cst.BaseUnaryOp,
    cst.BaseBooleanOp, cst.BaseBinaryOp, cst.BaseCompOp, cst.BaseAugOp, cst.LeftParen, cst.RightParen,
    cst.LeftSquareBracket, cst.RightSquareBracket, cst.LeftCurlyBrace, cst.RightCurlyBrace,
)
#: Values with nothing inside but trivia: an argument holding one is not walked unless a rule reads its kind.
_LEAVES = frozenset({cst.Name, cst.Integer, cst.Float, cst.Imaginary, cst.SimpleString, cst.Ellipsis})


@functools.cache
def _expression(code: str) -> cst.BaseExpression:
    """One of the fixed expressions the rules write, parsed once (libcst nodes are immutable)."""
    return cst.parse_expression(code)


@functools.cache
def _statement(code: str) -> cst.BaseStatement:
    """A fixed statement the rules write, parsed once."""
    return cst.parse_statement(code)


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


def is_model_loader(call: cst.Call) -> bool:
    """``X.from_pretrained(...)`` where X names a model class (``facts.is_model_loader_owner``)."""
    return is_attribute(call.func, "from_pretrained") and is_model_loader_owner(last_name(call.func.value))


def _string_value(node: cst.BaseExpression) -> str | None:
    if isinstance(node, cst.SimpleString):
        value = node.evaluated_value
        return value if isinstance(value, str) else None
    return None


def _environ_key(small: cst.BaseSmallStatement) -> str | None:
    """The key of ``os.environ["KEY"] = …`` (one target, a plain string key), else None."""
    if not isinstance(small, cst.Assign) or len(small.targets) != 1:
        return None
    target = small.targets[0].target
    if not isinstance(target, cst.Subscript) or len(target.slice) != 1:
        return None
    if not (is_attribute(target.value, "environ") and is_name(target.value.value, "os")):
        return None
    index = target.slice[0].slice
    return _string_value(index.value) if isinstance(index, cst.Index) else None


def _is_torch_save(small: cst.BaseSmallStatement) -> bool:
    """A ``torch.save(…)`` expression statement."""
    if not isinstance(small, cst.Expr) or not isinstance(small.value, cst.Call):
        return False
    func = small.value.func
    return is_attribute(func, "save") and is_name(func.value, "torch")


def _loader_name(expr: cst.BaseExpression) -> str | None:
    """The loader a ``for`` iterates: ``dl`` in ``dl``, ``enumerate(dl)``, ``tqdm(dl, …)``, ``enumerate(tqdm(dl))``."""
    while isinstance(expr, cst.Call) and expr.args and last_name(expr.func) in ("enumerate", "tqdm", "iter"):
        expr = expr.args[0].value
    return expr.value if isinstance(expr, cst.Name) else None


# ------------------------------------------------------------------------------------------- rules


class Rule(cst.CSTTransformer):
    """Base: a named transformer that records ``(node, message)`` for each change.

    ``check``: where the rule has work (``checks.py``); it gives the rule its name. A rule runs on one chunk
    of a cell at a time (``_Chunk``: consecutive top-level statements parsed together). The noted nodes are
    nodes of the module the rule was given; ``rewrite`` turns them into lines of the cell.
    """

    check: type[checks.Check] = checks.Check
    name = "rule"

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.name = cls.check.name
        if any(name.count("_") > 1 and name.startswith(("visit_", "leave_")) for name in vars(cls)):
            raise TypeError(f"{cls.__name__}: rules have no visit_<Node>_<attribute> methods (not dispatched)")

    def __init__(self, facts: JobFacts, chunk: _Chunk):
        super().__init__()
        self.facts, self.chunk = facts, chunk
        #: (node, index of the top-level statement holding it, message)
        self.changes: list[tuple[cst.CSTNode, int | None, str]] = []
        self._top: dict[cst.CSTNode, int] = {}
        self._current: int | None = None

    def on_visit(self, node: cst.CSTNode) -> bool:
        if type(node) in _TRIVIA:
            return False
        if isinstance(node, cst.Module):
            self._top = {stmt: i for i, stmt in enumerate(node.body)}
        elif node in self._top:
            self._current = self._top[node]
        visit = _method(type(self), "visit_" + type(node).__name__)
        return visit is None or visit(self, node) is not False

    def on_leave(self, original: cst.CSTNode, updated: cst.CSTNode):
        leave = _method(type(self), "leave_" + type(original).__name__)
        return updated if leave is None else leave(self, original, updated)

    # libcst offers each attribute of each node to ``visit_<Node>_<attribute>`` methods; rules have none
    def on_visit_attribute(self, node: cst.CSTNode, attribute: str) -> None:
        pass

    def on_leave_attribute(self, original: cst.CSTNode, attribute: str) -> None:
        pass

    @classmethod
    def reads(cls, node: cst.CSTNode) -> bool:
        """Whether the rule has a ``visit_``/``leave_`` method for nodes of this kind."""
        kind = type(node).__name__
        return _method(cls, "visit_" + kind) is not None or _method(cls, "leave_" + kind) is not None

    def statement(self, node: cst.CSTNode) -> Statement | None:
        """The notebook's top-level statement a top-level node of the chunk stands for (None for a new node)."""
        return self.chunk.statement_of.get(node)

    def visit_If(self, node: cst.If) -> bool:
        return not is_dead_if(node)

    def note(self, node: cst.CSTNode, message: str) -> None:
        self.changes.append((node, self._top.get(node, self._current), message))


@functools.cache
def _method(cls: type, name: str):
    """A rule class's own ``visit_X``/``leave_X`` function (None for libcst's no-op stubs): found once per
    kind of node rather than looked up by name for each node a walk meets."""
    for klass in cls.__mro__:
        if klass.__module__.startswith(("libcst", "builtins")):
            return None
        if name in vars(klass):
            return vars(klass)[name]
    return None


def _set_keyword(call: cst.Call, key: str, value: cst.BaseExpression) -> tuple[cst.Call, str | None]:
    """Set ``key=value`` on a call; return the new call and the old value's source (None when absent).

    A new keyword goes last; in a call written one argument per line it gets a line of its own, and every
    comment stays on the line it was on (a comment after the last argument does not move to the new one).
    """
    args = list(call.args)
    for i, arg in enumerate(args):
        if arg.keyword is not None and arg.keyword.value == key:
            args[i] = arg.with_changes(value=value)
            return call.with_changes(args=args), code_of(arg.value)
    new_arg = cst.Arg(
        keyword=cst.Name(key),
        value=value,
        equal=cst.AssignEqual(whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace("")),
    )
    if args and (closing := _closing_line(args[-1])) is not None:
        return call.with_changes(args=_on_own_line(call, args, new_arg, closing)), None
    if args and isinstance(args[-1].comma, cst.Comma):  # f(a, ): the trailing comma stays last
        new_arg = new_arg.with_changes(comma=args[-1].comma)
        args[-1] = args[-1].with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
    elif args:
        args[-1] = args[-1].with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
    args.append(new_arg)
    return call.with_changes(args=args), None


def _closing_line(last: cst.Arg) -> cst.ParenthesizedWhitespace | None:
    """What follows a call's last argument when the closing parenthesis is on a line of its own: the rest of
    the argument's line (a comment), comment lines, the parenthesis' indentation. None otherwise."""
    after = last.comma.whitespace_after if isinstance(last.comma, cst.Comma) else last.whitespace_after_arg
    return after if isinstance(after, cst.ParenthesizedWhitespace) else None


def _on_own_line(call: cst.Call, args: list[cst.Arg], new_arg: cst.Arg, closing: cst.ParenthesizedWhitespace) -> list:
    """``args`` with ``new_arg`` on a line of its own after the last: the last argument keeps its line's
    comment and the comment lines below it; the new one ends its line with what the call's arguments
    end theirs with (a comma or not) and the parenthesis' indentation."""
    between = next((a.comma.whitespace_after for a in reversed(args[:-1]) if isinstance(a.comma, cst.Comma)
                    and isinstance(a.comma.whitespace_after, cst.ParenthesizedWhitespace)), None)
    if between is None:
        between = call.whitespace_before_args if isinstance(call.whitespace_before_args, cst.ParenthesizedWhitespace) else closing
    last = args[-1]
    trailing_comma = isinstance(last.comma, cst.Comma)
    kept = closing.with_changes(indent=between.indent, last_line=between.last_line)  # its comments stay here
    args[-1] = last.with_changes(
        comma=cst.Comma(whitespace_before=last.comma.whitespace_before if trailing_comma else cst.SimpleWhitespace(""),
                        whitespace_after=kept),
        whitespace_after_arg=last.whitespace_after_arg if trailing_comma else cst.SimpleWhitespace(""),
    )
    end = closing.with_changes(first_line=cst.TrailingWhitespace(), empty_lines=[])
    if trailing_comma:
        new_arg = new_arg.with_changes(comma=cst.Comma(whitespace_after=end))
    else:
        new_arg = new_arg.with_changes(whitespace_after_arg=end)
    return args + [new_arg]


def _has_star_kwargs(call: cst.Call) -> bool:
    return any(arg.star == "**" for arg in call.args)


class _StatementRule(Rule):
    """Base of the statement rules: each run of consecutive chosen top-level statements goes into one block."""

    def picks(self, stmt: Statement | None) -> bool:
        """Whether the rule takes this top-level statement of the notebook."""
        raise NotImplementedError

    def block(self, run: list[cst.BaseStatement]) -> cst.BaseCompoundStatement:
        """The block holding a run of chosen statements (build its body with ``inside(run)``)."""
        raise NotImplementedError

    def message(self, run: list[cst.BaseStatement]) -> str:
        raise NotImplementedError

    def after(self, run: list[cst.BaseStatement]) -> list[cst.BaseStatement]:
        """Statements that follow the block (none unless a rule says)."""
        return []

    def inside(self, run: list[cst.BaseStatement]) -> list[cst.BaseStatement]:
        """The run as a block's body: the block takes the first statement's comments and blank lines above."""
        first = run[0].with_changes(leading_lines=[])
        self.chunk.statement_of[first] = self.statement(run[0])
        return [first] + run[1:]

    def visit_Module(self, node: cst.Module) -> bool:
        return False  # top-level statements only; they stay the very nodes the chunk maps to statements

    def leave_Module(self, original: cst.Module, updated: cst.Module) -> cst.Module:
        body: list[cst.BaseStatement] = []
        run: list[cst.BaseStatement] = []

        def flush():
            if run:
                body.append(self.block(run).with_changes(leading_lines=run[0].leading_lines))
                body.extend(self.after(run))
                self.note(run[0], self.message(run))
                run.clear()

        for stmt in original.body:
            if self.picks(self.statement(stmt)):
                run.append(stmt)
            else:
                flush()
                body.append(stmt)
        flush()
        return updated.with_changes(body=body)


class DDPWrapRule(Rule):
    """Plain PyTorch: the model is wrapped in ``DistributedDataParallel`` once it is on its device.

    A notebook's own training loop has no Trainer to do it. Without DDP each rank would train its own copy
    on its share of the data and the copies would drift apart; wrapped, gradients are averaged in every
    backward. The wrap (``model = _nbddp.ddp(model)``) goes after the last statement that makes or moves
    the model (``model = Net().to(device)``, ``model.to(device)``) before the first training statement; the
    same inside a function or loop that builds a model and trains it (k-fold loops). Optimizers keep working:
    DDP shares the module's parameters.
    """

    check = checks.DDPWrap

    def _wrap(self, stmt: cst.BaseStatement, names: list[str]) -> list[cst.BaseStatement]:
        self.note(stmt, f"{', '.join(names)} wrapped in DistributedDataParallel (gradients averaged over ranks)")
        return [cst.parse_statement(f"{n} = _nbddp.ddp({n})\n") for n in names]

    def _wrap_block(self, original: list[cst.BaseStatement], updated: list[cst.BaseStatement], planned) -> list:
        out: list[cst.BaseStatement] = []
        for old, new in zip(original, updated):
            out.append(new)
            names = planned(old)
            if names:
                out += self._wrap(old, names)
        return out

    def leave_Module(self, original: cst.Module, updated: cst.Module) -> cst.Module:
        for old, new in zip(original.body, updated.body):  # the walk rebuilt them: later rules find them still
            if (stmt := self.statement(old)) is not None:
                self.chunk.statement_of[new] = stmt
        planned = lambda s: self.facts.ddp_wrap_after.get(self.statement(s))  # noqa: E731
        return updated.with_changes(body=self._wrap_block(original.body, updated.body, planned))

    def leave_IndentedBlock(self, original: cst.IndentedBlock, updated: cst.IndentedBlock) -> cst.IndentedBlock:
        if not self.chunk.wraps_inside:  # the facts chose no statement in a block of this chunk
            return updated
        plan = {s: names for s in original.body if (names := self.chunk.wrap_inside(s))}
        if not plan:
            return updated
        return updated.with_changes(body=self._wrap_block(list(original.body), list(updated.body), plan.get))


class MainProcessFirstRule(_StatementRule):
    """Dataset preparation runs under ``with _nbddp.main_process_first():``.

    ``load_dataset``, ``dataset.map(...)`` (tokenization) and ``.filter(...)`` write cache files; run by every
    rank at once they race on the same files. Under the guard the first process of each machine prepares
    and caches, the others wait and then read the cache.
    """

    check = checks.MainProcessFirst

    def picks(self, stmt) -> bool:
        return stmt in self.facts.main_first

    def block(self, run):
        return cst.With(items=[cst.WithItem(_expression(MAIN_FIRST_EXPR))], body=cst.IndentedBlock(body=self.inside(run)))

    def message(self, run) -> str:
        return "dataset preparation: the first process of each machine runs it first, the others read its cache"


class RankZeroRule(_StatementRule):
    """Saving, pushing, generating, printing and plotting after training run on rank 0 only.

    After the last training call notebooks save, push, print statistics and generate; run by every rank
    these would write the same files at once, push twice and print once per GPU. Wrapped in
    ``if _nbddp.is_main_process():`` they happen once. What every rank must still run stays outside: a
    collective such as ``trainer.evaluate()`` or a second ``trainer.train()``, and any statement binding a
    name that such code reads. Between two training calls only the statements that save, print, push,
    generate or plot go under the guard. In a plain PyTorch notebook the tail first unwraps the DDP model,
    since rank 0 alone cannot run a DDP forward (it would wait for the others). Before training, a save
    whose files a later statement reads (``save_pretrained("base")``, then ``from_pretrained("base")``) goes
    under the guard too, followed by ``_nbddp.barrier()``: the other ranks read only complete files.
    """

    check = checks.RankZero

    def picks(self, stmt) -> bool:
        return stmt in self.facts.rank0

    def visit_Module(self, node: cst.Module) -> bool:
        for stmt in node.body:
            if (reason := self.facts.all_ranks.get(self.statement(stmt))) is not None:
                self.note(stmt, f"stays on every rank: {reason}")
        return False

    def block(self, run):
        unwrap = []
        if self.facts.plain_loop and self.statement(run[0]) in self.facts.tail:
            models = sorted(self.facts.ddp_models & self.facts.module_names)
            unwrap = [cst.parse_statement(f"{n} = _nbddp.unwrap({n})\n") for n in models]
        return cst.If(test=_expression(MAIN_PROCESS_EXPR), body=cst.IndentedBlock(body=unwrap + self.inside(run)))

    def after(self, run):
        if any(self.statement(s) in self.facts.shared_saves for s in run):
            return [_statement("_nbddp.barrier()  # the other ranks read what rank 0 wrote\n")]
        return []

    def message(self, run) -> str:
        if any(self.statement(s) in self.facts.shared_saves for s in run):
            return "runs on rank 0 only, and every rank waits for it (a later cell reads what it writes)"
        tail = self.statement(run[0]) in self.facts.tail
        return "runs on rank 0 only (" + ("after training)" if tail else "between training runs)")


class DeviceMapRule(Rule):
    """Model loaders load onto this rank's device.

    ``from_pretrained`` with ``device_map="auto"``/``"balanced"``/``"sequential"`` splits one model over all
    GPUs; ``"cuda:0"``, ``{"": 0}`` or none at all put every rank's copy on GPU 0 (Unsloth's default is
    ``"sequential"``). Under DDP each rank holds a whole model on its own GPU, so every model loader gets
    ``device_map=_nbddp.device_map()`` (``{"": local_rank}``, or the CPU without GPUs): ``AutoModel*``,
    ``*ForCausalLM``, ``AutoPeftModel*``, ``PeftModel`` and Unsloth's ``Fast*Model``. Tokenizers,
    processors and configs are left alone. A call with ``**kwargs`` is left alone too (the key may be in them).
    """

    check = checks.DeviceMap

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.Call:
        if not is_model_loader(updated):
            return updated
        loader = dotted_name(updated.func) or "from_pretrained"
        if _has_star_kwargs(updated) and not has_keyword(updated, "device_map"):
            self.note(original, f"{loader}: has **kwargs, left alone; pass device_map=_nbddp.device_map() yourself")
            return updated
        new, old = _set_keyword(updated, "device_map", _expression(DEVICE_MAP_EXPR))
        was = f"device_map={old}" if old is not None else "no device_map"
        self.note(original, f"{loader}: {was} → this rank's device")
        return new


class DeviceRule(Rule):
    """An explicit first GPU becomes this rank's device.

    ``"cuda:0"`` (in ``torch.device("cuda:0")``, ``.to("cuda:0")``, ``device="cuda:0"``), ``.cuda(0)`` and
    ``torch.cuda.set_device(0)`` would put every rank on GPU 0; they become ``_nbddp.device()``. A bare
    ``"cuda"`` and ``.cuda()`` already mean the current device, which ``_nbddp.setup()`` made this rank's.
    ``os.environ["CUDA_VISIBLE_DEVICES"] = …`` is dropped: torchrun gives each rank its GPU, and CUDA is
    already initialised when the notebook's code runs.
    """

    check = checks.Device

    def __init__(self, facts, chunk):
        super().__init__(facts, chunk)
        self._in_device_map = 0  # DeviceMapRule owns device_map values

    def visit_Arg(self, node: cst.Arg) -> None:
        self._in_device_map += is_name(node.keyword, "device_map")

    def leave_Arg(self, original: cst.Arg, updated: cst.Arg) -> cst.Arg:
        self._in_device_map -= is_name(original.keyword, "device_map")
        return updated

    def leave_SimpleString(self, original: cst.SimpleString, updated: cst.SimpleString) -> cst.BaseExpression:
        value = _string_value(updated)
        if self._in_device_map or value is None or not CUDA_INDEX.match(value):
            return updated
        self.note(original, f"{value!r} → this rank's device")
        return _expression(DEVICE_EXPR)

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.Call:
        name = dotted_name(updated.func) or ""
        is_cuda = is_attribute(updated.func, "cuda")
        if (name == "torch.cuda.set_device" or is_cuda) and len(updated.args) == 1 and isinstance(
            updated.args[0].value, cst.Integer
        ):
            self.note(original, f"{code_of(original)} → this rank's device")
            return updated.with_changes(args=[updated.args[0].with_changes(value=_expression(DEVICE_EXPR))])
        return updated

    def leave_SimpleStatementLine(self, original, updated):
        if len(updated.body) == 1 and _environ_key(updated.body[0]) == "CUDA_VISIBLE_DEVICES":
            self.note(original, "CUDA_VISIBLE_DEVICES dropped: torchrun gives each rank its GPU")
            return _statement("pass  # nbddp: CUDA_VISIBLE_DEVICES left to torchrun\n").with_changes(
                leading_lines=updated.leading_lines
            )
        return updated


class AutocastRule(Rule):
    """``torch.cuda.amp.autocast(...)`` → ``torch.amp.autocast("cuda", ...)``, likewise ``GradScaler``.

    The ``torch.cuda.amp`` spellings are deprecated (a FutureWarning from every rank, every step) and go
    away in later torch releases; ``torch.amp`` takes the device type first. The old ``autocast``'s positional
    arguments (``enabled``, ``dtype``, ``cache_enabled``) become keywords, since ``torch.amp.autocast`` orders
    them differently. ``from torch.cuda.amp import autocast`` becomes ``from torch.amp import autocast``.
    """

    check = checks.Autocast
    _AUTOCAST_POSITIONAL = ("enabled", "dtype", "cache_enabled")

    def _modern(self, original: cst.Call, updated: cst.Call, kind: str) -> cst.Call:
        args = list(updated.args)
        if kind == "autocast":
            args = [
                a.with_changes(keyword=cst.Name(self._AUTOCAST_POSITIONAL[i]), equal=cst.AssignEqual(
                    whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace("")))
                if a.keyword is None and not a.star and i < len(self._AUTOCAST_POSITIONAL) else a
                for i, a in enumerate(args)
            ]
        cuda = cst.Arg(cst.SimpleString('"cuda"'), comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")) if args else cst.MaybeSentinel.DEFAULT)
        self.note(original, f"torch.cuda.amp.{kind}(…) → torch.amp.{kind}(\"cuda\", …)")
        func = updated.func if isinstance(updated.func, cst.Name) else _expression(f"torch.amp.{kind}")
        return updated.with_changes(func=func, args=[cuda] + args)

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.Call:
        name = dotted_name(updated.func) or ""
        for kind in ("autocast", "GradScaler"):
            if name == f"torch.cuda.amp.{kind}" or name in self.facts.cuda_amp_names and name == kind:
                return self._modern(original, updated, kind)
        return updated

    def leave_ImportFrom(self, original: cst.ImportFrom, updated: cst.ImportFrom) -> cst.ImportFrom:
        if updated.module is not None and dotted_name(updated.module) == "torch.cuda.amp":
            self.note(original, "from torch.cuda.amp → from torch.amp")
            return updated.with_changes(module=_expression("torch.amp"))
        return updated


class TrainerConfigRule(Rule):
    """Trainer configurations get DDP-safe settings the user did not set; values the user set are kept.

    - ``ddp_find_unused_parameters=False`` where the notebook trains a PEFT adapter (``JobFacts.peft``): the
      HF Trainer turns it on for every model that is not a plain ``PreTrainedModel`` (every PEFT model),
      which costs an extra graph traversal each step and, with reentrant gradient checkpointing, fails with
      "marked as ready twice". LoRA adapters are all used in every step, so ``False`` is right there. A full
      fine-tune keeps the Trainer's own choice: its model may skip layers (LayerDrop) or leave heads unused,
      where ``False`` fails at the first step that skips one.
    - ``log_on_each_node=False``: logs come from global rank 0 only, not once per machine.
    - ``gradient_checkpointing_kwargs={"use_reentrant": False}`` when ``gradient_checkpointing=True``:
      reentrant checkpointing and DDP's reducer do not mix.

    A value the user wrote is never replaced; where it is not the DDP-safe one the change list says so. A
    call with ``**kwargs`` gets nothing added (the keys may be in them, and a duplicate would fail).
    """

    check = checks.TrainerConfig
    _UNUSED = ("ddp_find_unused_parameters", "False", "a PEFT model: every LoRA weight trains each step")
    _LOGS = ("log_on_each_node", "False", "logs from rank 0 only")

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.Call:
        config = last_name(updated.func)
        if config not in TRAINER_CONFIGS:
            return updated
        if _has_star_kwargs(updated):
            advice = "set ddp_find_unused_parameters=False yourself" if self.facts.peft else "set log_on_each_node=False yourself"
            self.note(original, f"{config}: has **kwargs, left alone; {advice}")
            return updated
        settings = [self._UNUSED, self._LOGS] if self.facts.peft else [self._LOGS]
        checkpointing = keyword(updated, "gradient_checkpointing")
        if checkpointing is not None and is_name(checkpointing.value, "True"):
            settings.append(("gradient_checkpointing_kwargs", '{"use_reentrant": False}', "DDP needs non-reentrant checkpointing"))
        for key, value, why in settings:
            given = keyword(updated, key)
            if given is None:
                updated, _ = _set_keyword(updated, key, _expression(value))
                self.note(original, f"{config}: {key}={value} ({why})")
            elif code_of(given.value) != value:
                self.note(original, f"{config}: kept {key}={code_of(given.value)} as written (DDP-safe: {value})")
        return updated


class DistributedSamplerRule(Rule):
    """Plain PyTorch: a training ``DataLoader`` gets a ``DistributedSampler``; ``shuffle`` moves into it.

    Without it every rank would read the whole data set in the same order, so DDP would average identical
    gradients: no speed-up. ``DataLoader(ds, shuffle=True)`` becomes
    ``DataLoader(ds, sampler=_nbddp.distributed_sampler(ds, shuffle=True))`` (a DataLoader refuses both a
    sampler and ``shuffle``). Loaders that shuffle or are named as training loaders get one; validation and
    test loaders stay whole on every rank so their metrics are the full set's. A loader with its own
    ``sampler``/``batch_sampler`` is left alone.
    """

    check = checks.DistributedSampler

    def __init__(self, facts, chunk):
        super().__init__(facts, chunk)
        self._assigned: dict[cst.Call, list[str]] = {}  # a call assigned to names → those names
        self._preparing = 0  # inside ``accelerator.prepare(…)``

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
        helper = [t for t in self._assigned.get(original, []) if t in self.facts.helper_loaders]
        if helper and last_name(updated.func) != "DataLoader":
            self.note(original, f"{helper[0]}: a helper's loader, sharded when it runs where it is a plain DataLoader "
                                "(else said then)")
            name = cst.Arg(cst.SimpleString(repr(helper[0])), keyword=cst.Name("name"), equal=cst.AssignEqual(
                whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace("")))
            first = cst.Arg(updated, comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
            return cst.Call(func=_expression("_nbddp.shard_loader"), args=[first, name])
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
        # ``shuffle=shuffle`` in a loader factory: a training loader when it shuffles, else whole
        depends = shuffle is not None and _decided_at_run_time(shuffle.value) and not loader_shards(
            own, None, targets, self.facts.train_iterated)
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
            new, _ = _set_keyword(updated.with_changes(args=args), "sampler", sampler)
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
        return updated.with_changes(args=args)


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
    return not any(isinstance(n, cst.Call) for n in _walk(value))


def _walk(node: cst.CSTNode):
    yield node
    for child in node.children:
        yield from _walk(child)



class _Loaders(cst.CSTVisitor):
    """Loaders a loop body uses: iterated (``for b in train_loader``) or handed to a function (``fit(train_loader)``)."""

    def __init__(self, facts: JobFacts):
        self.facts, self.found = facts, []

    def _add(self, name: str | None) -> None:
        if name and name not in self.found:
            self.found.append(name)

    def visit_For(self, node: cst.For) -> None:
        name = _loader_name(node.iter)
        if name in self.facts.accelerate_prepared:  # Accelerate sets its loaders' epochs itself
            return
        if name in self.facts.whole_loaders:  # no DistributedSampler: set_epoch would reshuffle nothing
            return
        if name and (name in self.facts.sharded_loaders or "loader" in name.lower()):
            self._add(name)

    def visit_Arg(self, node: cst.Arg) -> None:
        if isinstance(node.value, cst.Name) and node.value.value in self.facts.sharded_loaders:
            self._add(node.value.value)

    def visit_FunctionDef(self, node) -> bool:
        return False

    def visit_If(self, node: cst.If) -> bool:
        return not is_dead_if(node)


class SetEpochRule(Rule):
    """Plain PyTorch: each epoch loop calls ``set_epoch`` on the DistributedSamplers it reads from.

    A ``DistributedSampler`` shuffles with a seed plus its epoch; without ``set_epoch(epoch)`` every epoch
    sees the same order. The innermost loop over epochs (a ``for`` whose body reads a loader, other than
    the loop over the loader itself) starts with ``_nbddp.set_epoch(loader, epoch)``, which does nothing
    for a loader without such a sampler.
    """

    check = checks.SetEpoch

    def __init__(self, facts, chunk):
        super().__init__(facts, chunk)
        self._done = [False]  # per open loop: whether a loop inside it already got set_epoch

    def visit_For(self, node: cst.For) -> None:
        self._done.append(False)

    def leave_For(self, original: cst.For, updated: cst.For) -> cst.For:
        inner = self._done.pop()
        if inner:
            self._done[-1] = True
            return updated
        if not isinstance(original.target, cst.Name):
            return updated
        finder = _Loaders(self.facts)
        original.body.visit(finder)
        loaders = [name for name in finder.found if name != _loader_name(original.iter)]
        if not loaders:
            return updated
        epoch = original.target.value
        calls = [cst.parse_statement(f"_nbddp.set_epoch({name}, {epoch})\n") for name in loaders]
        body = updated.body
        if isinstance(body, cst.IndentedBlock):
            body = body.with_changes(body=calls + list(body.body))
        else:  # for epoch in range(n): fit(loader)
            body = body.with_changes(body=[c.body[0] for c in calls] + list(body.body))
        self.note(original, f"each epoch reshuffles {', '.join(loaders)}'s DistributedSampler (set_epoch({epoch}))")
        self._done[-1] = True
        return updated.with_changes(body=body)


class UnwrapRule(Rule):
    """Plain PyTorch: saving and loading a DDP-wrapped model goes through ``_nbddp.unwrap(model)``.

    ``DistributedDataParallel`` prefixes every state-dict key with ``module.``; a checkpoint saved from the
    wrapper would not load into the notebook's plain model (and ``torch.save(model)`` would pickle the
    wrapper). ``model.state_dict()``, ``model.load_state_dict(…)`` and ``torch.save(model, …)`` use the
    module inside.
    """

    check = checks.Unwrap

    def _unwrapped(self, name: cst.Name) -> cst.Call:
        return cst.parse_expression(f"_nbddp.unwrap({name.value})")

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.Call:
        models = self.facts.ddp_models
        func = updated.func
        if is_attribute(func, "state_dict", "load_state_dict") and is_name(func.value) and func.value.value in models:
            self.note(original, f"{func.value.value}.{func.attr.value}: the module inside DDP")
            return updated.with_changes(func=func.with_changes(value=self._unwrapped(func.value)))
        if dotted_name(func) == "torch.save" and updated.args and is_name(updated.args[0].value) and updated.args[0].value.value in models:
            self.note(original, f"torch.save({updated.args[0].value.value}): the module inside DDP")
            first = updated.args[0]
            return updated.with_changes(args=[first.with_changes(value=self._unwrapped(first.value))] + list(updated.args[1:]))
        return updated


class LoopOutputRule(Rule):
    """Plain PyTorch: inside the training loop, metrics are printed and checkpoints saved by rank 0 only.

    The notebook's own loop runs on every rank; its ``print(f"epoch {e} loss …")`` would come once per GPU
    and ``torch.save(…, "best.pt")`` would have every rank write the same file at once. In the statements
    that train and in the functions that train, ``print`` becomes ``_nbddp.print0`` and a ``torch.save``
    statement gets ``if _nbddp.is_main_process():`` on its own line.
    """

    check = checks.LoopOutput

    def __init__(self, facts, chunk):
        super().__init__(facts, chunk)
        self._training: set[cst.CSTNode] = set()
        self._depth = 0

    def visit_Module(self, node: cst.Module) -> None:
        self._training = {s for s in node.body if self.statement(s) in self.facts.loops}

    def _trains(self, node: cst.CSTNode) -> bool:
        return node in self._training or (
            isinstance(node, cst.FunctionDef) and node.name.value in self.facts.training_functions
        )

    def on_visit(self, node: cst.CSTNode) -> bool:
        if self._trains(node):
            self._depth += 1
        return super().on_visit(node)

    def on_leave(self, original, updated):
        result = super().on_leave(original, updated)
        if self._trains(original):
            self._depth -= 1
        return result

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.Call:
        if self._depth and is_name(updated.func, "print"):
            self.note(original, "print → _nbddp.print0 (rank 0 prints)")
            return updated.with_changes(func=_expression("_nbddp.print0"))
        return updated

    def leave_SimpleStatementLine(self, original, updated):
        if self._depth and len(updated.body) == 1 and _is_torch_save(updated.body[0]):
            self.note(original, "torch.save in the training loop: rank 0 saves")
            return cst.If(
                test=_expression(MAIN_PROCESS_EXPR),
                body=cst.SimpleStatementSuite(body=list(updated.body), trailing_whitespace=updated.trailing_whitespace),
                leading_lines=updated.leading_lines,
            )
        return updated


#: Rules on top-level statements, applied one after the other on the nodes the facts hold.
STATEMENT_RULES: tuple[type[Rule], ...] = (MainProcessFirstRule, RankZeroRule, DDPWrapRule)
#: Rules on expressions and loops, applied together in one walk over each cell.
EXPRESSION_RULES: tuple[type[Rule], ...] = (
    DeviceMapRule,
    DeviceRule,
    AutocastRule,
    TrainerConfigRule,
    DistributedSamplerRule,
    SetEpochRule,
    UnwrapRule,
    LoopOutputRule,
)
#: Every rule, in the order it is applied.
RULES: tuple[type[Rule], ...] = STATEMENT_RULES + EXPRESSION_RULES
#: The rule each check is for.
RULE_OF: dict[type[checks.Check], type[Rule]] = {rule.check: rule for rule in RULES}


class _Together(cst.CSTTransformer):
    """Several rules in one walk: each node is offered to each rule in turn, as if each walked alone.

    A rule's ``leave`` gets the node as the rules before it left it; once a rule turns a node into another
    kind (a statement into an ``if``), the rules after it leave that node alone. Walks are what conversion
    time goes to, so the expression rules share one.
    """

    def __init__(self, rules: list[Rule], skip: set[cst.CSTNode] = frozenset(),
                 only: dict[cst.CSTNode, list[Rule]] | None = None):
        super().__init__()
        self.rules, self.skip, self.only = rules, skip, only or {}
        self._stack: list[list[Rule]] = []  # the rules that saw each node being walked

    def on_visit(self, node: cst.CSTNode) -> bool:
        # a node in ``only`` is walked by those rules, any other by its parent's; every rule that sees a node
        # sees it leave (its bookkeeping stays balanced); a skipped statement's inside is not walked
        if type(node) in _TRIVIA:
            self._stack.append([])
            return False
        rules = self.only.get(node, self._stack[-1] if self._stack else self.rules)
        self._stack.append(rules)
        walk = all([rule.on_visit(node) is not False for rule in rules]) and node not in self.skip
        if walk and type(node) is cst.Arg and type(node.value) in _LEAVES:
            # ``lr=2e-4``: walked only if a rule reads such a value itself (DeviceRule reads strings)
            return any(rule.reads(node.value) for rule in rules)
        return walk

    def on_leave(self, original, updated):
        for rule in self._stack.pop():
            if type(updated) is not type(original):
                break
            updated = rule.on_leave(original, updated)
        return updated

    def on_visit_attribute(self, node: cst.CSTNode, attribute: str) -> None:
        pass  # as in ``Rule``: no rule has attribute methods

    def on_leave_attribute(self, original: cst.CSTNode, attribute: str) -> None:
        pass


class UnreadableCode(Exception):
    """libcst cannot parse statements that Python's parser read: at a line of the cleaned cell."""

    def __init__(self, message: str, line: int):
        super().__init__(message)
        self.message, self.line = message, line


class _Chunk:
    """Consecutive top-level statements of a cell, parsed with libcst together, as the rules leave them.

    ``statement_of`` maps the chunk's top-level nodes to the notebook's statements: the nodes as parsed,
    and those a rule rebuilt or copied and kept at the top level.
    """

    def __init__(self, cell: CellCode, statements: list[Statement], facts: JobFacts,
                 plan: checks.Plan | None = None):
        self.cell, self.statements = cell, statements
        self.first = statements[0].first  # its first line in the cell
        nxt = statements[-1].index + 1
        self.end = cell.statements[nxt].first if nxt < len(cell.statements) else len(cell.lines) + 1
        self.code: str | None = "".join(cell.lines[self.first - 1 : self.end - 1])
        #: a stand-in's name → the text it stands for (lines of statements, or keyword arguments)
        self.stood_in: dict[str, str] = {}
        read = self._with_stand_ins(plan) if plan is not None else self.code
        try:
            module = cst.parse_module(read)
        except cst.ParserSyntaxError as exc:
            raise UnreadableCode(exc.message, self.first + exc.raw_line - 1) from None
        if len(module.body) != len(statements):  # grouping statements by line went wrong: a bug, say so
            raise AssertionError(f"libcst read {len(module.body)} statements where ast read {len(statements)}")
        # a block a rule adds takes the cell's indentation, not whatever this piece of it would suggest
        self.module = module.with_changes(default_indent=cell.default_indent)
        self.parsed = self.module
        self.statement_of: dict[cst.CSTNode, Statement] = dict(zip(module.body, statements))
        self.wraps_inside = {
            line: names for (position, line), names in facts.ddp_wrap_inside.items()
            if position == cell.position and self.first <= line < self.end
        }
        self._lines: dict[cst.CSTNode, int] | None = None

    def _with_stand_ins(self, plan: checks.Plan) -> str:
        """The chunk's code as libcst reads it: stand-ins for what no rule reads (``checks.Plan``).

        A statement of ``plan.stand_ins`` (a simple one, which a statement rule only moves into a block)
        becomes one line that names it; what a rule does to that line, ``restore`` does to the statement's
        lines, as libcst would have (``_indented``). A statement inside a block that no rule changes
        (``plan.inner``) becomes such a line at its own indentation, and a run of keyword arguments no rule
        reads (``plan.arguments``) becomes ``_nbddp_arg_N_=0``; both come back as written. libcst's price is
        for each character it reads: a stand-in is a few.
        """
        lines, out, at = self.cell.lines, [], self.first
        for stmt in self.statements:
            if stmt not in plan.stand_ins and stmt not in plan.arguments and stmt not in plan.inner:
                continue
            last = max(node.end_lineno for node in stmt.nodes)
            out += lines[at - 1 : stmt.first - 1]
            if stmt in plan.stand_ins:
                out.append(self._stand_in("".join(lines[stmt.first - 1 : last]), len(stmt.nodes)))
            else:
                out += self._inside_stood_in(stmt.first, last, plan.arguments.get(stmt, ()), plan.inner.get(stmt, ()))
            at = last + 1
        return "".join(out + lines[at - 1 : self.end - 1])

    def _stand_in(self, text: str, statements: int) -> str:
        """The line standing in for ``text`` (lines of ``statements`` statements at its indentation)."""
        indent = text[: len(text) - len(text.lstrip(" \t"))]
        name = f"_nbddp_stands_in_{len(self.stood_in)}_"
        self.stood_in[name] = text
        return indent + "; ".join([name] * statements) + "\n"  # as many statements as libcst counts

    def _inside_stood_in(self, first: int, last: int, runs, groups) -> list[str]:
        """Lines ``first``…``last`` of the cell with a stand-in for each run of arguments and each run of
        statements inside a block (ast columns are bytes)."""
        raw = [self.cell.line_bytes(n) for n in range(first, last + 1)]
        starts = [0]
        for line in raw:
            starts.append(starts[-1] + len(line))
        at = lambda line, col: starts[line - first] + col  # noqa: E731
        spans = [(at(r[0].lineno, r[0].col_offset), at(r[-1].end_lineno, r[-1].end_col_offset), None) for r in runs]
        for group in groups:  # whole lines
            start = getattr(group[0], "decorator_list", None) and group[0].decorator_list[0] or group[0]
            spans.append((at(start.lineno, 0), at(max(n.end_lineno for n in group) + 1, 0), 1))
        text = b"".join(raw)
        for a, b, statements in sorted(spans, reverse=True):  # from the end, so the earlier offsets hold
            if statements is None:
                name = f"_nbddp_arg_{len(self.stood_in)}_"
                self.stood_in[name] = text[a:b].decode()
                text = text[:a] + f"{name}=0".encode() + text[b:]
            else:
                text = text[:a] + self._stand_in(text[a:b].decode(), statements).encode() + text[b:]
        return text.decode().splitlines(keepends=True)

    def restore(self, code: str) -> str:
        """Code of (part of) the chunk with its stand-ins replaced by what they stand for."""
        if not self.stood_in:
            return code
        # (a name this chunk did not make is left as it is)
        code = _STAND_IN.sub(lambda m: self._back(self.stood_in[m.group(2)], m.group(1)) if m.group(2) in self.stood_in
                             else m.group(0), code)
        return _ARGUMENT.sub(lambda m: self.stood_in.get(m.group(1), m.group(0)), code)

    @staticmethod
    def _back(text: str, indent: str) -> str:
        """Stood-in lines, at the indentation their stand-in came back at."""
        own = text[: len(text) - len(text.lstrip(" \t"))]
        if indent == own:
            return text
        if own:  # only a top-level statement is moved into a block (``checks.plan_cell``)
            raise AssertionError(f"a statement inside a block was moved: {text!r}")
        return _indented(text, indent)

    def line_in_current(self, line: int) -> int:
        """A line of the module's own code as a line of ``current()``: a stand-in above it is as many lines
        as what it stands for."""
        if not self.stood_in:
            return line
        return len(self.restore("".join(self.module.code.splitlines(keepends=True)[: line - 1])).splitlines()) + 1

    def current(self) -> str:
        if self.code is None:
            self.code = self.restore(self.module.code)
        return self.code

    def wrap_inside(self, node: cst.CSTNode) -> list[str] | None:
        """The models DDP wraps right after a statement inside a block (``JobFacts.ddp_wrap_inside``)."""
        if self._lines is None:  # positions cost a pass over the chunk: only where the facts put a wrap
            positions = MetadataWrapper(self.parsed, unsafe_skip_copy=True).resolve(PositionProvider)
            self._lines = {n: p.start.line + self.first - 1 for n, p in positions.items()
                           if isinstance(n, cst.BaseStatement)}
        line = self._lines.get(node)
        return self.wraps_inside.get(line) if line is not None else None


#: A stand-in's line as libcst writes it back, at whatever indentation a rule gave it.
_STAND_IN = re.compile(r"^([ \t]*)(_nbddp_stands_in_\d+_)(?:; \2)*\n", re.M)
#: A keyword argument's stand-in.
_ARGUMENT = re.compile(r"(_nbddp_arg_\d+_)=0")


def _indented(text: str, indent: str) -> str:
    """A top-level simple statement's lines, indented as libcst indents the statement inside a block.

    libcst indents every line of it, blank lines and comments inside brackets too, except the lines inside
    a multi-line string and those after a backslash that continues the line. (A multi-line f-string is
    never stood in for: libcst indents the lines inside its replacement fields.)
    """
    if not indent:
        return text
    lines = text.splitlines(keepends=True)
    keep = set()  # 0-based lines that stay as written
    if '"""' in text or "'''" in text or "\\\n" in text:
        tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))
        # 0-based, the lines after a string's first; and the lines whose end is a comment's
        keep = {row for t in tokens if t.type == tokenize.STRING for row in range(t.start[0], t.end[0])}
        comments = {t.start[0] - 1 for t in tokens if t.type == tokenize.COMMENT}
        keep |= {i + 1 for i, line in enumerate(lines[:-1])
                 if line.endswith("\\\n") and i not in keep and i not in comments}
    return "".join(line if i in keep else indent + line for i, line in enumerate(lines))


def rewrite(cell: CellCode, plan: checks.Plan, facts: JobFacts) -> tuple[str, list[tuple[str, int, str]]]:
    """Run the planned rules over a cell; return its new code and ``(rule, line, message)`` for each change.

    Only the plan's chunks are parsed with libcst; the lines between them stay as they are. The statement
    rules run one by one, then the expression rules together (``_Together``), each step on every chunk of
    the cell as the steps before it left them. A step that notes nothing leaves the cell as it was. Raises
    ``UnreadableCode`` where libcst cannot parse a chunk.
    """
    chunks = [_Chunk(cell, stmts, facts, plan) for stmts in plan.chunks]
    changes: list[tuple[str, int, str]] = []
    for step in plan.steps:
        ran = [_run(step, chunk, plan, facts) for chunk in chunks]
        if any(rule.changes for rules, _ in ran for rule in rules):
            changes += _changes(cell, chunks, [rules for rules, _ in ran])
            for chunk, (_, new) in zip(chunks, ran):
                chunk.module, chunk.code = new, None
    return (_join(cell, chunks) if changes else cell.code), changes


def _run(step: tuple[type[checks.Check], ...], chunk: _Chunk, plan: checks.Plan, facts: JobFacts):
    """One step's rules over one chunk: the rules (with their notes) and the chunk as they leave it."""
    rules = [RULE_OF[check](facts, chunk) for check in step]
    if step[0] in checks.STATEMENT_CHECKS:
        walker = rules[0]
    elif plan.touching is None:  # the chunk's statements none of the rules could change are not walked
        walker = _Together(rules, {n for n, s in zip(chunk.parsed.body, chunk.statements) if s not in plan.walked})
    else:  # each statement is walked by the rules that may change it, if any
        only = {node: [r for r in rules if r.check in plan.touching[s]]
                for node, s in chunk.statement_of.items() if s in plan.touching}
        walker = _Together(rules, {n for n, s in chunk.statement_of.items() if s not in plan.touching}, only)
    return rules, chunk.module.visit(walker)


def _changes(cell: CellCode, chunks: list[_Chunk], ran: list[list[Rule]]) -> list[tuple[str, int, str]]:
    """A step's notes as ``(rule, line, message)``, rule by rule, as if each rule had walked the whole cell.

    A note's line is its node's line in the code as the step found it, mapped back to the cleaned code by
    line alignment, so every change is reported at a line of the cleaned cell.
    """
    current = _join(cell, chunks)
    back = align(cell.code.splitlines(), current.splitlines()) if current != cell.code else None
    located = {}  # (chunk, rule) → the lines of the rule's notes in the current code
    offset, at = 0, 1  # lines of the current code before the chunk; the cell's line after the last chunk
    for k, (chunk, rules) in enumerate(zip(chunks, ran)):
        offset += chunk.first - at
        # as parsed, the chunk's statements start where the cell's do
        spans = None if chunk.module is not chunk.parsed else (
            [s.first - chunk.first + 1 for s in chunk.statements],
            [max(n.end_lineno for n in s.nodes) - chunk.first + 1 for s in chunk.statements],
        )
        for i, rule in enumerate(rules):
            if rule.changes:
                noted = [(node, top) for node, top, _ in rule.changes]
                lines = _note_lines(chunk, noted, spans)
                located[k, i] = [offset + line for line in lines]
        offset += len(chunk.current().splitlines())
        at = chunk.end
    out = []
    for i in range(len(ran[0]) if ran else 0):
        for k, rules in enumerate(ran):
            for (_, _, msg), line in zip(rules[i].changes, located.get((k, i), ())):
                j = back[line - 1] if back is not None and 0 < line <= len(back) else line - 1
                out.append((rules[i].name, (j if j is not None else line - 1) + 1, chunks[k].restore(msg)))
    return out


def _join(cell: CellCode, chunks: list[_Chunk]) -> str:
    """The cell's code: the chunks as the rules left them, the lines between them as they were."""
    out, at = [], 1
    for chunk in chunks:
        out += cell.lines[at - 1 : chunk.first - 1]
        out.append(chunk.current())
        at = chunk.end
    out += cell.lines[at - 1 :]
    return "".join(out)


def _note_lines(
    chunk: _Chunk, noted: list[tuple[cst.CSTNode, int | None]], spans: tuple[list[int], list[int]] | None = None
) -> list[int]:
    """The line of each noted node in the chunk's code as it stands (``spans``: its statements' first and
    last lines, when known).

    libcst's ``PositionProvider`` would generate the whole module's source with positions; instead each
    top-level statement's first line comes from Python's own parser, and a node inside a statement is found
    in the statement's text by its own source, stand-ins restored (the k-th node with the same source is its
    k-th occurrence; a node noted twice is found once). Positions are the fallback when that fails, a
    stand-in above counting as the lines it stands for.
    """
    module, code = chunk.module, chunk.current()
    starts, ends = spans or _statement_spans(module.body, code)
    texts = _statement_texts(code, starts)
    seen: dict[tuple[int, str], int] = {}
    found: dict[cst.CSTNode, int] = {}
    out = []
    for node, top in noted:
        if node in found:
            out.append(found[node])
            continue
        line = None
        if top is not None and (node is module.body[top] or starts[top] == ends[top]):
            line = starts[top]  # the statement itself, or a node in a statement of one line
        elif top is not None:
            if isinstance(node, cst.BaseStatement):  # its comments above are not where it starts
                node_code = chunk.restore(code_of(node.with_changes(leading_lines=[]))).strip()
            else:
                node_code = chunk.restore(code_of(node)).strip()
            nth = seen.get((top, node_code), 0)
            seen[(top, node_code)] = nth + 1
            at = -1
            for _ in range(nth + 1):
                at = texts[top].find(node_code, at + 1)
                if at < 0:
                    break
            if at >= 0:
                line = starts[top] + texts[top].count("\n", 0, at)
        if line is None:
            positions = MetadataWrapper(module, unsafe_skip_copy=True).resolve(PositionProvider)
            line = chunk.line_in_current(positions[node].start.line)
        found[node] = line
        out.append(line)
    return out


def _statement_spans(body: list[cst.BaseStatement], code: str) -> tuple[list[int], list[int]]:
    """The first and last line of each top-level statement of ``body`` in ``code``, from Python's own parser
    (fast)."""
    tree = ast.parse(code)
    starts, ends, k = [], [], 0
    for stmt in body:
        node = tree.body[k]
        decorators = getattr(node, "decorator_list", None)
        starts.append(decorators[0].lineno if decorators else node.lineno)
        k += len(stmt.body) if isinstance(stmt, cst.SimpleStatementLine) else 1
        ends.append(tree.body[k - 1].end_lineno)
    return starts, ends


def _statement_texts(code: str, starts: list[int]) -> list[str]:
    """The source text of each top-level statement starting at ``starts`` (with the comments after it)."""
    lines = code.splitlines(keepends=True)
    starts = starts + [len(lines) + 1]
    return ["".join(lines[a - 1 : b - 1]) for a, b in zip(starts, starts[1:])]
