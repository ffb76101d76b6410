"""A %%ddp cell's rank-0 output keeps the order it was written in across its two files: an evaluation's bar
(stderr) then the metrics the cell printed (stdout), found by one poll, are shown bar first."""

from __future__ import annotations

import os

from nbddp.kept.controller import KeptJob
from nbddp.launch.supervise import poll_in_written_order
from nbddp.launch.supervise import Follower

BAR = "\r  0%|          | 0/4 [00:00<?, ?it/s]\r100%|##########| 4/4 [00:00<00:00, 9.1it/s]\n"
PRINTED = "{'eval_loss': 0.52, 'eval_runtime': 0.46}\n"


def _rank0_logs(run_dir):
    folder = run_dir / "logs" / "job-1" / "attempt_0" / "0"
    folder.mkdir(parents=True)
    for stream in ("stdout", "stderr"):
        (folder / f"{stream}.log").write_text("")
    return folder


def test_one_poll_passes_on_the_bar_then_the_metrics_printed_after_it(tmp_path):
    folder = _rank0_logs(tmp_path)
    seen = []
    followers, _ = KeptJob.followers(type("Job", (), {"run_dir": tmp_path})(), lambda s, t: seen.append((s, t)),
                                     lambda record: None)
    (folder / "stderr.log").write_text(BAR)  # the bar, then the print a moment later, both before the poll
    (folder / "stdout.log").write_text(PRINTED)
    os.utime(folder / "stderr.log", ns=(1_000_000_000, 1_000_000_000))
    os.utime(folder / "stdout.log", ns=(1_050_000_000, 1_050_000_000))
    poll_in_written_order(followers)
    assert seen == [("stderr", BAR), ("stdout", PRINTED)]
    (folder / "stdout.log").write_text(PRINTED + "before the bar\n")  # and the other way round
    (folder / "stderr.log").write_text(BAR + BAR)
    os.utime(folder / "stdout.log", ns=(2_000_000_000, 2_000_000_000))
    os.utime(folder / "stderr.log", ns=(2_050_000_000, 2_050_000_000))
    seen.clear()
    poll_in_written_order(followers, final=True)
    assert seen == [("stdout", "before the bar\n"), ("stderr", BAR)]
    assert all(isinstance(f, Follower) for f in followers)
