"""Where a kept job's ``%%ddp`` cell runs: every statement on every rank, so each name it binds exists on every
rank as the kernel's one process would hold it, except a statement that writes files or pushes, which runs on
rank 0 once and sends the names it binds to the other ranks (``runtime/from_rank0.py``).

A job's script leaves everything after the last training to rank 0; in a kept job every cell comes after
training, and a later cell runs on every rank, so that rule would leave the cell's names on rank 0 alone.
Printing, plotting, ``display`` and generation stay on every rank: only rank 0's output is shown (the cell
follows rank 0's log; ``display`` and ``plt.show()`` show on rank 0 in a rank), and each rank's GPU generates
at once. Where a value may differ between ranks (a random draw, sampled generation, the rank's own number),
the cell says so at its line. A statement holding a prediction loop the ranks split (``predicts.py``) runs on
every rank even where it writes: each rank's share is gathered by all; its write after the loop is rank 0's
(``rules/predict.py``).
"""

from __future__ import annotations

import ast
from typing import TYPE_CHECKING

from ..ast_helpers import DEFS, dotted_name, is_dead_if, keyword, last_name
from .rank0 import plan_data_prep
from .training import is_collective_call

if TYPE_CHECKING:
    from ..code import Statement
    from .job_facts import JobFacts

#: Calls that write files or push: run by every rank they would write the same files at once, or push twice.
_WRITES_ONCE = frozenset(
    "save_pretrained save_model save_state save_lora push_to_hub push_to_hub_merged push_to_hub_gguf "
    "save_pretrained_merged save_pretrained_gguf savefig to_csv to_json to_parquet to_excel to_pickle save "
    "save_to_disk save_file write_text write_bytes upload_file upload_folder".split()
)
#: Calls whose result is this rank's own, or drawn at random.
_PER_RANK = frozenset("get_rank get_local_rank current_device getpid".split())
_RANDOM = frozenset("rand randn randint randperm rand_like randn_like randint_like multinomial bernoulli".split())
_RANDOM_MODULES = ("random.", "np.random.", "numpy.random.")


def plan_kept_cell(top: list[Statement], facts: JobFacts) -> None:
    """Undo the job's after-training plan for the kept cell's statements (and, in a kept job's own script, for
    those after its last training), then guard only their writes; their dataset preparation goes under
    ``main_process_first`` as a job's does."""
    kept = [stmt for stmt in top if stmt.cell.position == facts.kept_cell]
    if facts.kept_tail and facts.training:
        kept += top[top.index(facts.training[-1]) + 1:]
    if facts.plain_loop:
        facts.kept_unwraps = sorted(facts.wrapped_whole & facts.module_names)
    predicting = set(facts.predictions)  # a split loop waits for every rank's share: never rank 0's alone
    for stmt in kept:
        for planned in (facts.rank0, facts.tail, facts.shared_saves):
            planned.discard(stmt)
        facts.all_ranks.pop(stmt, None)
        facts.tail_unwraps.pop(stmt, None)
        if isinstance(stmt.nodes[0], DEFS) or is_dead_if(stmt.nodes[0]):
            continue
        writes = next((c for c in stmt.calls if writes_once(c)), None)
        collective = next((c for c in stmt.calls if is_collective_call(c, facts)), None)
        if writes is not None and collective is None and stmt not in predicting:
            facts.rank0.add(stmt)
            facts.main_first.discard(stmt)
            facts.rank0_sends[stmt] = sorted(stmt.binds)
        elif writes is not None and stmt not in predicting:
            facts.kept_notes[stmt] = (f"runs on every rank, since {_named(collective)}() needs every rank, so "
                                      f"every rank runs {_named(writes)}(): put that in a statement of "
                                      "its own to run it once")
        elif stmt.binds and (why := _differs(stmt)):
            facts.kept_notes[stmt] = (f"{', '.join(sorted(stmt.binds))} may differ between ranks ({why}): each rank "
                                      "holds its own value, and rank 0's is the one shown")
    if facts.training:
        plan_data_prep(kept, facts)
        facts.main_first -= predicting  # rank 0 first, then the others: its gather would wait for them


def _named(call: ast.Call) -> str:
    return dotted_name(call.func) or last_name(call.func) or "a call"


def writes_once(call: ast.Call) -> bool:
    """A call that writes a file or pushes (``to_csv``, ``save_pretrained``, ``open(path, "w")``): once is what
    the kernel did."""
    if last_name(call.func) in _WRITES_ONCE:
        return True
    return isinstance(call.func, ast.Name) and call.func.id == "open" and _writing_mode(call)


def _writing_mode(call: ast.Call) -> bool:
    """``open(path, "w")`` and the like; a mode that is not written out counts as writing (it may be)."""
    found = keyword(call, "mode")
    mode = found.value if found is not None else (call.args[1] if len(call.args) > 1 else None)
    if mode is None:
        return False
    return not isinstance(mode, ast.Constant) or any(c in str(mode.value) for c in "wax+")


def _differs(stmt: Statement) -> str | None:
    """Why what ``stmt`` binds may differ between ranks, or None."""
    for call in stmt.calls:
        name, last = dotted_name(call.func) or "", last_name(call.func)
        if last in _PER_RANK:
            return f"{name}() is each rank's own"
        if last in _RANDOM or name.startswith(_RANDOM_MODULES):
            return f"{name}() draws at random on each rank"
        sampled = keyword(call, "do_sample")
        if last in ("generate", "fast_generate") and sampled is not None and not (
                isinstance(sampled.value, ast.Constant) and not sampled.value.value):
            return f"{name}() samples on each rank"
    return None
