"""Facts about where statements run: on rank 0 only after training (and saves a later statement reads), on
every rank where a collective needs them, dataset preparation under ``main_process_first``."""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..ast_helpers import DEFS, compound_bodies, dotted_name, first_line, is_compound, is_dead_if, last_name
from ..code import group_lines
from .models import calls_in
from .training import is_collective_call, is_training_call

if TYPE_CHECKING:
    from ..code import CellCode, Statement
    from .job_facts import JobFacts


#: Calls whose effect a person wants once: saving, pushing, generating, printing, plotting, writing files.
_RANK0_ACTIONS = frozenset(
    "save_pretrained save_model save_state save_lora push_to_hub push_to_hub_merged push_to_hub_gguf "
    "save_pretrained_merged save_pretrained_gguf generate fast_generate print pprint display savefig show "
    "imshow plot to_csv to_json to_parquet save".split()
)
#: Calls that write files another rank may read.
_WRITES = frozenset("save_pretrained save_model to_csv to_json to_parquet save_to_disk save_file".split())
#: Calls that read or write shared caches and downloads: dataset preparation. The Hub's downloads lock their cache
#: and Kaggle's (``kagglehub.*_download``) find it filled: rank 0 first, then each rank gets its own path back.
_DATA_PREP = frozenset(
    "load_dataset map filter snapshot_download hf_hub_download dataset_download competition_download model_download "
    "notebook_output_download".split()
)


def plan_after_training(top: list[Statement], first: int, last: int, facts: JobFacts) -> None:
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


#: Calls that wait for every rank, whatever object they are called on (``training_args.distributed_state.
#: wait_for_everyone()``): inside a function the facts cannot tell that object, so such a statement stays on every rank.
_WAITS = frozenset(
    "wait_for_everyone barrier monitored_barrier all_reduce all_gather all_gather_object broadcast "
    "broadcast_object_list reduce_scatter gather_for_metrics".split()
)


def plan_function_bodies(top: list[Statement], facts: JobFacts) -> None:
    """In the body of each function or method that trains (``run_sft.py``'s ``train_function``: load, train,
    save), the statements after its first training call that save, push, generate, print or plot run on rank 0
    only, as between two training calls at the top level: every rank runs the function, the rest of its body
    included. The same exceptions: a statement with a collective in it (or a call that waits for every rank,
    ``_WAITS``), and one binding a name that a later statement of the body run on every rank reads (or a name
    it declares ``global``), stays on every rank.

    Not in a function a top-level rank-0 statement holds (rank 0 alone would reach the guard, where every rank
    gathers under FSDP), nor in a rank-0 statement of a body; not for a plain loop, whose prints and
    ``torch.save`` in training functions ``LoopOutputRule`` leaves to rank 0, and whose model rank 0 alone
    cannot run once sharded."""
    if facts.plain_loop:
        return
    for stmt in top:
        if stmt in facts.rank0:
            continue
        planned = len(facts.rank0_inside) + len(facts.all_ranks_inside)
        for node in stmt.nodes:
            _plan_functions_in(node, stmt.cell, facts)
        if len(facts.rank0_inside) + len(facts.all_ranks_inside) > planned:
            facts.rank0_holders.add(stmt)


def _plan_functions_in(node: ast.stmt, cell: CellCode, facts: JobFacts) -> None:
    """Plan each function in ``node`` (itself, a method of a class, a function in a block), outside ``if False:``
    and outside the statements a body's plan sends to rank 0."""
    if not is_compound(node) or is_dead_if(node):
        return
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _on_lines_of_its_own(node.body, cell):
        guarded = _plan_body(node.body, node.name, cell, facts)
        inner = [n for n in node.body if (cell.position, first_line(n)) not in guarded]
    else:
        inner = [n for body in compound_bodies(node) for n in body]
    for n in inner:
        _plan_functions_in(n, cell, facts)


