"""What the rewrite rules need to know about the whole notebook, gathered with Python's ``ast`` before any rule runs.

``gather_facts`` walks each top-level statement of every cell once (``scan.py``) and decides, for the whole
notebook: which names hold trainers, which statements and functions train (``training.py``), which statements
after training run on rank 0 only and which must stay on every rank (collectives, and what they read), which
dataset preparation goes under ``main_process_first`` (``rank0.py``), and, for a plain PyTorch loop, which
models DDP wraps and where (``models.py``; the part it wraps where the training calls a part and never
the model, ``parts.py``), where the notebook needs them whole (``model_uses.py``) and which
loaders get a ``DistributedSampler`` (``loaders.py``).
The answers are a ``JobFacts``; its statement sets hold the cells' ``Statement``s (``code.py``), and the
rules act on exactly the statements chosen here.

The facts come from CPython's own parser (a few milliseconds for a whole notebook) rather than from libcst,
which the rules use only where they rewrite something. The walk reads the code the way a libcst walk would
(which names a statement binds and reads, which calls it makes): the rules' choices do not depend on which
parser gathered them.
"""

from __future__ import annotations

import ast

from ..code import CellCode, Statement
from .data_parallel import calls_data_parallel
from .job_facts import JobFacts, Seen
from .kept import plan_kept_cell
from .loaders import loader_lengths, plan_helper_training_loaders, plan_loaders
from .model_uses import plan_model_uses
from .models import plan_accelerate, plan_ddp_wraps
from .parts import plan_part_wraps
from .predicts import plan_kept_predictions, plan_predictions
from .rank0 import plan_after_training, plan_data_prep, plan_function_bodies, plan_shared_saves, plan_tail_unwraps
from .scan import scan
from .training import is_plain_loop, is_training_call, plan_trainers, plan_training_functions

__all__ = ["JobFacts", "gather_facts"]


def gather_facts(cells: list[CellCode], kept_cell: int | None = None, kept_tail: bool = False,
                 every_rank: bool = False) -> JobFacts:
    """Look at every cell once and decide what the statement rules do; ``kept_cell``: the position of a kept
    job's ``%%ddp`` cell, ``kept_tail``: a kept job's own cells, whose code after the last training is planned
    by ``kept.plan_kept_cell`` as well, instead of as code after training (the ``%%ddp`` cell's prediction loops
    split as a predicting notebook's, ``predicts.plan_kept_predictions``); ``every_rank`` (``--every-rank``): a
    notebook that does not train runs whole on every rank, its prediction loops left unsplit."""
    facts = JobFacts(kept_cell=kept_cell, kept_tail=kept_tail)
    defs: dict[str, list[ast.Call]] = {}  # function name → the calls in its body
    top = [stmt for cell in cells for stmt in cell.statements]
    seen = Seen()
    for stmt in top:
        scan(stmt, facts, defs, seen)
    facts.module_names = set().union(*(stmt.binds for stmt in top))
    plan_trainers(seen, defs, facts)
    plan_training_functions(defs, facts)
    trains = [any(is_training_call(c, facts) for c in stmt.calls) for stmt in top]
    plan_accelerate(seen, facts, top, trains)
    plan_loaders(seen, defs, facts)
    facts.loader_lengths = loader_lengths([n for stmt in top for n in stmt.nodes], facts.sharded_loaders)
    facts.handed_to_accelerate &= facts.ddp_models | facts.sharded_loaders | facts.helper_loaders
    facts.training = [s for s, t in zip(top, trains) if t]
    if facts.training:
        _plan_around_training(top, trains, facts)
        facts.data_parallel = facts.plain_loop and calls_data_parallel(cells)  # its loaders' batches: every GPU's
    elif kept_cell is None and not every_rank:
        plan_predictions(top, facts)  # a notebook that only predicts: its loops split over the ranks
    if kept_cell is not None:
        plan_kept_predictions(top, facts)  # a %%ddp cell's loops split too, every rank gathering the whole
    if kept_cell is not None or kept_tail:
        plan_kept_cell(top, facts)
    plan_function_bodies(top, facts)
    return facts


def _plan_around_training(top: list[Statement], trains: list[bool], facts: JobFacts) -> None:
    """What runs where, before, between and after the training statements (``trains``: which of ``top``)."""
    facts.plain_loop = is_plain_loop(facts.training, facts)
    first, last = trains.index(True), len(trains) - 1 - trains[::-1].index(True)
    plan_after_training(top, first, last, facts)
    between = [s for s, t in zip(top[first + 1 : last], trains[first + 1 : last]) if not t and s not in facts.rank0]
    plan_shared_saves(top, first, facts, between)
    plan_data_prep(top, facts)
    if facts.plain_loop:
        plan_helper_training_loaders(top, facts)
        facts.loops = {s for s in top if any(is_training_call(c, facts) for c in s.plain_calls)}
        if facts.ddp_models:
            if facts.trained_parts:
                plan_part_wraps(top, facts)
            plan_ddp_wraps(top, first, facts)
            plan_model_uses(top, facts)
            plan_tail_unwraps(top[last + 1 :], facts)
