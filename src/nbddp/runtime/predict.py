"""Prediction on every rank: a loop over the test rows takes this rank's share of them, and what the loop
accumulates comes back whole, in the rows' order, as one process would have it.

``rules/predict.py`` rewrites ``for batch in test_loader: preds.append(model(batch).argmax(-1))`` into

    for batch in (_nbddp_rows := _nbddp.predict.Rows(test_loader, preds=preds)):
        preds.append(model(batch).argmax(-1))
    else:
        preds, = _nbddp_rows.gathered()

and ``correct += (pred == y).sum().item()`` inside it into ``correct += _nbddp_rows.add("correct", …)``.
Over a DataLoader, rank r of n takes the r-th of n contiguous blocks of whole batches (so each batch holds the rows
it holds in one process, and the same numbers come out; a block, because the loader's workers read ahead). Over
rows (a list, a frame, a Dataset), each rank takes the next chunk of them whenever it is free
(``shares.handed_chunks``: long chunks first, single rows last, counted out on the store the ranks share): a rank
whose rows go slower (a busier GPU, longer answers) takes fewer, and the ranks end together. After the loop every
rank has each list's appended items from every rank, in row order (each piece of rows is kept apart), and each sum
replayed from its value before the loop through every increment in row order (the same additions in the same
order: a float sum is equal to the bit). Each rank's block, or each chunk it took, is a line of
``<run dir>/shares/rank<r>.jsonl``.

A pipeline given a whole list in a statement of its own, ``outputs = pipe(texts, batch_size=32)``, becomes
``outputs = _nbddp.predict.split_call(pipe, texts, batch_size=32)``: each rank calls the pipeline on its own
contiguous block of whole batches of the list and every rank gets back every block's results, in order.

In a kept job's ``%%ddp`` cell, whose later cells run on every rank, the ``else`` then gives every rank the
names the loop binds as the rank that ran the last row left them (``settle``: ``x``, ``out``, as the kernel's
one loop leaves them); the cell imports this module itself (the Trainer's blocks were installed at the job's
start).
"""

from __future__ import annotations

import contextlib
import sys
import time

from .shares import (append_share_line, batch_block, block, hand_out, handed_chunks, next_prediction, record_share,
                     record_times)


