"""Assemble the training script: a prelude, every cleaned and rewritten cell, an epilogue, a source map."""

from __future__ import annotations

import ast
import contextlib
import difflib
import gc
from dataclasses import dataclass
from pathlib import Path

from .._version import __version__
from ..cells import Cell, load_notebook
from ..errors import CellError, NotebookError, printable
from ..runtime.sourcemap import SourceMap, map_path
from .clean import CleanCell, Install, bound_names, clean_cell
from .code import CellCode, CodeError
from .engine.plan import plan_cell
from .facts import JobFacts, gather_facts
from .facts.output_targets import OutputTarget, output_targets
from .facts.shape import JobShape, ShapeUnread, shape_of
from .frameworks import check_frameworks
from .launches import Launch, find_launches, leading_launch, seems_to_train
from .lines import align
from .own_training import refuse_own_training
from .refusal import cell_error
from .rules import RULES
from .rules.predict import refuse_batched, refuse_unsplittable


@dataclass(frozen=True)
class Change:
    """One change nbddp made, at a notebook cell and line."""

    cell: int
    line: int
    rule: str
    message: str

    def __str__(self) -> str:
        return f"cell {self.cell}, line {self.line}: {self.message}"


@dataclass(frozen=True)
class Script:
    """The generated script and what it took to make it."""

    text: str
    source_map: SourceMap
    cells: tuple[Cell, ...]
    installs: tuple[Install, ...] = ()
    changes: tuple[Change, ...] = ()
    warnings: tuple[str, ...] = ()
    #: (cell, line) where a plain loop pickles a model DDP wraps whole, and where rank 0 alone runs one after
    #: training (``JobFacts.whole_model_saves``, ``JobFacts.rank0_forwards``): what FSDP cannot run
    whole_model_saves: tuple[tuple[int, int | None], ...] = ()
    rank0_forwards: tuple[tuple[int, int | None], ...] = ()
    #: whether the facts found a training call (a Trainer's ``train()``, a loop's ``backward()`` …); where
    #: none, the shell lines that seem to start the training instead (``launches.find_launches``)
    trains: bool = True
    launches: tuple[Launch, ...] = ()
    #: no training, and prediction loops each rank takes its share of (``facts/predicts.py``): predict mode
    predicts: bool = False
    #: where, with neither, the training seems to be ("cell 4, line 2: model.fit(x)"), or None
    seems: str | None = None
    #: what the launcher reads before launch, read here once from the script's code: the model's shape (the
    #: strategy's choice; ``ShapeUnread`` where reading it slipped) and the folders it writes into
    shape: JobShape | ShapeUnread = JobShape()
    output_targets: tuple[OutputTarget, ...] = ()

    def diff(self) -> str:
        """A unified diff from the notebook's code cells to the script."""
        before = []
        for c in self.cells:
            before += [f"# [cell {c.index}]"] + c.source.splitlines() + [""]
        return "".join(
            difflib.unified_diff(
                [ln + "\n" for ln in before],
                self.text.splitlines(keepends=True),
                fromfile=f"{self.source_map.origin} (code cells)",
                tofile="script.py",
            )
        )

    def write(self, path: str | Path) -> Path:
        """Write the script and its source map (``<path>.map.json``) atomically."""
        from ..runtime.io import atomic_write_text

        path = Path(path)
        atomic_write_text(path, self.text)
        atomic_write_text(map_path(path), self.source_map.to_json())
        return path


def convert_notebook(path: str | Path, *, skip_bad_cells: bool = False, kept_tail: bool = False,
                     every_rank: bool = False) -> Script:
    """Read a notebook with nbformat and convert its code cells (what was repaired to read it: warnings);
    ``kept_tail``, ``every_rank``: as ``convert_cells``'s."""
    with _collector_paused():
        cells, notes = load_notebook(path)
        return convert_cells(cells, origin=Path(path).name, skip_bad_cells=skip_bad_cells, notes=notes,
                             kept_tail=kept_tail, every_rank=every_rank)


