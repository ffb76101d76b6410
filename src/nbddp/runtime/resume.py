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
"""

from __future__ import annotations

import functools
import importlib.util
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
            if resume_from_checkpoint:
                log(f"nbddp: resuming from {resume_from_checkpoint}")
            else:
                log(f"nbddp: --resume: no complete checkpoint in {self.args.output_dir}; training from the start")
        return train(self, resume_from_checkpoint, *args, **kwargs)

    train_resuming._nbddp_resume = True
    transformers.Trainer.train = train_resuming
    return True