class Rows:
    """One prediction loop on this rank: what it iterates (its share) and what it accumulates (``gathered``)."""

    def __init__(self, iterable, enumerate_from: int | None = None, /, **accumulators):  # any name accumulates
        from .dist import rank_info

        self.loop = next_prediction()
        info = rank_info()
        self.rank, self.world = info.rank, info.world_size
        _check_strategy(self.world)
        self.enumerate_from = enumerate_from
        self.bar = None  # the notebook's progress bar around the rows, where this loop iterates them for it
        self.before = {name: _before(name, v) for name, v in accumulators.items()}
        self.lists = {name: v for name, v in accumulators.items() if isinstance(v, list)}
        self.increments: dict[str, list] = {name: [] for name in accumulators if name not in self.lists}
        self.share, self.first, self.end, self.total, self.unit = self._share(iterable)
        # rows (not a DataLoader's batches, which its workers read ahead) go to whichever rank is free next
        self.next_chunk = hand_out(self.loop) if self.unit == "rows" and self.world > 1 else None
        self.pieces: list[tuple[int, int, dict]] = []  # (first, end, the accumulators' lengths as it began)
        self.began = time.time()
        if self.next_chunk is None:
            self._record(self.first, self.end)
        if self.world > 1:
            _sync_buffers(sys._getframe(1))

    # -- the share

    def _share(self, iterable):
        """This rank's share of ``iterable``: (the share, its first and end position, the whole count, the unit)."""
        if type(iterable).__module__.split(".")[0] == "tqdm":  # a progress bar (tqdm, tqdm.auto's): its rows,
            self.bar, iterable = iterable, getattr(iterable, "iterable", iterable)  # the bar counted by ``_shown``
        loader = _loader_share(iterable, self.rank, self.world)
        if loader is not None:
            return loader
        self.rows = rows = iterable if _sliceable(iterable) else list(iterable)
        first, end = block(len(rows), self.rank, self.world)
        return _slice(rows, first, end), first, end, len(rows), "rows"

    def __iter__(self):
        if self.next_chunk is None:  # this rank's contiguous block, its iterator made now (a DataLoader's draws
            self._begin(self.first, self.end)  # its seed here, not in a row)
            rows = self._counted(self.share, self.first)
        else:
            rows = self._handed_out()
        rows = self._shown(rows)
        return rows if self.world < 2 else self._unrandom(_whole_models(rows))

    def _shown(self, rows):
        """The rows, the notebook's progress bar counting this rank's share of them, to its end: a bar around the
        loop's rows (``enumerate(tqdm(rows))``), which this loop iterates in its place, is advanced here (it stood
        at 0 % before); a bar around this loop (``tqdm(rows, total=len(df))``) counts itself. On a rank of several,
        its total is this rank's share (the bar ended at half) and its label says so; where the rows are handed
        out, the total is first the share's expected length and at the end the rows this rank took (100 %)."""
        bar = self.bar if self.bar is not None else _bar_around(self)
        if bar is None or getattr(bar, "disable", True):
            yield from rows
            return
        if self.world > 1:
            bar.total = len(self)
            label = getattr(bar, "desc", "").rstrip(": ")
            bar.set_description_str(f"{label} (rank {self.rank}'s share)" if label else f"rank {self.rank}'s share",
                                    refresh=False)
        taken = 0
        for row in rows:
            yield row
            taken += 1
            if bar is self.bar:
                bar.update(1)
        if self.world > 1:
            bar.total = taken
        if bar is self.bar:
            bar.close()

    def _handed_out(self):
        """The next chunk of the rows each time this rank is free (``shares.hand_out``), until none is left: a
        rank whose rows go slower (a busier GPU, longer answers) takes fewer, and the ranks end together."""
        chunks = handed_chunks(self.total, self.world)
        while (k := self.next_chunk()) < len(chunks):
            first, end = chunks[k]
            self._begin(first, end)
            self._record(first, end)
            yield from self._counted(_slice(self.rows, first, end), first)

    def _counted(self, rows, first: int):
        return iter(rows) if self.enumerate_from is None else iter(enumerate(rows, self.enumerate_from + first))

    def _begin(self, first: int, end: int) -> None:
        """A piece of rows begins: where each accumulator stands, so its items can be put in row order."""
        lengths = {name: len(v) for name, v in self.lists.items()}
        lengths.update((name, len(v)) for name, v in self.increments.items())
        self.pieces.append((first, end, lengths))

    def _unrandom(self, rows):
        """The rows, stopped where one of them drew from a global random generator (sampling, noise, dropout of a
        model not in eval mode): split, each rank's rows would draw other numbers than in one process, whose
        later rows draw where the earlier ones left the generator."""
        state = _random_state()
        for row in rows:
            yield row
            now = _random_state()
            if now != state:
                raise RuntimeError(
                    "nbddp: a row of this prediction loop draws random numbers (sampling such as do_sample=True, "
                    "noise, dropout of a model not in eval mode): split over the ranks, its rows would draw other "
                    "numbers than in one process. Make each row's result its own (do_sample=False, model.eval(), a "
                    "generator seeded per row: generator=torch.Generator().manual_seed(i)), or run the notebook in "
                    "one process")
            state = now

    def __len__(self):
        """The rows of this rank's block: where they are handed out, about as many as it takes (a progress bar's
        length until the loop ends, ``_shown``)."""
        return len(self.share)

    def _record(self, first: int, end: int) -> None:
        """This rank's block, or a chunk handed to it, on a line of ``<run dir>/shares/rank<r>.jsonl`` (where a run
        directory is) as it begins: a loop that fails still says which rows each rank had."""
        append_share_line(f"rank{self.rank}.jsonl", {
            "loop": self.loop, "rank": self.rank, "world": self.world, "unit": self.unit, "first": first,
            "end": end, "total": self.total, "began": round(time.time(), 3),
            **({"handed_out": True} if self.next_chunk is not None else {})})

    # -- what it accumulates

    def add(self, name: str, value):
        """One increment of the sum ``name`` (``correct += …``): kept for the replay, given back to add here."""
        if name in self.increments:
            self.increments[name].append(value)
        return value

    def gathered(self) -> tuple:
        """Every accumulator, in the order given: each list with the items every rank appended, in row order
        (in place: the same list object), each sum replayed from its value before the loop, in row order."""
        mine = [(first, end, self._items(i)) for i, (first, end, _) in enumerate(self.pieces)]
        every = _every_rank(mine, self.rank, self.world, self.loop, self.began)
        pieces = sorted((first, r, end, part) for r, rank_pieces in enumerate(every) for first, end, part in rank_pieces)
        self.last_rank = max(((first, r) for first, r, end, _ in pieces if end > first), default=(0, None))[1]
        out = []
        for name, before in self.before.items():
            if name in self.lists:
                items = self.lists[name]
                items[before:] = [x for *_, part in pieces for x in part["lists"][name]]
                out.append(items)
            else:
                total = before
                for *_, part in pieces:
                    for increment in part["sums"][name]:
                        total += increment
                out.append(total)
        return tuple(out)

    def _items(self, i: int) -> dict:
        """What the loop accumulated during piece ``i`` of this rank's rows."""
        begin = self.pieces[i][2]
        end = self.pieces[i + 1][2] if i + 1 < len(self.pieces) else None
        return {"lists": {n: v[begin[n]:None if end is None else end[n]] for n, v in self.lists.items()},
                "sums": {n: v[begin[n]:None if end is None else end[n]] for n, v in self.increments.items()}}

    def settle(self, namespace: dict, *names: str) -> None:
        """After ``gathered``: ``names`` in ``namespace`` as the rank that ran the last row holds them (a kept
        cell's loop, whose later cells read ``x`` or ``out`` on every rank), through ``from_rank0``'s packing (a
        value that cannot be sent is a stand-in saying so). Where no rank ran a row, each holds what it held."""
        import torch.distributed as dist

        from .dist import device
        from .from_rank0 import pack, unpack

        if self.world < 2 or self.last_rank is None or not (dist.is_available() and dist.is_initialized()):
            return
        packed = [pack(namespace, names) if self.rank == self.last_rank else None]
        dist.broadcast_object_list(packed, src=self.last_rank)
        if self.rank != self.last_rank:
            unpack(packed[0], namespace, device())