@contextlib.contextmanager
def _collector_paused():
    """Python's cyclic garbage collector held off while a notebook converts, then left as it was found.

    A conversion makes tens of thousands of short-lived objects (ast and libcst nodes) that reference
    counting frees; every 700 allocations the collector would still walk the young ones, and now and then
    every object in the process, which in a kernel holding torch and transformers is half a million. Paused,
    conversion takes about a tenth less time (``benchmarks/results/convert_speed.md``); any cycles it left are
    collected at the next collection after it.
    """
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def convert_cells(
    cells: list[Cell], *, origin: str = "<cells>", skip_bad_cells: bool = False, precheck: bool = True,
    notes: tuple[str, ...] = (), launcher_facts: bool = True, kept_cell: bool = False, kept_tail: bool = False,
    every_rank: bool = False,
) -> Script:
    """Clean every cell, apply the rewrite rules, and assemble the script with its source map.

    Raises ``NotebookError`` when there is no code at all, ``CellError`` for a cell that does not parse
    (unless ``skip_bad_cells``). The rules run only on the statements their checks say they may change
    (``engine.plan.plan_cell``); ``precheck=False`` runs them over every statement of every cell they are wanted
    in instead, which gives the same script more slowly (what the checks are tested against). ``notes``:
    warnings from reading the notebook, listed first. ``launcher_facts=False`` leaves out what only a launch
    reads (``Script.shape``, ``Script.output_targets``: one more parse of the whole script), for a kept job's
    ``%%ddp`` cell, which launches nothing. ``kept_cell``: the last cell is such a ``%%ddp`` cell, whose
    statements run on every rank but its writes (``facts/kept.py``), not as code after training; ``kept_tail``:
    the cells of a kept job (``--keep``), whose code after the last training follows that rule too;
    ``every_rank`` (``--every-rank``): a notebook that does not train is left whole, its prediction loops unsplit.
    """
    with _collector_paused():
        return _convert_cells(cells, origin, skip_bad_cells, precheck, notes, launcher_facts, kept_cell, kept_tail,
                              every_rank)


def _convert_cells(cells: list[Cell], origin: str, skip_bad_cells: bool, precheck: bool, notes=(),
                   launcher_facts: bool = True, kept_cell: bool = False, kept_tail: bool = False,
                   every_rank: bool = False) -> Script:
    if not any(c.source.strip() for c in cells):
        raise NotebookError(f"{origin}: no code to convert (the notebook has no code cells, or only empty ones)")
    warnings: list[str] = list(notes)
    cleaned, codes = _clean_cells(cells, skip_bad_cells, warnings)
    check_frameworks(cleaned, codes, kept=kept_cell or kept_tail)  # TensorFlow, JAX, Lightning, Opacus…: refused here
    facts = gather_facts(codes, kept_cell=len(codes) - 1 if kept_cell else None, kept_tail=kept_tail,
                         every_rank=every_rank)
    refuse_own_training(facts, cleaned)  # a loop in a method of the notebook's own class: refused at the call
    refuse_unsplittable(facts, cleaned)  # a prediction loop the ranks cannot split: refused at its cell and line
    launches = find_launches(cells) if facts.last_training is None else ()
    if facts.batched_calls and not launches and seems_to_train(cells) is None:
        refuse_batched(facts, cleaned)  # a batched prediction call with nothing else to run: refused at its line
    if launches:
        warnings.append(f"no training call found in the code; its training is a command it launches ({leading_launch(launches)}): "
                        "nbddp run runs the notebook once and that command on every GPU")
    elif facts.last_training is None and not facts.predictions:
        warnings.append("no training call found (trainer.train(), unsloth_train(…)): nbddp run refuses it unless "
                        "--every-rank (every cell on every rank)")
    changes: list[Change] = []
    body: list[tuple[str, tuple[int, int] | None]] = []  # the script's lines, each with its (cell, line)
    for clean, code in zip(cleaned, codes):
        new_code, rule_changes = _rewrite(clean, code, facts, precheck, warnings, skip_bad_cells)
        changes += _cell_changes(clean, rule_changes)
        body += _cell_lines(clean, new_code if rule_changes else None)

    installs = tuple(i for c in cleaned for i in c.installs)
    prelude = _prelude(origin, changes, installs, warnings)
    if facts.predictions:  # the prediction loops' shares and gathers (rules/predict.py)
        prelude.insert(prelude.index("import nbddp.runtime.capture"), "import nbddp.runtime.predict")
    epilogue = ["# [nbddp] every rank ends here: wait for the others, then leave the process group", "_nbddp.cleanup()"]
    lines = prelude + [text for text, _ in body] + epilogue
    mapping = {n: src for n, (_, src) in enumerate(body, start=len(prelude) + 1) if src is not None}
    text, source_map = "\n".join(lines) + "\n", SourceMap(origin, mapping)
    shape, targets = _launcher_facts(text, source_map) if launcher_facts else (ShapeUnread("not read: no launch"), ())
    return Script(
        text=text,
        source_map=source_map,
        cells=tuple(c.cell for c in cleaned),
        installs=installs,
        changes=tuple(changes),
        warnings=tuple(warnings),
        whole_model_saves=_cell_places(facts.whole_model_saves, cleaned),
        rank0_forwards=_cell_places(facts.rank0_forwards, cleaned),
        trains=facts.last_training is not None,
        predicts=bool(facts.predictions),
        launches=launches,
        seems=seems_to_train(cells) if facts.last_training is None else None,
        shape=shape,
        output_targets=targets,
    )