def _plan_body(body: list[ast.stmt], name: str, cell: CellCode, facts: JobFacts) -> set[tuple[int, int]]:
    """A function's body: what runs on rank 0 after its training call (``plan_after_training``'s reading
    between two trainings, backwards); the places guarded."""
    groups = group_lines(body, cell)
    calls = [sorted(calls_in(g), key=lambda c: (c.lineno, c.col_offset)) for g in groups]
    first = next((k for k, found in enumerate(calls) if any(is_training_call(c, facts) for c in found)), None)
    if first is None:
        return set()
    needed = {n for node in body for sub in ast.walk(node) if isinstance(sub, (ast.Global, ast.Nonlocal))
              for n in sub.names}
    guarded = set()
    for k in range(len(groups) - 1, first, -1):
        binds, reads = _names(groups[k])
        place = (cell.position, first_line(groups[k][0]))
        if any(_is_rank0_action(c) for c in calls[k]):
            wait = next((c for c in calls[k] if is_collective_call(c, facts) or last_name(c.func) in _WAITS), None)
            if wait is not None:
                facts.all_ranks_inside[place] = f"{_func_code(cell, wait)}() needs every rank"
            elif _leaves(groups[k]):
                facts.all_ranks_inside[place] = f"it returns from {name}, which every rank must do alike"
            elif binds & needed:
                facts.all_ranks_inside[place] = f"binds {', '.join(sorted(binds & needed))}, which code on every rank uses"
            else:
                facts.rank0_inside[place] = name
                guarded.add(place)
                continue
        needed |= reads
    return guarded


def _leaves(group: list[ast.stmt]) -> bool:
    """Statements that return from (or yield out of) the function they sit in: guarded, rank 0 alone would take
    that way out while the other ranks ran on to the body's next collective, and waited there."""
    todo = list(group)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Return, ast.Yield, ast.YieldFrom)):
            return True
        if not isinstance(node, (*DEFS, ast.Lambda)):  # a nested function's return is its own
            todo.extend(ast.iter_child_nodes(node))
    return False


def _names(group: list[ast.stmt]) -> tuple[set[str], set[str]]:
    """The names statements bind and those they read (a name deleted or updated in place is read too)."""
    binds, reads = set(), set()
    for node in group:
        for sub in ast.walk(node):
            if isinstance(sub, ast.Name):
                (binds if isinstance(sub.ctx, ast.Store) else reads).add(sub.id)
            elif isinstance(sub, ast.AugAssign) and isinstance(sub.target, ast.Name):
                reads.add(sub.target.id)
            elif isinstance(sub, (*DEFS, ast.ExceptHandler)) and sub.name:
                binds.add(sub.name)
            elif isinstance(sub, ast.alias) and sub.name != "*":
                binds.add(sub.asname or sub.name.split(".")[0])
            elif isinstance(sub, (ast.MatchAs, ast.MatchStar)) and sub.name:
                binds.add(sub.name)
    return binds, reads


def _on_lines_of_its_own(body: list[ast.stmt], cell: CellCode) -> bool:
    """A body below its header (``def f(): return 1`` has none to put a block in)."""
    line = cell.lines[body[0].lineno - 1]
    return len(line.encode()) - len(line.lstrip().encode()) == body[0].col_offset


def plan_tail_unwraps(after: list[Statement], facts: JobFacts) -> None:
    """Plain PyTorch: which rank-0 blocks of the tail (``after``: the statements after the last training call)
    unwrap the DDP models first, since rank 0 alone cannot run a DDP forward (it would wait for the others).

    Unwrapping is idempotent and nothing wraps after the last training, so the first block does it for the
    whole tail; a later block does it again only for a model some statement since rebinds (``model =
    models[best]`` may give a wrapper again). A block is a run of consecutive rank-0 statements of one cell,
    as ``RankZeroRule`` guards them.
    """
    pending = facts.wrapped_whole & facts.module_names
    models = set(pending)
    opening = {run[0] for run in rank0_runs(after, facts.tail)}
    for stmt in after:
        if stmt in opening and pending:
            facts.tail_unwraps[stmt] = sorted(pending)
            pending = set()
        pending |= stmt.binds & models


