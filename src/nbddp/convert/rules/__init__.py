"""The rewrite rules, one module each, and ``RULES``: every rule, in the order it runs.

A rule's module holds its one class: where the rule has work (its check, with Python's ``ast``) and what it
does (its rewrite, with libcst), with the docstring saying what it changes and why (``engine/rule.py`` says
how a rule is built). The statement rules run first, one at a time, in this order; the expression rules then
run together in one walk (``engine/rewrite.py``). To add a rule: a module here, its line in ``RULES``, and its
before/after tests in ``tests/test_rules.py``.
"""

from __future__ import annotations

from ..engine.rule import Rule
from .accelerate_handoff import AccelerateHandoffRule
from .autocast import AutocastRule
from .data_parallel import DataParallelRule
from .ddp_wrap import DDPWrapRule
from .device import DeviceRule
from .device_count import DeviceCountRule
from .device_map import DeviceMapRule
from .full_batch import FullBatchRule
from .launcher import LauncherRule
from .loop_output import LoopOutputRule
from .loop_sums import LoopSumsRule
from .main_process_first import MainProcessFirstRule
from .predict import PredictRule
from .rank_zero import RankZeroRule
from .rank_zero_in_functions import RankZeroInFunctionsRule
from .sampler import DistributedSamplerRule
from .set_epoch import SetEpochRule
from .shard_loop import ShardLoopRule
from .trackers import TrackersRule
from .trainer_config import TrainerConfigRule
from .unwrap import UnwrapRule

#: Every rule, in the order it is applied: the statement rules, then the expression rules.
RULES: tuple[type[Rule], ...] = (
    MainProcessFirstRule,
    RankZeroRule,
    RankZeroInFunctionsRule,
    DDPWrapRule,
    DeviceMapRule,
    DeviceRule,
    DataParallelRule,
    DeviceCountRule,
    AutocastRule,
    TrainerConfigRule,
    DistributedSamplerRule,
    SetEpochRule,
    ShardLoopRule,
    FullBatchRule,
    UnwrapRule,
    AccelerateHandoffRule,
    LauncherRule,
    LoopOutputRule,
    PredictRule,
    TrackersRule,
    LoopSumsRule,  # last: what it gives back is the loop and its sums' lines, which no later rule would see
)