def _launcher_facts(text: str, source_map: SourceMap) -> tuple[JobShape | ShapeUnread, tuple[OutputTarget, ...]]:
    """The model's shape and the output folders, from one parse of the script as it will run.

    What they read is the user's code and the libraries' conventions, not nbddp's to vouch for: a slip reading
    the shape is carried to the strategy's choice (which falls back, saying why) rather than stopping the
    conversion, and a script Python cannot parse names no folder.
    """
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError, MemoryError, RecursionError) as exc:
        return ShapeUnread(printable(f"{type(exc).__name__}: {exc}")[:300]), ()
    try:
        shape: JobShape | ShapeUnread = shape_of(tree)
    except Exception as exc:  # broad on purpose: see the docstring
        shape = ShapeUnread(printable(f"{type(exc).__name__}: {exc}")[:300])
    return shape, output_targets(tree, source_map)


def _clean_cells(cells: list[Cell], skip_bad_cells: bool, warnings: list[str]) -> tuple[list[CleanCell], list[CellCode]]:
    """Every cell cleaned and read; a cell that cannot be cleaned is the error, or a warning when skipped."""
    cleaned: list[CleanCell] = []
    codes: list[CellCode] = []
    bound: set[str] = set()  # what the cells above bind: it keeps a name IPython's automagic would run Python
    for cell in cells:
        try:
            clean = clean_cell(cell, bound)
        except CellError as exc:
            if not skip_bad_cells:
                raise
            warnings.append(f"skipped {exc}")
            continue
        cleaned.append(clean)
        codes.append(CellCode.read(clean.code, clean.tree, len(codes)))
        bound |= bound_names(codes[-1].tree)
    return cleaned, codes


def _cell_places(places: list[tuple[int, int]], cleaned: list[CleanCell]) -> tuple[tuple[int, int | None], ...]:
    """Places the facts recorded, (cell position, line of the cleaned code), as (cell, line of the cell), in
    the script's order."""
    return tuple((cleaned[k].cell.index, _to_cell(cleaned[k], line - 1)) for k, line in sorted(set(places)))


def _to_cell(clean: CleanCell, j: int | None) -> int | None:
    """The cell's line (1-based) of line ``j`` (0-based) of the cleaned code, or None."""
    return clean.line_map[j] if j is not None and j < len(clean.line_map) else None


def _cell_changes(clean: CleanCell, rule_changes: list[tuple[str, int, str]]) -> list[Change]:
    """What the cleaner and the rules changed in a cell, at the cell's lines."""
    index = clean.cell.index
    out = [Change(index, note.line, "ipython", note.message) for note in clean.notes]
    for rule, line, message in sorted(rule_changes, key=lambda c: c[1]):
        out.append(Change(index, _to_cell(clean, line - 1) or 1, rule, message))
    return out