def rank0_runs(top: list[Statement], rank0: set[Statement]) -> list[list[Statement]]:
    """Runs of consecutive rank-0 statements of one cell: each becomes one ``if _nbddp.on_rank0():``
    block (``rules.rank_zero``)."""
    runs: list[list[Statement]] = []
    for stmt in top:
        if stmt not in rank0:
            continue
        last = runs[-1][-1] if runs else None
        if last is not None and last.cell is stmt.cell and last.index == stmt.index - 1:
            runs[-1].append(stmt)
        else:
            runs.append([stmt])
    return runs


def plan_shared_saves(top: list[Statement], first: int, facts: JobFacts, between: list[Statement] = ()) -> None:
    """Side effects before training that the kernel had once run on rank 0, and every rank waits for them:
    a save (``model.save_pretrained("base")``, ``torch.save``, ``to_csv``, ``savefig``), an install run through
    ``os.system``/``subprocess`` (``pip install …``) or a download to a file (``urllib.request.urlretrieve``,
    ``wget.download``, ``gdown.download``). Run by every rank they would write the same files at once (a later
    ``from_pretrained("base")`` could read one half written) or install into the same folders together; after
    the wait every rank finds the files whole: an expression statement, without a collective in it (it binds no
    name another rank needs). Every download before training, in whatever statement, is ``plan_downloads``'.
    Model and dataset loaders, and the downloads that fill a cache (the Hub's, Kaggle's), stay on every rank
    (``plan_data_prep``). ``between``: the statements between two trainings that run on every rank, planned as
    those before the first (a download there was fetched by every rank at once)."""
    functions = _functions(top)
    fetchers = _fetchers(functions)
    for stmt in [*top[:first], *between]:
        if len(stmt.nodes) != 1 or any(is_collective_call(c, facts) for c in stmt.calls):
            continue
        node = stmt.nodes[0]
        if _download_in(stmt, fetchers) is not None:
            continue  # plan_downloads': it may change what rank 0 alone would hold
        if isinstance(node, ast.Expr) and any(_once(c) for c in stmt.calls):
            facts.shared_saves.add(stmt)
            facts.rank0.add(stmt)
    plan_downloads(top, first, facts, functions, fetchers, between)


@dataclass
class Downloads:
    """The downloads ``plan_downloads`` chose (in ``JobFacts.rule_state["rank0"]``, read by ``RankZeroRule``):
    how each statement run on rank 0 downloads, said in the change list (``a loop that downloads``, ``fetch()
    downloads``), and the statements refused → (line in the cell, what is said)."""

    how: dict[Statement, str] = field(default_factory=dict)
    refused: dict[Statement, tuple[int, str]] = field(default_factory=dict)


def downloads(facts: JobFacts) -> Downloads:
    return facts.rule_state.setdefault("rank0", Downloads())