def _bar_around(rows: Rows):
    """The progress bar iterating ``rows`` (``tqdm(Rows(…), …)``), found among tqdm's live bars; None if none."""
    std = sys.modules.get("tqdm.std")
    bars = list(getattr(getattr(std, "tqdm", None), "_instances", ()))
    return next((bar for bar in bars if getattr(bar, "iterable", None) is rows), None)


def split_call(pipe, rows, /, *args, **kwargs):
    """``pipe(rows, *args, **kwargs)``, a pipeline's call over a whole list, made by each rank on its contiguous
    block of whole batches (``batch_size=`` of the call, else the pipeline's; so each batch holds the rows it
    holds in one process and the same numbers come out), the results gathered to every rank in the list's order:
    what one process's call returns. A map-style dataset (``KeyDataset(ds, "text")``) is split alike, each rank
    calling the pipeline on a ``Subset`` of it, and its results come back as a list (one process's call gives an
    iterator over the same results). The share is a line of ``shares/rank<r>.jsonl`` (unit rows) and its seconds
    one of ``rank<r>-times.jsonl``, as a loop's. Anything else, or nothing to split, is called whole."""
    from .dist import rank_info

    if not (isinstance(rows, (list, tuple)) or _map_style(rows)) or not len(rows):
        return pipe(rows, *args, **kwargs)
    info = rank_info()
    rank, world = info.rank, info.world_size
    _check_strategy(world)
    size = kwargs.get("batch_size") or getattr(pipe, "_batch_size", None) or 1
    if world > 1 and size > 1 and _chunks_rows(pipe):
        return _called_whole(pipe, rows, args, kwargs)
    first, end = batch_block(len(rows), size, rank, world)
    loop, began = record_share(rank, world, first, end, len(rows), getattr(pipe, "task", None) or type(pipe).__name__)
    if world < 2:
        return pipe(rows, *args, **kwargs)
    with _module_forwards():
        piece = _call_block(pipe, _block_of(rows, first, end), args, kwargs)
    return _gather_pieces(piece, rank, world, loop, began)


