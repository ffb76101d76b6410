"""``nbddp run --resume``: the notebook's ``trainer.train()`` continues from the last complete checkpoint.

With ``NBDDP_RESUME=1`` (set by the launcher), ``attach()`` wraps ``transformers.Trainer.train`` (TRL's
trainers inherit it) so that a call without ``resume_from_checkpoint`` resumes from the newest
``checkpoint-N`` folder of the Trainer's ``output_dir`` that is complete. The Trainer writes
``trainer_state.json`` last, so a folder without it was cut short by a failed run and is passed over. With
no complete checkpoint, training starts from the beginning and rank 0 says so. A notebook that passes
``resume_from_checkpoint`` itself is left alone.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re

_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
#: The file the Trainer writes last into a checkpoint folder.
_LAST_WRITTEN = "trainer_state.json"


def last_complete_checkpoint(output_dir: str | os.PathLike) -> str | None:
    """The ``checkpoint-N`` folder with the highest N that holds ``trainer_state.json``, or None."""
    try:
        names = os.listdir(output_dir)
    except OSError:
        return None
    steps = []
    for name in names:
        m = _CHECKPOINT.match(name)
        if m and os.path.isfile(os.path.join(output_dir, name, _LAST_WRITTEN)):
            steps.append((int(m.group(1)), name))
    return os.path.join(output_dir, max(steps)[1]) if steps else None


def attach(log=print) -> bool:
    """Wrap ``Trainer.train`` when ``NBDDP_RESUME=1`` and transformers is installed."""
    if os.environ.get("NBDDP_RESUME") != "1" or importlib.util.find_spec("transformers") is None:
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