def plan_downloads(top: list[Statement], first: int, facts: JobFacts, functions: dict[str, list[ast.FunctionDef]],
                   fetchers: dict[str, str], between: list[Statement] = ()) -> None:
    """A download before training, or between two (``between``), anywhere in a statement (``for url in urls:
    urlretrieve(url, name)``, a call
    of a function of the notebook that downloads, ``fetch()``, through the notebook's functions it calls): the
    kernel fetched once, so rank 0 runs the whole statement while the other ranks wait, and gets them the names
    it binds, those it grows in place (``files.append(name)``, ``paths[0] = …``) and those its functions declare
    ``global`` (``rank0_sends``). Where rank 0 alone cannot run it, it is refused at the download's line (every
    rank would download at once): a collective in it, an import, function or class it binds (nothing rank 0 can
    send), an attribute it sets or a call that changes an object or the process (``config.path = …``,
    ``model.load_state_dict(…)``, ``os.chdir``), which the other ranks would miss. A statement that trains and
    downloads is refused too: the download goes in a cell before the training."""
    plan = downloads(facts)
    for stmt in [*top[:first], *between]:
        found = _download_in(stmt, fetchers)
        if found is None or stmt in facts.shared_saves:
            continue
        call, what = found
        subject = _subject(stmt)
        refusal = _refusal(stmt, what, facts, functions)
        if refusal is not None:
            plan.refused[stmt] = (call.lineno, f"{subject} downloads ({what}){refusal}, so nbddp cannot run it once "
                                  f"on rank 0, and every rank would download at once: {_OWN_STATEMENT}")
            continue
        sent, _ = _changes(stmt.nodes, set(stmt.binds), functions)
        facts.shared_saves.add(stmt)
        facts.rank0.add(stmt)
        if _downloads(call) and isinstance(stmt.nodes[0], ast.Expr) and len(stmt.nodes) == 1 and not sent:
            continue  # binds nothing: a barrier after it, as after a save
        facts.rank0_sends[stmt] = sorted(stmt.binds | sent)
        if not _assigned_download(stmt):
            plan.how[stmt] = _how(call, subject)
    for stmt in facts.training:
        found = _download_in(stmt, fetchers)
        if found is not None:
            call, what = found
            trainer = call.func.id if isinstance(call.func, ast.Name) and call.func.id in fetchers else None
            subject, what = (f"{trainer}()", fetchers[trainer]) if trainer else (_subject(stmt), what)
            plan.refused[stmt] = (call.lineno, f"{subject} trains, and downloads ({what}) on every rank at once: "
                                  f"{_BEFORE_TRAINING}")


#: The fixes a refusal names.
_OWN_STATEMENT = ("download in a statement of its own before it (path = wget.download(url), or a loop that only "
                  "downloads; nbddp runs that once, on rank 0, and the other ranks wait for it)")
_BEFORE_TRAINING = ("download in a cell before the training (nbddp runs a download there once, on rank 0, and the "
                    "other ranks wait for it)")


def _subject(stmt: Statement) -> str:
    node = stmt.nodes[0]
    if isinstance(node, (ast.For, ast.AsyncFor, ast.While)):
        return "this loop"
    return "this block" if is_compound(node) else "this statement"


def _how(call: ast.Call, subject: str) -> str:
    """How a statement downloads, as the change list says it."""
    if not _downloads(call):
        return f"{_called(call)}() downloads"
    return {"this loop": "a loop that downloads", "this block": "a block that downloads"}.get(subject, "it downloads")


def _assigned_download(stmt: Statement) -> bool:
    """``path = wget.download(url)``: the download rewrite that was there first, said as it was."""
    return len(stmt.nodes) == 1 and _assigns_to_names(stmt.nodes[0]) and any(_downloads(c) for c in stmt.calls)


def _functions(top: list[Statement]) -> dict[str, list[ast.FunctionDef]]:
    """The notebook's top-level functions by name (every definition of a name: a cell may define it again)."""
    found: dict[str, list[ast.FunctionDef]] = {}
    for stmt in top:
        for node in stmt.nodes:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.setdefault(node.name, []).append(node)
    return found


def _fetchers(functions: dict[str, list[ast.FunctionDef]]) -> dict[str, str]:
    """The functions that download, themselves or through another of the notebook's → the download they make
    (``urlretrieve``)."""
    calls = {name: [c for d in defs for c in calls_in(d.body)] for name, defs in functions.items()}
    found: dict[str, str] = {}
    changed = True
    while changed:
        changed = False
        for name, made in calls.items():
            call = next((c for c in made if _downloads(c) or _called(c) in found), None)
            if name not in found and call is not None:
                found[name] = dotted_name(call.func) if _downloads(call) else found[_called(call)]
                changed = True
    return found


def _called(call: ast.Call) -> str | None:
    return call.func.id if isinstance(call.func, ast.Name) else None


def _what(call: ast.Call, fetchers: dict[str, str]) -> str:
    """The download a call makes, as said: its own name, or the one a function of the notebook makes, in it."""
    return dotted_name(call.func) if _downloads(call) else f"{fetchers[_called(call)]}, in {_called(call)}()"