def _cell_lines(clean: CleanCell, new_code: str | None) -> list[tuple[str, tuple[int, int] | None]]:
    """A cell's lines in the script, each with the (cell, line) it comes from: the rewritten code, aligned with
    the cleaned code, or (``new_code`` None: no rule changed the cell) the cleaned code, line for line."""
    index = clean.cell.index
    if new_code is not None:
        code_lines = new_code.splitlines()
        back = align(clean.code.splitlines(), code_lines)
    else:
        code_lines = clean.code.splitlines()
        back = list(range(len(code_lines)))
    out: list[tuple[str, tuple[int, int] | None]] = [(f"# [cell {index}]", None)]
    if clean.capture:  # %%capture: the cell's output kept from the console, between these two calls
        out.append((f"_nbddp.capture.begin({clean.capture[1]!r})", (index, clean.capture[0])))
    for text, j in zip(code_lines, back):
        src = _to_cell(clean, j)
        out.append((text, (index, src) if src is not None else None))
    if clean.capture:
        name = next((a for a in clean.capture[1].split() if not a.startswith("-")), None)
        out.append((f"{name} = _nbddp.capture.end()" if name else "_nbddp.capture.end()", (index, clean.capture[0])))
    out.append(("", None))
    return out


def _rewrite(
    clean: CleanCell, code: CellCode, facts: JobFacts, precheck: bool, warnings: list[str], skip_bad_cells: bool
) -> tuple[str, list[tuple[str, int, str]]]:
    """The cell's code after the rewrite rules, and their ``(rule, line, message)`` changes.

    libcst (in ``engine/rewrite.py``) is imported only for a cell some rule has work in. Python that libcst cannot
    read is the cell's error, not ours; with ``skip_bad_cells`` the cell is kept as cleaned, with a warning.
    """
    plan = plan_cell(code, facts, RULES, every_statement=not precheck)
    if plan is None:
        return clean.code, []
    from .engine.rewrite import rewrite

    try:
        return rewrite(code, plan, facts)
    except CodeError as exc:
        error = cell_error(clean, exc.line, exc.message)
        if not skip_bad_cells:
            raise error from None
        warnings.append(f"not rewritten: {error}")
        return clean.code, []


def _prelude(origin: str, changes: list[Change], installs: tuple[Install, ...], warnings: list[str]) -> list[str]:
    out = [
        f"# Generated by nbddp {__version__} from {origin}: a DDP training script, one process per GPU.",
        "# Run it with:  torchrun --standalone --nproc_per_node=NUM_GPUS <this file>",
        "# Lines under '# [cell N]' come from notebook cell N.",
    ]
    if installs:
        out.append("# Installs, run once before launch (not by every rank):")
        out += [ln for i in installs for ln in _comment(f"#   cell {i.cell}, line {i.line}: {i.command}")]
    if changes:
        out.append("# What nbddp changed:")
        out += [ln for c in changes for ln in _comment(f"#   {c}")]
    out += [ln for w in warnings for ln in _comment(f"# Warning: {w}")]
    out += [
        "import os",
        "import sys",
        "",
        "if '' not in sys.path:  # modules next to the notebook import, as in its kernel",
        "    sys.path.insert(0, '')",
        "import nbddp.runtime as _nbddp",
        "import nbddp.runtime.capture",
        "import nbddp.runtime.interactive",
        "from nbddp.runtime import display  # display() shows on rank 0 only, rich where a kernel follows",
        "",
        "_nbddp.setup()  # this rank's device, the process group, error reports",
        "_nbddp.interactive.guard()  # input() and Hugging Face logins cannot wait for a person in a rank",
        "",
    ]
    return out


def _comment(text: str) -> list[str]:
    """``text`` as comment lines of the header: a message spanning lines (a cell's error with its source
    line) stays a comment on each; a control character in it (a NUL byte a cell held) is written as its escape,
    which Python reads in a comment."""
    first, *rest = printable(text).splitlines() or [""]
    return [first] + [f"#     {line}" for line in rest]