def _chunks_rows(pipe) -> bool:
    """A pipeline that cuts each row into chunks and batches the chunks of neighbouring rows together
    (``ChunkPipeline``: speech recognition with ``chunk_length_s``, zero-shot classification, question answering)."""
    base = sys.modules.get("transformers.pipelines.base")  # a pipeline of transformers' has imported it
    return base is not None and isinstance(pipe, base.ChunkPipeline)


def _called_whole(pipe, rows, args, kwargs):
    """A chunking pipeline's call with batches of more than one chunk, made whole by every rank: its batches mix
    the chunks of rows on both sides of any block's edge, so a rank's block would be computed in other batches
    than one process's (other numbers in the last bits). Said once."""
    from .rank import say

    say(f"nbddp: {type(pipe).__name__} batches the chunks of several rows together, so split over the ranks its rows "
        "would be computed in other batches than in one process: every rank runs this call whole (no faster than "
        "one GPU; batch_size=1 lets nbddp split it)", once="chunked pipeline")
    return _results(pipe(rows, *args, **kwargs), rows)


def _results(result, rows):
    """A pipeline's results over ``rows`` as a list: given a list it returns one; given a dataset, an iterator."""
    return result if isinstance(rows, (list, tuple)) else list(result)


def _map_style(rows) -> bool:
    """A torch ``Dataset`` with a length (``KeyDataset``), not an iterable one."""
    from torch.utils.data import Dataset, IterableDataset

    return isinstance(rows, Dataset) and not isinstance(rows, IterableDataset) and hasattr(rows, "__len__")


def _block_of(rows, first: int, end: int):
    """Rows ``first``…``end`` of a list, or of a dataset as a ``Subset`` (still a dataset to the pipeline)."""
    if isinstance(rows, (list, tuple)):
        return rows[first:end]
    from torch.utils.data import Subset

    return Subset(rows, range(first, end))


def _call_block(pipe, rows, args, kwargs) -> list:
    """``pipe`` over this rank's block: a list of one result per row. A block of one row is given as two rows,
    one batch each, and the first result kept: some pipelines (fill-mask) give a one-row list's result unwrapped;
    one batch of one row is how one process ran that row. Stopped where the call draws random numbers other than
    its DataLoader's seed."""
    import torch

    if not len(rows):
        return []
    state, torch_state = _random_state(), torch.get_rng_state()
    if len(rows) == 1:
        piece = pipe(list(rows) * 2, *args, **{**kwargs, "batch_size": 1})[:1]
    else:
        piece = _results(pipe(rows, *args, **kwargs), rows)
    if _random_state() != state and _draws_beyond_its_loader(torch_state):
        raise RuntimeError(
            "nbddp: this pipeline call draws random numbers (sampling such as do_sample=True, dropout of a model "
            "not in eval mode): split over the ranks, its rows would draw other numbers than in one process. Make "
            "each row's result its own (do_sample=False, model.eval()), or run the notebook in one process")
    if not isinstance(piece, list) or len(piece) != len(rows):
        raise RuntimeError(f"nbddp: this pipeline call gave {type(piece).__name__} for a list of {len(rows)} rows, "
                           "not a result per row, which nbddp cannot put back together in order; call it in a loop "
                           "over batches (outputs.extend(pipe(batch))), or run the notebook in one process")
    return piece


def _draws_beyond_its_loader(before) -> bool:
    """Whether the global generators moved otherwise than by the seed a DataLoader draws as it starts (a
    pipeline reads a list through one; so does one process's call, which drew the same one seed)."""
    import torch
    from torch.utils.data import DataLoader

    now, after = _random_state(), torch.get_rng_state()
    torch.set_rng_state(before)
    iter(DataLoader([0]))
    expected = _random_state()
    torch.set_rng_state(after)
    return now != expected


def _gather_pieces(piece: list, rank: int, world: int, loop: int, began: float) -> list:
    """Every rank's results, in rank order (which is the list's order), on every rank."""
    return [x for part in _every_rank(piece, rank, world, loop, began) for x in part]


