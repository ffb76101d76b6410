"""Token-balanced shards: every rank, at every step, gets micro-batches of nearly equal token count.

Under DDP each step waits for the rank that drew the most tokens. With variable-length data (instruction
data, chat) a plain ``DistributedSampler`` hands ranks random lengths, so the others idle while the one with
the long sample computes. Here the epoch's order is drawn exactly as ``DistributedSampler`` draws it
(``randperm`` seeded with ``seed + epoch``, padded or cut to a multiple of the world size the same way), then
within each window of a few global batches the samples are sorted by length, cut into groups of
``world_size`` neighbours in length, the groups put in a random order (same generator), and each group
dealt largest first to the rank with the fewest tokens so far. So:

- each epoch's set of samples is ``DistributedSampler``'s, every sample once across ranks (plus its padding);
- each rank gets as many samples as before, so the batch size and the global batch size are unchanged;
- the order is new each epoch (``set_epoch``), deterministic with a seed, and the same on every rank's view;
- position ``j`` of every rank holds samples of nearly equal length, so any run of ``B`` positions (a
  micro-batch, whatever the loader's batch size) carries nearly equal tokens and nearly equal padding.

A micro-batch's samples are still a random draw of lengths (groups go to positions at random), not grouped by
length as ``group_by_length`` does, so the padding within a batch stays as it was. The ranks' rows at one
position being neighbours in length, a step holds fewer independent lengths than a random draw: its logged
loss is a little noisier, the loss reached the same (``benchmarks/results/balance_equivalence.md``).

Two routes install it: ``_nbddp.distributed_sampler(ds, shuffle=True)`` in plain loops
(``TokenBalancedSampler``, a ``DistributedSampler``), and the HF ``Trainer``'s ``_get_train_sampler``
(``BalancedGlobalSampler``: a global order whose consecutive batches accelerate's batch sharding hands to
the ranks in turn). On by default; ``NBDDP_BALANCE=0`` turns it off. Lengths come from a ``length`` or
``lengths`` column, else ``input_ids`` (an Arrow column for a ``datasets.Dataset``, else item by item);
fixed-length data keeps the plain order, which is then exactly ``DistributedSampler``'s.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from torch.utils.data import DistributedSampler, Sampler

from .rank import say

#: Least samples per rank a window holds: neighbours in length are then close even in a long tail (on a
#: log-normal of instruction data, 128 keeps the per-step spread under 5% from 2 to 8 ranks; 32 leaves 14%).
MIN_WINDOW_PER_RANK = 128
#: Least global batches a window holds.
MIN_WINDOW_BATCHES = 4
#: Columns read as lengths before ``input_ids`` (``length`` is the Trainer's ``length_column_name``).
LENGTH_COLUMNS = ("length", "lengths")


def enabled() -> bool:
    """On unless ``NBDDP_BALANCE`` is 0/false/off/no."""
    from . import settings

    return settings.current().balance is not False


# ---- lengths ---------------------------------------------------------------------------------------------


def dataset_lengths(dataset) -> list[int] | None:
    """Each sample's token count, or None when the dataset does not say (no ``input_ids``, no length column).

    A ``datasets.Dataset`` is read as Arrow columns (no row is decoded); anything else item by item, after
    checking the first item has ``input_ids``.
    """
    try:
        if _is_hf_dataset(dataset):
            return _hf_lengths(dataset)
        if len(dataset) == 0:
            return None
        first = dataset[0]
        if not isinstance(first, Mapping) or "input_ids" not in first:
            return None
        return [len(dataset[i]["input_ids"]) for i in range(len(dataset))]
    except (TypeError, KeyError, IndexError, ValueError, AttributeError):
        return None


def _is_hf_dataset(dataset) -> bool:
    return hasattr(dataset, "column_names") and hasattr(dataset, "with_format") and hasattr(dataset, "data")


def _hf_lengths(dataset) -> list[int] | None:
    import pyarrow.compute as pc

    columns = dataset.column_names
    table = dataset.with_format("arrow")  # rows as Arrow tables, through the dataset's own index mapping
    for name in LENGTH_COLUMNS:
        if name in columns:
            return [int(v) for v in table[name].to_pylist()]
    if "input_ids" not in columns:
        return None
    return [int(v) for v in pc.list_value_length(table["input_ids"]).fill_null(0).to_pylist()]


# ---- dealing ---------------------------------------------------------------------------------------------


def window_size(world_size: int, global_batch: int | None = None) -> int:
    """Samples per window: a few global batches and at least ``MIN_WINDOW_PER_RANK`` per rank, in whole
    global batches (whole rounds of ranks where the batch size is unknown)."""
    unit = global_batch or world_size
    unit = unit * world_size // math.gcd(unit, world_size)
    least = MIN_WINDOW_PER_RANK * world_size
    return unit * max(MIN_WINDOW_BATCHES if global_batch else 1, math.ceil(least / unit))


def deal(order: Sequence[int], lengths: Sequence[int], world_size: int, window: int, generator) -> list[list[int]]:
    """Split ``order`` (a multiple of ``world_size`` long) into one list per rank, equal in count, with the
    ranks' samples at each position nearly equal in length and their running token counts kept level.

    Within each window of ``window`` samples: sorted by length, groups of ``world_size`` neighbours, groups
    shuffled with ``generator``, each group dealt largest first to the rank with the fewest tokens so far.
    """
    import torch

    ranks: list[list[int]] = [[] for _ in range(world_size)]
    totals = [0] * world_size
    for start in range(0, len(order), window):
        by_length = sorted(order[start:start + window], key=lambda i: -lengths[i])
        groups = [by_length[k:k + world_size] for k in range(0, len(by_length), world_size)]
        for g in torch.randperm(len(groups), generator=generator).tolist():
            fewest_first = sorted(range(world_size), key=lambda r: (totals[r], r))
            for index, r in zip(groups[g], fewest_first):
                ranks[r].append(index)
                totals[r] += lengths[index]
    return ranks


def epoch_order(n: int, seed: int, epoch: int, shuffle: bool = True):
    """``DistributedSampler``'s permutation of ``range(n)`` for this epoch, and the generator after it."""
    import torch

    generator = torch.Generator()
    generator.manual_seed(seed + epoch)
    order = torch.randperm(n, generator=generator).tolist() if shuffle else list(range(n))
    return order, generator


