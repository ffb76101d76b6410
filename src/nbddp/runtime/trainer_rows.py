"""A Trainer's ``predict``/``evaluate`` in a notebook that only predicts: stopped where its rows do not fill the
ranks' batches.

The Trainer splits its evaluation rows over the ranks itself, a batch per rank per step, and gathers the
predictions back in row order with the padding dropped. Where the rows do not fill every rank's batch of the
last step, accelerate fills it with repeated rows: the last real rows are computed in a batch of another size
than one process's (their logits differ in the last bits) and the padded batch's mean loss counts the repeated
rows (its ``eval_loss`` is not one process's). Such a call is stopped before it runs, saying the fix.
"""

from __future__ import annotations

from .patching import when_imported, wrap


def guard() -> None:
    """Wrap ``Trainer.predict`` and ``Trainer.evaluate`` once transformers' trainer is imported."""
    when_imported("transformers.trainer", _patch)


def _patch(module) -> None:
    wrap(module.Trainer, "predict", _make_checked("predict", "test_dataset"))
    wrap(module.Trainer, "evaluate", _make_checked("evaluate", "eval_dataset"))


def uneven(trainer, dataset) -> str | None:
    """Why ``dataset``'s rows would be padded on the ranks, or None (they fill every batch, or one process)."""
    from .dist import rank_info

    world = rank_info().world_size
    if world <= 1 or dataset is None:
        return None
    per_step = trainer.args.per_device_eval_batch_size * world
    try:
        rows = len(dataset)
    except TypeError:
        return "its rows have no length (an iterable dataset), so nbddp cannot tell whether the last step is padded"
    if rows % per_step == 0:
        return None
    return (f"its {rows} rows do not fill the last step's batches ({trainer.args.per_device_eval_batch_size} per "
            f"rank on {world} ranks, {per_step} a step), and the Trainer pads them with repeated rows, which change "
            f"the last rows' numbers and the loss")


def _make_checked(method: str, dataset_arg: str):
    def make(original):
        def checked(self, *args, **kwargs):
            dataset = args[0] if args else kwargs.get(dataset_arg)
            if dataset is None and method == "evaluate":
                dataset = self.eval_dataset
            datasets = dataset.values() if isinstance(dataset, dict) else [dataset]
            why = next((w for w in (uneven(self, d) for d in datasets) if w), None)
            if why is not None:
                raise RuntimeError(
                    f"nbddp: trainer.{method}(…) cannot split its rows over the ranks as one process reads them: {why}. "
                    "Set per_device_eval_batch_size so that it times the number of GPUs divides the rows, or run "
                    "the notebook in its kernel, in one process")
            return original(self, *args, **kwargs)

        return checked

    return make
