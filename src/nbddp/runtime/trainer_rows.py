"""A Trainer's ``predict``/``evaluate`` in a notebook that only predicts: every row computed as in one process.

The Trainer splits its evaluation rows over the ranks itself, a batch per rank per step, and gathers the
predictions back in row order. Where the rows fill every rank's batch of every step, that is one process's
computation, and nbddp leaves it as it is. Where they do not, accelerate fills the last step with repeated rows:
the last real rows are computed in a batch of another size than one process's (their logits differ in the last
bits) and the padded batch's mean loss counts the repeated rows (its ``eval_loss`` is not one process's). There
(``_in_blocks``) each rank runs the Trainer's evaluation loop over its own contiguous block of whole batches,
the batches one process makes, with no collective inside it (the blocks differ by a batch); then the
predictions, the labels and each batch's loss are gathered once, in row order, and the metrics and the loss are
computed over the whole as the Trainer computes them in one process.

Stopped before the call, saying the fix, where that cannot be done: rows without a length (an iterable dataset),
metrics computed batch by batch (``batch_eval_metrics``) or given the inputs (``include_for_metrics``), a model
sharded over the ranks (FSDP, DeepSpeed: each of its forwards needs every rank, and the blocks differ by a batch).

Installed by ``runtime/predict`` in a notebook that only predicts, and by ``serve.listen_for_stop`` at a kept
job's start, so that a ``%%ddp`` cell's ``trainer.predict``/``evaluate`` computes what the kernel's would. An
evaluation inside ``train()`` is left to the Trainer (``is_in_train``), as in any training job: its refusals
would stop a training, and its model may be sharded. In a kept job the evaluation loop looks at the kernel's Stop
at steps every rank agrees on (``serve``): a rank whose block has a batch fewer takes the looks its last step would
have taken (``_take_the_missed_looks``), so no rank waits in a look another never enters.
"""

from __future__ import annotations

import contextlib

from .patching import when_imported, wrap


def guard() -> None:
    """Wrap ``Trainer.predict``, ``Trainer.evaluate`` and the evaluation loop once transformers' trainer is
    imported."""
    when_imported("transformers.trainer", _patch)


def _patch(module) -> None:
    wrap(module.Trainer, "predict", _make_checked("predict", "test_dataset"))
    wrap(module.Trainer, "evaluate", _make_checked("evaluate", "eval_dataset"))
    wrap(module.Trainer, "evaluation_loop", _in_blocks)


def padded(trainer, dataset) -> bool:
    """Whether the Trainer would pad ``dataset``'s last step on these ranks: its rows do not fill every rank's
    batch of every step."""
    from .dist import rank_info

    world = rank_info().world_size
    if world <= 1 or dataset is None:
        return False
    try:
        rows = len(dataset)
    except TypeError:
        return False
    return rows % (trainer.args.per_device_eval_batch_size * world) != 0


def unsplittable(trainer, dataset) -> str | None:
    """Why ``dataset``'s rows cannot be computed as in one process on these ranks, or None."""
    from .dist import rank_info

    if rank_info().world_size <= 1 or dataset is None:
        return None
    try:
        len(dataset)
    except TypeError:
        return "its rows have no length (an iterable dataset), so nbddp cannot tell whether the last step is padded"
    if not padded(trainer, dataset):
        return None
    strategy = _sharded()
    if strategy:
        return (f"its rows do not fill the last step's batches, and its model is sharded over the ranks ({strategy}), "
                "so no rank can compute a block of its own")
    args = trainer.args
    if getattr(args, "batch_eval_metrics", False):
        return ("its rows do not fill the last step's batches, and its metrics are computed batch by batch "
                "(batch_eval_metrics=True), which nbddp cannot put together from each rank's block")
    if "inputs" in (getattr(args, "include_for_metrics", None) or []):
        return ("its rows do not fill the last step's batches, and compute_metrics is given the inputs "
                "(include_for_metrics), which nbddp does not gather")
    return None


