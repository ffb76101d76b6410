"""Each rank's share of a prediction: the block of rows it takes, and the records that say so.

A prediction (a split loop, a pipeline's call over rows, the Trainer's blocks) takes a contiguous block of the
rows on each rank (``block``), or, a loop over rows, the next chunk of them each time its rank is free
(``handed_chunks``, ``hand_out``), and writes a line of ``<run dir>/shares/rank<r>.jsonl`` when it begins and one of
``rank<r>-times.jsonl`` when its rows are done: which rows each rank had, and where its seconds went (the tests and
``benchmarks/predict_speed.py`` read them). Its own module so that ``predict`` and ``trainer_rows``, which guards
the Trainer from ``predict``, both use it without importing each other.
"""

from __future__ import annotations

import json
import os
import time

#: How many predictions this process has begun (the share records count them from 1).
_count = 0


def block(total: int, rank: int, world: int) -> tuple[int, int]:
    """The first and end position of rank ``rank``'s contiguous block of ``total`` positions in ``world``
    blocks: as equal as they come, the later ranks one more where they do not divide."""
    return total * rank // world, total * (rank + 1) // world


def batch_block(rows: int, size: int, rank: int, world: int) -> tuple[int, int]:
    """The first and end row of rank ``rank``'s contiguous block of whole batches of ``size`` rows (the batches
    one process makes; the last may be short): ``block`` over the batches, in rows."""
    first, end = block(-(-rows // size), rank, world)
    return min(first * size, rows), min(end * size, rows)


def handed_chunks(total: int, world: int) -> list[tuple[int, int]]:
    """``total`` rows cut into chunks for ranks that take the next one as they free up (``hand_out``): each a
    ``2 × world``-th of the rows still left, at least one row, so the first chunks are long (few hand-outs) and
    the last are single rows (the ranks end within about a row of each other, however uneven their speed)."""
    chunks, first = [], 0
    while first < total:
        end = first + max(1, (total - first) // (2 * world))
        chunks.append((first, end))
        first = end
    return chunks


def hand_out(number: int):
    """For prediction ``number``: a function that gives this rank the next chunk's index, counted once across
    every rank (an atomic add on the store the ranks share, torchrun's); None without a process group, or a
    group whose store cannot be reached (the caller then keeps its contiguous block)."""
    try:
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import _get_default_store

        if not (dist.is_available() and dist.is_initialized()):
            return None
        store = _get_default_store()
    except (ImportError, RuntimeError, ValueError):
        return None
    key = f"nbddp/predict/{number}/taken"
    return lambda: store.add(key, 1) - 1


def next_prediction() -> int:
    """The number of the prediction this process begins now."""
    global _count
    _count += 1
    return _count


def record_share(rank: int, world: int, first: int, end: int, total: int, call: str) -> tuple[int, float]:
    """A prediction made by a call over rows (a pipeline's, the Trainer's): this rank's share, on a line of
    ``shares/rank<r>.jsonl`` as a loop's (unit rows). Returns the prediction's number and when it began."""
    number, began = next_prediction(), time.time()
    append_share_line(f"rank{rank}.jsonl", {
        "loop": number, "rank": rank, "world": world, "unit": "rows", "first": first, "end": end, "total": total,
        "began": round(began, 3), "call": call})
    return number, began


def record_times(rank: int, number: int, began: float, predicted: float, gathered: float) -> None:
    """How long this rank's share took and how long it then waited in the gather (for the slowest rank), on a
    line of ``shares/rank<r>-times.jsonl``: where two GPUs fall short of twice one's speed, these say whether the
    rows or the waiting took the time."""
    append_share_line(f"rank{rank}-times.jsonl", {
        "loop": number, "rank": rank, "rows_s": round(predicted - began, 3), "gather_s": round(gathered - predicted, 3),
        "gathered": round(gathered, 3)})


def append_share_line(name: str, line: dict) -> None:
    """A line of ``<run dir>/shares/<name>`` (where a run directory is)."""
    from . import settings

    run_dir = settings.current().run_dir
    if not run_dir:
        return
    from .records import append_line, dropped_write

    folder = os.path.join(run_dir, "shares")
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as exc:  # a full or read-only disk: the record is dropped, the prediction goes on
        dropped_write(folder, exc)
        return
    append_line(os.path.join(folder, name), json.dumps(line))