def _every_rank(mine: list, rank: int, world: int, loop: int, began: float) -> list[list]:
    """Each rank's part, in rank order, on every rank (``all_gather_object``, GPU tensors on the CPU on the way:
    ``_portable``/``_local``; this rank's own as it is); without a process group, this rank's alone. The share's
    seconds recorded (``record_times``)."""
    import torch.distributed as dist

    predicted = time.time()
    every: list = [[] for _ in range(world)]
    if world > 1 and dist.is_available() and dist.is_initialized():
        dist.all_gather_object(every, _portable(mine))
    record_times(rank, loop, began, predicted, time.time())
    return [mine if r == rank else _local(part or []) for r, part in enumerate(every)]



def _sync_buffers(frame) -> None:
    """The buffers (a BatchNorm's running statistics) of the DDP models the loop's code can name, from rank 0,
    as DDP's next forward would broadcast them: every rank enters here, the same models in the same order (a
    kept job's ranks hold the same names), so each rank's share runs the model rank 0 holds."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    if not (dist.is_available() and dist.is_initialized()):
        return
    scope = {**frame.f_globals, **frame.f_locals}
    models = {id(v): v for _, v in sorted(scope.items(), key=lambda item: item[0])
              if isinstance(v, DistributedDataParallel) and v.broadcast_buffers}
    for model in models.values():
        for buffer in model.module.buffers():
            dist.broadcast(buffer.data, src=0)


def _whole_models(rows):
    """The rows, a DDP model's forward running its own module meanwhile (``_module_forwards``)."""
    with _module_forwards():
        yield from rows


@contextlib.contextmanager
def _module_forwards():
    """A DDP model's forward running its own module (a kept job's prediction): DDP's forward may broadcast
    buffers (with gradients on), a collective the ranks would enter a different number of times, as their shares
    differ by a batch; a prediction has no backward for DDP to prepare."""
    from torch.nn.parallel import DistributedDataParallel

    original = DistributedDataParallel.forward
    DistributedDataParallel.forward = _module_forward
    try:
        yield
    finally:
        DistributedDataParallel.forward = original


def _module_forward(self, *args, **kwargs):
    return self.module(*args, **kwargs)


def _random_state() -> tuple:
    """Where the global random generators stand: Python's, NumPy's, torch's on the CPU and on this rank's GPU (the
    one its rows run on: asking every GPU's would reach the other ranks' cards too)."""
    import random

    import torch

    states = [random.getstate(), torch.get_rng_state().numpy().tobytes()]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states.append(torch.cuda.get_rng_state().numpy().tobytes())
    try:
        import numpy

        kind, keys, pos, gauss, cached = numpy.random.get_state()
        states.append((kind, keys.tobytes(), pos, gauss, cached))
    except ImportError:
        pass
    return tuple(states)


def _check_strategy(world: int) -> None:
    """Sharded weights (FSDP, DeepSpeed) need every rank in every forward, and the ranks' blocks may differ by
    a batch: such a loop would wait for a rank that has finished. Stopped here, saying what runs it."""
    from . import settings

    strategy = settings.current().strategy
    if world > 1 and strategy in ("fsdp", "deepspeed"):
        raise RuntimeError(f"nbddp: a prediction loop cannot be split over ranks whose model is sharded ({strategy}): "
                           "run the notebook with --strategy split (the model's layers over every GPU, one process), "
                           "or --strategy ddp where the model fits one GPU")


def _before(name: str, value):
    """What an accumulator holds as the loop starts: a list's length, a sum's value (a copy of a tensor or
    array, which ``+=`` changes in place). Anything else could not be put back together: stopped, said."""
    if isinstance(value, list):
        return len(value)
    if isinstance(value, (int, float, complex)):
        return value
    if type(value).__module__.split(".")[0] in ("torch", "numpy") and hasattr(value, "__iadd__"):
        return value.clone() if hasattr(value, "clone") else value.copy()
    raise TypeError(f"nbddp: {name} accumulates a prediction loop's results but is a {type(value).__name__}: nbddp "
                    "gathers lists (append, extend, +=) and sums of numbers, tensors or arrays (+=); make it a list "
                    "and convert it after the loop")