def _sharded() -> str | None:
    """The strategy that shards the model over the ranks (``fsdp``, ``deepspeed``), or None."""
    from . import settings

    strategy = settings.current().strategy
    return strategy if strategy in ("fsdp", "deepspeed") else None


def _make_checked(method: str, dataset_arg: str):
    def make(original):
        def checked(self, *args, **kwargs):
            if getattr(self, "is_in_train", False):  # the training's own evaluation: the Trainer's, unchanged
                return original(self, *args, **kwargs)
            dataset = args[0] if args else kwargs.get(dataset_arg)
            if dataset is None and method == "evaluate":
                dataset = self.eval_dataset
            datasets = dataset.values() if isinstance(dataset, dict) else [dataset]
            why = next((w for w in (unsplittable(self, d) for d in datasets) if w), None)
            if why is not None:
                raise RuntimeError(
                    f"nbddp: trainer.{method}(…) cannot split its rows over the ranks as one process reads them: {why}. "
                    "Set per_device_eval_batch_size so that it times the number of GPUs divides the rows, or run "
                    "the notebook in its kernel, in one process")
            return original(self, *args, **kwargs)

        return checked

    return make


def _in_blocks(evaluation_loop):
    import inspect

    signature = inspect.signature(evaluation_loop)

    def loop(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        dataloader = bound.arguments["dataloader"]
        dataset = getattr(dataloader, "dataset", None)
        if getattr(self, "is_in_train", False) or not padded(self, dataset) or unsplittable(self, dataset):
            return evaluation_loop(*bound.args, **bound.kwargs)
        return _by_blocks(evaluation_loop, bound, dataset)

    return loop


def _by_blocks(evaluation_loop, bound, dataset):
    """The evaluation loop over this rank's block of whole batches, then every rank's predictions, labels and
    losses gathered in row order and the metrics computed over the whole, as one process's loop returns them."""
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    from .dist import rank_info
    from .shares import batch_block, record_share
    from .rank import say

    trainer, dataloader = bound.arguments["self"], bound.arguments["dataloader"]
    prefix = bound.arguments.get("metric_key_prefix", "eval")
    info = rank_info()
    size = trainer.args.eval_batch_size
    rows = len(dataset)
    first, end = batch_block(rows, size, info.rank, info.world_size)
    say(f"nbddp: the Trainer's {rows} rows do not fill the ranks' last batches ({size} a rank on "
        f"{info.world_size} ranks): each rank computes its own block of whole batches, the batches one process "
        "makes, gathered once in row order", once="trainer_rows")
    record_share(info.rank, info.world_size, first, end, rows, "Trainer")
    loader = DataLoader(_rows_of(dataset, first, end), batch_size=size, collate_fn=dataloader.collate_fn,
                        num_workers=dataloader.num_workers, pin_memory=dataloader.pin_memory)
    losses: list = []
    cut = _cuts_the_last_batch(trainer)
    with _alone(trainer, losses, size):
        bound.arguments["dataloader"] = loader
        mine = evaluation_loop(*bound.args, **bound.kwargs)
    batches = -(-rows // size)
    _take_the_missed_looks(trainer, -(-batches // info.world_size))  # the longest block's batches
    every = [None] * info.world_size
    dist.all_gather_object(every, (mine.predictions, mine.label_ids, _numpy(losses)))
    return _whole(trainer, every, prefix, rows, rows if cut else None)


def _take_the_missed_looks(trainer, steps: int) -> None:
    """A kept job's look at the kernel's Stop (``serve``'s callback, duck-typed: this module does not import
    ``serve``) at the steps the longest block reached and this rank's did not."""
    for callback in trainer.callback_handler.callbacks:
        finish = getattr(callback, "finish_evaluation", None)
        if callable(finish):
            finish(steps)


def _cuts_the_last_batch(trainer) -> bool:
    """Whether the loop's gather is accelerate's ``gather_for_metrics`` (the Trainer's), which keeps the last
    batch's repeated loss once per row it holds, not ``gather`` (``Seq2SeqTrainer``'s), which keeps it whole."""
    gather = trainer.gather_function
    return getattr(getattr(gather, "func", gather), "__name__", "") == "gather_for_metrics"


def _rows_of(dataset, first: int, end: int):
    """Rows ``first``…``end``: a 🤗 dataset's ``select`` (it stays one, for the collator), else a ``Subset``."""
    if hasattr(dataset, "select") and hasattr(dataset, "column_names"):
        return dataset.select(range(first, end))
    from torch.utils.data import Subset

    return Subset(dataset, range(first, end))


@contextlib.contextmanager
def _alone(trainer, losses: list, size: int):
    """The evaluation loop with no collective in it: its gathers and padding across processes are this rank's
    own tensors, a batch's label count is its own (``average_tokens_across_devices`` off), ``compute_metrics``
    waits for the whole, and each batch's loss is kept as the loop keeps it (repeated ``eval_batch_size``
    times)."""
    accelerator = trainer.accelerator
    step = trainer.prediction_step

    def prediction_step(*args, **kwargs):
        loss, logits, labels = step(*args, **kwargs)
        if loss is not None:
            losses.append(loss.detach().repeat(size))
        return loss, logits, labels

    args = trainer.args
    saved = trainer.compute_metrics, trainer.gather_function, args.average_tokens_across_devices
    trainer.compute_metrics, trainer.gather_function = None, _own
    # the count of a batch's labels stays this rank's, as one process's is its own: no gather of it across the
    # ranks, and no multiplication of the loss by their number to go with one
    args.average_tokens_across_devices = False
    trainer.prediction_step = prediction_step
    accelerator.pad_across_processes = _own
    try:
        yield
    finally:
        trainer.compute_metrics, trainer.gather_function, args.average_tokens_across_devices = saved
        del trainer.prediction_step, accelerator.pad_across_processes


def _own(tensor, *args, **kwargs):
    return tensor


def _numpy(losses: list):
    """This rank's losses as the loop's container turns them to numpy (None where no batch had one)."""
    if not losses:
        return None
    import torch
    from transformers.trainer_pt_utils import nested_numpify

    return nested_numpify(torch.cat(losses))


def _whole(trainer, every: list, prefix: str, rows: int, cut_at: int | None):
    """One process's ``EvalLoopOutput`` from every rank's (predictions, labels, losses), in rank order; the losses
    cut to ``cut_at`` rows where one process's gather cuts them."""
    import numpy as np
    from transformers.trainer_pt_utils import nested_concat
    from transformers.trainer_utils import EvalLoopOutput, EvalPrediction, denumpify_detensorize

    def joined(k):
        parts = [part[k] for part in every if part[k] is not None]
        out = parts[0] if parts else None
        for part in parts[1:]:
            out = nested_concat(out, part, padding_index=-100)
        return out

    predictions, labels, losses = joined(0), joined(1), joined(2)
    metrics = {}
    if trainer.compute_metrics is not None and predictions is not None and labels is not None:
        with_losses = losses if "loss" in (getattr(trainer.args, "include_for_metrics", None) or []) else None
        metrics = trainer.compute_metrics(EvalPrediction(predictions=predictions, label_ids=labels,
                                                         losses=with_losses))
    metrics = denumpify_detensorize(metrics)
    if isinstance(losses, np.ndarray):
        losses = losses[:cut_at] if cut_at is not None else losses
        finite = np.isfinite(losses)
        if trainer.args.logging_nan_inf_filter and finite.any():
            losses = losses[finite]
        metrics[f"{prefix}_loss"] = losses.mean().item()
    if hasattr(trainer, "model_preparation_time"):
        metrics[f"{prefix}_model_preparation_time"] = trainer.model_preparation_time
    for key in list(metrics):
        if not key.startswith(f"{prefix}_"):
            metrics[f"{prefix}_{key}"] = metrics.pop(key)
    return EvalLoopOutput(predictions=predictions, label_ids=labels, metrics=metrics, num_samples=rows)
