"""``nbddp run --resume``: the notebook's ``trainer.train()`` continues from the last complete checkpoint.

With ``NBDDP_RESUME=1`` (set by the launcher), ``attach()`` wraps ``transformers.Trainer.train`` (TRL's
trainers inherit it) so that a call without ``resume_from_checkpoint`` resumes from the newest
``checkpoint-N`` folder of the Trainer's ``output_dir`` that is complete. Rank 0 writes
``trainer_state.json`` last, so a folder without it was cut short by a failed run and is passed over; but
every rank writes its own ``rng_state_<rank>.pth`` and rank 0 does not wait for the others, so a folder is
complete only when each rank's file is there too and no save was cut short (``runtime.io`` leaves a hidden
``.<name>.<random>`` temporary file then). With
no complete checkpoint, training starts from the beginning and rank 0 says so. A notebook that passes
``resume_from_checkpoint`` itself is left alone.

A checkpoint at the training's last step (its ``global_step`` reaches this run's ``max_steps``) is a training
that finished: resumed, the Trainer would train one step more (61 of 60: it skips the trained batches and takes
the next before it checks the step count) and save over what it made. It is not trained again: its weights are
loaded into the model, as a resume loads them, and ``train()`` returns at once, so the cells after it (a save, an
evaluation) run on the trained model. Where the Trainer loads weights only after wrapping the model (DeepSpeed,
FSDP), the rank stops instead, saying where the trained weights are.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import math
import os
import re

from . import settings

_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
#: The file the Trainer writes last into a checkpoint folder.
_LAST_WRITTEN = "trainer_state.json"


#: A per-rank RNG state file, as the Trainer names it under DDP.
_RANK_RNG = re.compile(r"^rng_state_(\d+)\.pth$")
#: A temporary file ``runtime.io.atomic_path`` left when its process died mid-save: ``.<name>.<random>``.
_CUT_SHORT = re.compile(r"^\.[^.].*\.[A-Za-z0-9_]{6,}$")


def last_complete_checkpoint(output_dir: str | os.PathLike) -> str | None:
    """The ``checkpoint-N`` folder with the highest N that is complete (``is_complete``), or None."""
    try:
        names = os.listdir(output_dir)
    except OSError:
        return None
    steps = []
    for name in names:
        m = _CHECKPOINT.match(name)
        if m and is_complete(os.path.join(output_dir, name)):
            steps.append((int(m.group(1)), name))
    return os.path.join(output_dir, max(steps)[1]) if steps else None


def is_complete(folder: str) -> bool:
    """``trainer_state.json`` is there, no save was cut short, and every rank's RNG state is there.

    Per-rank names (``rng_state_<rank>.pth``) mean a DDP run of two ranks at least, so ranks 0 to the
    highest one seen (1 at least) must all be there; ``rng_state.pth`` or none at all (``save_only_model``)
    is a one-process checkpoint.
    """
    try:
        names = set(os.listdir(folder))
    except OSError:
        return False
    if _LAST_WRITTEN not in names or any(_CUT_SHORT.match(n) for n in names):
        return False
    ranks = {int(m.group(1)) for m in map(_RANK_RNG.match, names) if m}
    return not ranks or ranks == set(range(max(max(ranks), 1) + 1))


def is_checkpoint(name: str) -> bool:
    """Whether a folder's name is a Trainer checkpoint's (``checkpoint-N``)."""
    return bool(_CHECKPOINT.match(name))


def cut_short(name: str) -> bool:
    """Whether a file's name is the temporary file of a save cut short (``.<name>.<random>``)."""
    return bool(_CUT_SHORT.match(name))


def attach(log=print) -> bool:
    """Wrap ``Trainer.train`` when ``NBDDP_RESUME=1`` and transformers is installed."""
    if settings.current().resume is not True or importlib.util.find_spec("transformers") is None:
        return False
    import transformers

    train = transformers.Trainer.train
    if getattr(train, "_nbddp_resume", False):
        return True

    @functools.wraps(train)
    def train_resuming(self, resume_from_checkpoint=None, *args, **kwargs):
        if resume_from_checkpoint is None:
            resume_from_checkpoint = last_complete_checkpoint(self.args.output_dir)
            done = finished_steps(resume_from_checkpoint, self.args) if resume_from_checkpoint else None
            if done:
                return _already_trained(self, resume_from_checkpoint, done, log)
            if resume_from_checkpoint:
                log(f"nbddp: resuming from {resume_from_checkpoint}")
            else:
                log(f"nbddp: --resume: no complete checkpoint in {self.args.output_dir}; training from the start")
        return train(self, resume_from_checkpoint, *args, **kwargs)

    train_resuming._nbddp_resume = True
    transformers.Trainer.train = train_resuming
    return True


def finished_steps(checkpoint: str, args) -> tuple[int, int] | None:
    """(step, last step) when ``checkpoint`` is the last step of the training ``args`` ask for, else None.

    The last step is ``max_steps`` where the arguments give it; for a training counted in epochs, the
    checkpoint's own last step, provided it was for as many epochs as these arguments ask (more epochs asked
    now: training goes on)."""
    try:
        with open(os.path.join(checkpoint, _LAST_WRITTEN), encoding="utf-8") as fh:
            state = json.load(fh)
        step, its_last, its_epochs = int(state["global_step"]), int(state["max_steps"]), state.get("num_train_epochs")
    except (OSError, ValueError, KeyError, TypeError):
        return None
    max_steps = getattr(args, "max_steps", -1) or -1
    if max_steps > 0:
        last = max_steps
    elif its_epochs == math.ceil(getattr(args, "num_train_epochs", 0) or 0):
        last = its_last
    else:
        return None
    return (step, last) if 0 < last <= step else None


def _already_trained(trainer, checkpoint: str, done: tuple[int, int], log):
    """The training of ``checkpoint`` finished: its weights loaded into the model, nothing trained, what
    ``train()`` returns (``TrainOutput``) from the checkpoint's own record."""
    from transformers.trainer_callback import TrainerState
    from transformers.trainer_utils import TrainOutput

    step, last = done
    if getattr(trainer, "is_deepspeed_enabled", False) or getattr(trainer, "is_fsdp_enabled", False):
        log(f"nbddp: --resume: {checkpoint} is step {step} of {last}: this training already finished, and its "
            "weights are in that folder; nothing to resume (leave --resume out to train again)")
        raise SystemExit(0)
    log(f"nbddp: --resume: {checkpoint} is step {step} of {last}: this training already finished; its weights "
        "are loaded and it is not trained again (leave --resume out to train from the start)")
    trainer._load_from_checkpoint(checkpoint)  # as train() loads a checkpoint it resumes from
    trainer.state = TrainerState.load_from_json(os.path.join(checkpoint, _LAST_WRITTEN))
    losses = [h["loss"] for h in trainer.state.log_history if isinstance(h.get("loss"), (int, float))]
    return TrainOutput(trainer.state.global_step, losses[-1] if losses else float("nan"), {})