def _loader_share(loader, rank: int, world: int):
    """A DataLoader over this rank's contiguous block of whole batches (same batch size, workers, collate
    function), or None for anything else. A loader whose order is not its dataset's (a shuffling or custom
    sampler, an iterable dataset) is read whole by rank 0 and not at all by the others, said once: the
    results stay right, only not faster. A ``DistributedSampler`` in order (a loader a kept job's training
    sharded, read again in a ``%%ddp`` cell) gives its dataset's rows: the loop splits them all, not a rank's."""
    from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, SequentialSampler

    if not isinstance(loader, DataLoader):
        return None
    from .dist import print0
    from .loaders import rebuilt

    size = loader.batch_size
    sharded = isinstance(loader.sampler, DistributedSampler) and not loader.sampler.shuffle
    plain = (type(loader) is DataLoader and (isinstance(loader.sampler, SequentialSampler) or sharded) and size
             and not isinstance(loader.dataset, IterableDataset))
    batches = len(loader)
    if plain and sharded:  # the whole dataset's batches, not this rank's sampler's
        batches = len(loader.dataset) // size if loader.drop_last else -(-len(loader.dataset) // size)
    if not plain:
        print0(f"nbddp: warning: a prediction loop reads a DataLoader with {type(loader.sampler).__name__}: rank 0 "
               "reads all of it, the other ranks none (its order is not its rows' order)", flush=True)
        share = loader if rank == 0 else []
        return share, 0, batches if rank == 0 else 0, batches, "batches"
    first, end = block(batches, rank, world)
    rows = len(loader.dataset)
    sampler = range(min(first * size, rows), min(end * size, rows))
    share = rebuilt(loader, sampler=sampler)
    return share, first, end, batches, "batches"


def _sliceable(rows) -> bool:
    """Rows that slicing by position gives as iterating gives them (not a mapping's keys, nor a DataFrame's
    column names, which iterating it yields)."""
    return (hasattr(rows, "__len__") and hasattr(rows, "__getitem__") and not hasattr(rows, "columns")
            and not isinstance(rows, (dict, str, bytes)))


def _slice(rows, first: int, end: int):
    """``rows[first:end]``: by position for a pandas frame or series, a ``Subset`` for a Dataset slicing does
    not serve."""
    if hasattr(rows, "iloc"):
        return rows.iloc[first:end]
    if isinstance(rows, (list, tuple, range)) or type(rows).__module__.split(".")[0] in ("numpy", "torch"):
        if not _is_dataset(rows):
            return rows[first:end]
    from torch.utils.data import Subset

    return Subset(rows, range(first, end))


def _is_dataset(rows) -> bool:
    try:
        from torch.utils.data import Dataset
    except ImportError:
        return False
    return isinstance(rows, Dataset)


def _portable(value):
    """``value`` as it travels to the other ranks: tensors on the CPU, remembering they were on a GPU."""
    import torch

    def leaf(v):
        if isinstance(v, torch.Tensor) and v.device.type != "cpu":
            return _OnDevice(v.detach().cpu(), v.device.type)
        return v

    return _each_leaf(value, leaf)


def _local(value):
    """A travelled value on this rank: a tensor that was on a GPU goes to this rank's GPU."""
    from .dist import device

    return _each_leaf(value, lambda v: v.tensor.to(device()) if isinstance(v, _OnDevice) else v)


def _each_leaf(value, leaf):
    """``value`` with ``leaf`` applied inside its lists, plain tuples and plain dicts (the containers a loop's
    results are gathered in; a named tuple or another mapping class travels whole)."""
    if isinstance(value, list):
        return [_each_leaf(v, leaf) for v in value]
    if type(value) is tuple:
        return tuple(_each_leaf(v, leaf) for v in value)
    if type(value) is dict:
        return {k: _each_leaf(v, leaf) for k, v in value.items()}
    return leaf(value)


class _OnDevice:
    """A GPU tensor's values on the CPU, for the way to another rank."""

    def __init__(self, tensor, kind: str):
        self.tensor, self.kind = tensor, kind


def _guard_trainers() -> None:
    """A Trainer's ``predict``/``evaluate`` over rows that do not fill the ranks' last batches, computed by blocks
    (``runtime/trainer_rows.py``). A kept job installed it at its start (``serve.listen_for_stop``), before its
    Stop's wrapper of the same loop; installing it again changes nothing."""
    from .trainer_rows import guard

    guard()


_guard_trainers()