def fit_to(order: list[int], total: int) -> list[int]:
    """Pad (repeating from the start) or cut ``order`` to ``total``, as ``DistributedSampler`` does."""
    if total <= len(order):
        return order[:total]
    missing = total - len(order)
    return order + (order * math.ceil(missing / len(order)))[:missing]


def varies(lengths: Sequence[int] | None) -> bool:
    return bool(lengths) and min(lengths) != max(lengths)


# ---- samplers --------------------------------------------------------------------------------------------


class TokenBalancedSampler(DistributedSampler):
    """A ``DistributedSampler`` whose ranks get nearly equal tokens at each position (for plain loops).

    Same samples per rank and per epoch as ``DistributedSampler`` with the same arguments; only who gets
    which sample, and in which order, changes. Without shuffling, or with fixed lengths, it is exactly
    ``DistributedSampler``.
    """

    def __init__(self, dataset, lengths: Sequence[int], num_replicas: int, rank: int, shuffle: bool = True,
                 seed: int = 0, drop_last: bool = False, window: int | None = None):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed,
                         drop_last=drop_last)
        self.lengths = list(lengths)
        self.window = window or window_size(num_replicas)

    def rank_lists(self) -> list[list[int]]:
        """Every rank's indices for the current epoch (each rank computes all of them alike)."""
        order, generator = epoch_order(len(self.dataset), self.seed, self.epoch, self.shuffle)
        order = fit_to(order, self.total_size)
        if not (self.shuffle and varies(self.lengths)):
            return [order[r:self.total_size:self.num_replicas] for r in range(self.num_replicas)]
        return deal(order, self.lengths, self.num_replicas, self.window, generator)

    def __iter__(self):
        return iter(self.rank_lists()[self.rank])