def _download_in(stmt: Statement, fetchers: dict[str, str]) -> tuple[ast.Call, str] | None:
    """The statement's first call that downloads (itself, or a function of the notebook that does), and what."""
    call = next((c for c in stmt.calls if _downloads(c) or _called(c) in fetchers), None)
    return None if call is None else (call, _what(call, fetchers))


def _refusal(stmt: Statement, what: str, facts: JobFacts, functions) -> str | None:
    """Why rank 0 alone cannot run a statement that downloads (said after its download), or None."""
    collective = next((c for c in stmt.calls if is_collective_call(c, facts)), None)
    if collective is not None:
        return f" and calls {_func_code(stmt.cell, collective)}(), which needs every rank"
    _, why = _changes(stmt.nodes, set(stmt.binds), functions, own=True)
    return None if why is None else f", and {why}"


#: Methods that change the list, dict or set they are called on: rank 0 sends that name as the statement ends.
_GROWS = frozenset("append extend insert update add setdefault pop popitem remove discard clear".split())
#: Calls that change the process or an object in place (by their dotted name, or their last name): the other
#: ranks would miss it, and nothing rank 0 sends carries it.
_CHANGES_PROCESS = frozenset({"os.chdir", "os.putenv", "os.environ.update", "os.environ.setdefault",
                              "sys.path.append", "sys.path.insert", "sys.path.extend", "torch.manual_seed",
                              "random.seed", "np.random.seed", "numpy.random.seed"})
_CHANGES_IN_PLACE = frozenset({"load_state_dict", "load_adapter", "set_seed", "seed_everything",
                               "add_tokens", "add_special_tokens", "resize_token_embeddings"})


def _changes(nodes: list[ast.stmt], local: set[str], functions, own: bool = False,
             seen: frozenset[str] = frozenset()) -> tuple[set[str], str | None]:
    """What code run on rank 0 alone changes beyond the names it binds (``local``): the names it grows in place,
    or declares ``global`` in a function, which rank 0 can send; or, where it changes what cannot be sent, why
    (an import, function or class the statement binds, ``own``; an attribute set; a call changing an object or
    the process). The notebook's functions it calls are read too, once each."""
    sent: set[str] = set()
    todo: list[ast.AST] = list(nodes)
    while todo:
        node = todo.pop()
        if own and isinstance(node, (ast.Import, ast.ImportFrom)):
            names = ", ".join(a.asname or a.name.split(".")[0] for a in node.names)
            return sent, f"it imports {names}, which rank 0 cannot send to the other ranks"
        if own and isinstance(node, DEFS):  # pickled by reference, to a name the other ranks never bound
            return sent, f"it defines {node.name}, which rank 0 cannot send to the other ranks"
        if isinstance(node, (*DEFS, ast.Lambda)):  # a function's body runs where it is called
            continue
        if isinstance(node, (ast.Global, ast.Nonlocal)):
            sent |= set(node.names)
        elif isinstance(node, (ast.Attribute, ast.Subscript)) and isinstance(node.ctx, (ast.Store, ast.Del)):
            base = node.value
            if isinstance(node, ast.Subscript) and isinstance(base, ast.Name):
                sent |= {base.id} - local
            elif _base_name(node) not in local:
                return sent, f"it sets {ast.unparse(node)}, which the other ranks would miss"
        elif isinstance(node, ast.Call):
            name = dotted_name(node.func) or ""
            if name in _CHANGES_PROCESS or last_name(node.func) in _CHANGES_IN_PLACE:
                return sent, f"it calls {name or last_name(node.func)}(), whose effect the other ranks would miss"
            if isinstance(node.func, ast.Attribute) and node.func.attr in _GROWS \
                    and isinstance(node.func.value, ast.Name) and node.func.value.id not in local:
                sent.add(node.func.value.id)
            callee = _called(node)
            if callee in functions and callee not in seen:
                seen |= {callee}
                for definition in functions[callee]:
                    more, why = _changes(definition.body, _locals(definition), functions, seen=seen)
                    sent |= more
                    if why is not None:
                        return sent, why if "(in " in why else f"{why} (in {callee}())"
        todo.extend(ast.iter_child_nodes(node))
    return sent, None


