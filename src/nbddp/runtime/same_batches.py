"""Ranks training on the same samples stop: a digest of the first batches the DDP models' forwards receive,
compared once across the ranks.

A loop nbddp could not shard (tensors sliced by index, a list of samples, full-batch gradient descent, a
sampler of the notebook's own) gives every rank the same rows. The replicas then agree, so the divergence
check is content, and two GPUs do the work of one in silence. So each rank digests the inputs of the first
``FIRST_FORWARDS`` training forwards of its DDP wrappers (in train mode, with gradients on: evaluation
forwards are not in step across ranks), all of them in the order they ran, and the ranks gather the digests
once. Two ranks whose digests are all equal stop the job with ``SameBatches`` from inside the forward, at the
notebook's cell and line; then the hooks are removed, so nothing is measured after the first steps.

Data that cannot be split tells nothing: a rank whose compared batches hold a single distinct row (a data set
of one row, rows identical by design) never counts as repeating another. Any batch that differs between the
ranks (a discriminator's real images beside a generator's noise drawn alike from the same seed) keeps the
job running. ``NBDDP_ALLOW_DIVERGENCE=1`` (``--allow-divergence``) turns the check off with the rest of the net.
"""

from __future__ import annotations

#: Training forwards digested (all DDP wrappers together, in the order they ran) before the one comparison.
FIRST_FORWARDS = 3


class SameBatches(RuntimeError):
    """Two ranks' first training batches are the same: the training data is not split between the ranks."""


#: Each digest so far: (sum over the inputs' tensors, one distinct row only); the hooks' handles.
_digests: list[tuple[float, bool]] = []
_handles: list = []
_compared = False


def watch(wrapper) -> None:
    """Digest the inputs of ``wrapper``'s training forwards until the ranks have compared theirs."""
    if not _compared:
        _handles.append(wrapper.register_forward_pre_hook(_before_forward, with_kwargs=True))


def _before_forward(module, args, kwargs) -> None:
    import torch

    if _compared or not module.training or not torch.is_grad_enabled():
        return None
    _digests.append(digest((args, kwargs)))
    if len(_digests) >= FIRST_FORWARDS:
        _compare()
    return None


#: The golden ratio's fractional part: its multiples' fractional parts spread evenly and never repeat.
_GOLDEN = 0.6180339887498949


def digest(inputs) -> tuple[float, bool]:
    """A number that differs between two different batches (almost surely), and whether the batch holds a
    single distinct row (nothing to split): order-weighted sums of its tensors, their shapes counted."""
    import torch

    from .net import tensors

    total, single = 0.0, True
    with torch.no_grad():
        for k, t in enumerate(tensors(inputs), start=1):
            flat = t.detach().flatten()
            flat = (flat.abs() if flat.is_complex() else flat).double()
            # Order counts, with weights of no period (the golden ratio's multiples, fractional parts): a
            # period would weigh alike an image and the same image shifted by it, or one-hot rows.
            position = torch.frac(torch.arange(len(flat), dtype=torch.float64, device=flat.device) * _GOLDEN) + 0.5
            total += k * (float((flat * position).sum()) + 0.5 * len(flat))
            if t.dim() and t.shape[0] > 1 and bool((t.detach() != t.detach()[:1]).any()):
                single = False
    return total, single


def _compare() -> None:
    """Gather every rank's digests once; the same on two ranks raises ``SameBatches`` on every rank."""
    global _compared
    import torch
    import torch.distributed as dist

    from .net import collective_device

    _compared = True
    for handle in _handles:
        handle.remove()
    _handles.clear()
    mine = torch.tensor([d for d, _ in _digests] + [float(nothing_to_split(_digests))], dtype=torch.float64)
    mine = mine.to(collective_device())
    gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    ranks = [g.cpu().tolist() for g in gathered]
    _digests.clear()
    pair = repeated(ranks)
    if pair is not None:
        raise SameBatches(_message(*pair))


def nothing_to_split(digests: list[tuple[float, bool]]) -> bool:
    """One distinct row in all the compared batches: each holds a single distinct row, and every one is the same
    (batches of one row each that differ, as with ``batch_size=1``, hold rows to split)."""
    return all(single for _, single in digests) and len({d for d, _ in digests}) == 1


def repeated(ranks: list[list[float]]) -> tuple[int, int] | None:
    """The first two ranks whose digests are all equal, where the batches held rows to split; else None.
    Each rank's list: its digests, then 1.0 where every batch held a single distinct row."""
    for a in range(len(ranks)):
        for b in range(a + 1, len(ranks)):
            if ranks[a] == ranks[b] and not ranks[a][-1]:
                return a, b
    return None


def _message(a: int, b: int) -> str:
    from .net import script_place

    where = script_place()
    return (
        f"nbddp: ranks {a} and {b} trained on the same samples in their first {FIRST_FORWARDS} training steps"
        + (f" (the model's forward at {where})" if where else "")
        + ": the training data is not split between the ranks, so each GPU repeats the other's work. Fix: feed "
        "the training loop from a DataLoader (DataLoader(dataset, batch_size=…, shuffle=True): nbddp gives each "
        "rank its own share), or give it sampler=_nbddp.distributed_sampler(dataset, shuffle=True); a loop "
        "slicing tensors by index can take its rank's rows with X[_nbddp.rank_info().rank::"
        "_nbddp.rank_info().world_size]; inputs drawn at random in the loop are alike too (nbddp seeds every "
        "rank the same): draw each rank's own. If every rank is meant to read the same samples, run with "
        "--allow-divergence (NBDDP_ALLOW_DIVERGENCE=1)."
    )
