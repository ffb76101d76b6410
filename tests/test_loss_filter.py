"""The Trainer's NaN/Inf loss filter on the device (shim loss_filter), on two gloo ranks: the same logged
losses as the Trainer's own filter, without turning a tensor into a bool every step."""

import json
import math
from pathlib import Path

import pytest

from nbddp.launch import launch, new_run_dir, plan
from nbddp.options import RunOptions
from nbddp.runtime.shims import loss_filter

JOBS = Path(__file__).resolve().parent / "jobs"

STEPS = 8


def results(tmp_path) -> dict:
    """One launch, three trainings in turn (tests/jobs/loss_filter.py): each case's result and output."""
    chunks = []
    res = launch(plan(JOBS / "loss_filter.py", new_run_dir(tmp_path / "runs", "loss_filter"),
                      RunOptions(timeout_s=500), nproc=2, cwd=tmp_path, env={"NBDDP_SHIM_LOSS_FILTER": "1"}),
                 sink=lambda stream, text: chunks.append(text))
    out = "".join(chunks)
    assert res.ok, out[-3000:]
    found = {}
    for part in out.split("CASE ")[1:]:
        case = part.split("\n", 1)[0]
        found[case] = json.loads(part.split(f"RESULT {case} ", 1)[1].splitlines()[0]) | {"out": part}
    assert list(found) == ["unfiltered", "own", "on_device"], out[-3000:]
    return found


@pytest.mark.e2e
def test_filter_on_the_device_logs_what_the_trainer_logs_without_a_host_wait_per_step(tmp_path):
    found = results(tmp_path)
    # the shim on, the user turned the filter off: left alone; the Trainer's own train(): its own filter
    own, on_device, unfiltered = found["own"], found["on_device"], found["unfiltered"]

    assert any(math.isnan(v) for v in unfiltered["losses"])  # the injected NaNs reach the log unfiltered
    assert all(math.isfinite(v) for v in own["losses"])
    assert on_device["losses"] == pytest.approx(own["losses"], rel=1e-6)
    assert own["bools"] - on_device["bools"] >= STEPS  # the Trainer's check made at least one per step
    assert on_device["filter_after"] is True  # the user's args are given back
    assert "NaN/Inf loss filter runs on the device" in on_device["out"]
    assert "NaN/Inf loss filter" not in own["out"] + unfiltered["out"]


def test_it_applies_only_where_the_trainer_filters_as_reproduced():
    from transformers import Trainer

    assert loss_filter.reproduces(Trainer)  # the installed Trainer: the filter is the one reproduced

    class Other:
        def _inner_training_loop(self):
            tr_loss = 0
            return tr_loss  # a loop without the Trainer's filter

    assert not loss_filter.reproduces(Other)

