"""The Trainer's NaN/Inf loss filter on the device (shim loss_filter), on two gloo ranks: the same logged
losses as the Trainer's own filter, without turning a tensor into a bool every step."""

import json
import math

import pytest

from nbddp.runtime.shims import loss_filter
from test_grad_ckpt import run_job

STEPS = 8


def result(tmp_path, shim: bool, **env) -> dict:
    res, out = run_job(tmp_path, "loss_filter.py", shim=True, NBDDP_SHIM_LOSS_FILTER="1" if shim else "0", **env)
    assert res.ok, out[-3000:]
    return json.loads(out.split("RESULT ", 1)[1].splitlines()[0]) | {"out": out}


@pytest.mark.e2e
def test_filter_on_the_device_logs_what_the_trainer_logs_without_a_host_wait_per_step(tmp_path):
    own, on_device = result(tmp_path, shim=False), result(tmp_path, shim=True)
    unfiltered = result(tmp_path, shim=True, FILTER="0")  # the user turned the filter off: left alone

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