class BalancedGlobalSampler(Sampler):
    """The Trainer's training order over the whole dataset, each sample once per epoch.

    accelerate shards a Trainer's loader by batches: of each ``world_size`` consecutive batches of
    ``batch_size``, rank ``r`` takes the ``r``-th. So the order is the ranks' balanced lists interleaved
    ``batch_size`` at a time; the few samples that do not fill a last round of batches come last, in their
    shuffled order, for accelerate to handle as it handles any sampler's tail.
    """

    def __init__(self, lengths: Sequence[int], world_size: int, batch_size: int, accumulation: int = 1,
                 seed: int = 0):
        self.lengths = list(lengths)
        self.world_size = world_size
        self.batch_size = batch_size
        self.seed = seed
        self.epoch = 0
        self.window = window_size(world_size, batch_size * world_size * accumulation)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.lengths)

    def __iter__(self):
        order, generator = epoch_order(len(self.lengths), self.seed, self.epoch)
        step = self.world_size * self.batch_size
        whole = len(order) - len(order) % step
        ranks = deal(order[:whole], self.lengths, self.world_size, self.window, generator)
        for start in range(0, whole // self.world_size, self.batch_size):
            for rank in ranks:
                yield from rank[start:start + self.batch_size]
        yield from order[whole:]


# ---- installation ----------------------------------------------------------------------------------------


def sampler_for(dataset, num_replicas: int, rank: int, shuffle: bool):
    """The sampler ``_nbddp.distributed_sampler`` gives: balanced where it can be, else ``DistributedSampler``."""
    if shuffle and num_replicas > 1 and enabled():
        lengths = dataset_lengths(dataset)
        if varies(lengths):
            _say_active(len(lengths), lengths)
            return TokenBalancedSampler(dataset, lengths, num_replicas=num_replicas, rank=rank)
    return DistributedSampler(dataset, num_replicas=num_replicas, rank=rank, shuffle=bool(shuffle))


def _say_active(n: int, lengths: Sequence[int]) -> None:
    say(f"nbddp: token-balanced shards: every rank gets micro-batches of nearly equal token count "
        f"({n} samples of {min(lengths)} to {max(lengths)} tokens; each epoch's samples unchanged; "
        "NBDDP_BALANCE=0 turns this off)", once="balance: active")


def attach() -> None:
    """Balance the Trainer's training sampler once the notebook imports ``transformers.trainer``."""
    from .patching import installed, when_imported

    if enabled() and installed("transformers"):
        when_imported("transformers.trainer", _patch_trainer)


def _patch_trainer(hf_trainer) -> None:
    from .patching import wrap

    wrap(hf_trainer.Trainer, "_get_train_sampler", _balanced_train_sampler)


def _balanced_train_sampler(original):
    def _get_train_sampler(self, train_dataset=None, *args, **kwargs):
        dataset = self.train_dataset if train_dataset is None else train_dataset
        given = () if train_dataset is None else (train_dataset,)  # transformers 4 takes no dataset here
        sampler = original(self, *given, *args, **kwargs)
        balanced = trainer_sampler(self, dataset, sampler)
        return sampler if balanced is None else balanced

    return _get_train_sampler


def trainer_sampler(trainer, dataset, sampler):
    """A ``BalancedGlobalSampler`` in place of the Trainer's random one, or None (said once why not)."""
    from torch.utils.data import IterableDataset, RandomSampler

    args = trainer.args
    if getattr(args, "world_size", 1) < 2 or not enabled() or dataset is None:
        return None
    reason = _why_not(args, dataset, sampler, IterableDataset, RandomSampler)
    if reason is None:
        lengths = dataset_lengths(dataset)
        if lengths is None:
            reason = "its dataset has no input_ids or length column to read lengths from"
        elif not varies(lengths):
            return None  # every sample the same length: nothing to balance, the plain order stays
    if reason:
        say(f"nbddp: token-balanced shards not used for this Trainer: {reason}; its own sampler is kept",
            once="balance: trainer not balanced")
        return None
    _say_active(len(lengths), lengths)
    seed = args.data_seed if getattr(args, "data_seed", None) is not None else args.seed
    batch = getattr(trainer, "_train_batch_size", None) or args.per_device_train_batch_size
    return BalancedGlobalSampler(lengths, args.world_size, batch,
                                 args.gradient_accumulation_steps, seed=seed)


def _why_not(args, dataset, sampler, iterable, random_sampler) -> str | None:
    if isinstance(dataset, iterable):
        return "its dataset is an IterableDataset"
    if getattr(args, "group_by_length", False) or getattr(args, "train_sampling_strategy", "random") not in (
            "random", None):
        return f"it samples by {getattr(args, 'train_sampling_strategy', 'group_by_length')}"
    if getattr(args, "packing", False):
        return "it packs sequences (packing=True)"
    if type(sampler) is not random_sampler:
        return f"it uses its own {type(sampler).__name__}"
    return None