def _locals(definition: ast.FunctionDef) -> set[str]:
    """A function's own names: its parameters and what its body binds, but those it declares ``global``."""
    args = definition.args
    params = {a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg] if a}
    declared = {n for node in ast.walk(definition) if isinstance(node, (ast.Global, ast.Nonlocal))
                for n in node.names}
    bound = {n.id for node in definition.body for n in ast.walk(node) if isinstance(n, ast.Name)
             and isinstance(n.ctx, ast.Store)}
    return (params | bound) - declared


def _base_name(node: ast.expr) -> str | None:
    """The name an attribute or item chain starts at (``config`` of ``config.paths[0]``), or None."""
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _assigns_to_names(node: ast.stmt) -> bool:
    """``path = …``, ``path, _ = …``, ``a = b = …``, ``path: str = …``: names only, which rank 0 can send (an
    attribute or an item set on rank 0 alone would be missing on the others)."""
    if isinstance(node, ast.Assign):
        targets = node.targets
    elif isinstance(node, ast.AnnAssign) and node.value is not None:
        targets = [node.target]
    else:
        return False
    return all(isinstance(n, (ast.Name, ast.Tuple, ast.List, ast.Starred, ast.expr_context))
               for target in targets for n in ast.walk(target))


#: Calls that fetch a file from the network into a path.
_DOWNLOADS = frozenset({"urllib.request.urlretrieve", "request.urlretrieve", "urlretrieve", "wget.download",
                        "gdown.download"})
#: Calls that run a shell command or a program: once where they install.
_COMMANDS = frozenset({"os.system", "subprocess.run", "subprocess.call", "subprocess.check_call",
                       "subprocess.check_output", "subprocess.Popen"})


def _once(call: ast.Call) -> bool:
    """A call whose effect the kernel had once: a write, a plot saved, a download, an install."""
    name = dotted_name(call.func) or ""
    if _writes(call) or last_name(call.func) == "savefig" or _downloads(call):
        return True
    return name in _COMMANDS and _installs(call)


def _downloads(call: ast.Call) -> bool:
    return (dotted_name(call.func) or "") in _DOWNLOADS


def _installs(call: ast.Call) -> bool:
    """A command naming ``pip install`` (or ``conda``/``apt-get install``) in its string literals."""
    words = " ".join(n.value for n in ast.walk(call) if isinstance(n, ast.Constant) and isinstance(n.value, str))
    return "install" in words and any(tool in words for tool in ("pip", "conda", "apt", "mamba", "uv"))


def plan_data_prep(top: list[Statement], facts: JobFacts) -> None:
    """Dataset preparation on every rank goes under ``main_process_first`` (cache files are not raced)."""
    training = set(facts.training)
    for stmt in top:
        if stmt in facts.rank0 or stmt in training or isinstance(stmt.nodes[0], DEFS):
            continue
        if is_dead_if(stmt.nodes[0]):
            continue
        if any(_is_data_prep(c) for c in stmt.calls) and not any(is_collective_call(c, facts) for c in stmt.calls):
            facts.main_first.add(stmt)


def _is_rank0_action(call: ast.Call) -> bool:
    name = dotted_name(call.func) or ""
    return last_name(call.func) in _RANK0_ACTIONS or name.startswith(("plt.", "sns."))


def _is_data_prep(call: ast.Call) -> bool:
    name = last_name(call.func)
    if name in ("map", "filter"):
        return isinstance(call.func, ast.Attribute)  # dataset.map(…), not the builtins
    return name in _DATA_PREP or (name or "").startswith("from_") and "Dataset" in (dotted_name(call.func) or "")


def _writes(call: ast.Call) -> bool:
    name = dotted_name(call.func) or ""
    return last_name(call.func) in _WRITES or name in ("torch.save", "np.save", "numpy.save")


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
