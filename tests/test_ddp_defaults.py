"""Performance defaults for DDP wrappers (shim ddp_defaults), checked on real wrappers on two gloo ranks."""

import json

import pytest
from torch import nn

from nbddp.runtime.shims.ddp_defaults import buffers_change
from test_grad_ckpt import run_job

def settings(tmp_path, shim: bool) -> dict:
    result, out = run_job(tmp_path, "ddp_args.py", shim=True, NBDDP_SHIM_DDP_DEFAULTS="1" if shim else "0")
    assert result.ok, out[-2000:]
    return json.loads(out.split("DDP_ARGS ", 1)[1].splitlines()[0])


@pytest.mark.e2e
def test_defaults_apply_where_they_cannot_change_results_and_keep_what_the_caller_wrote(tmp_path):
    assert settings(tmp_path, shim=False) == {  # torch's own defaults, for comparison
        "constant_buffer": {"broadcast_buffers": True, "gradient_as_bucket_view": False},
        "batchnorm": {"broadcast_buffers": True, "gradient_as_bucket_view": False},
        "explicit": {"broadcast_buffers": True, "gradient_as_bucket_view": False},
    }
    assert settings(tmp_path, shim=True) == {
        "constant_buffer": {"broadcast_buffers": False, "gradient_as_bucket_view": True},
        "batchnorm": {"broadcast_buffers": True, "gradient_as_bucket_view": True},  # running stats stay in sync
        "explicit": {"broadcast_buffers": True, "gradient_as_bucket_view": False},  # the caller's values
    }


def test_which_buffers_change_in_training():
    assert buffers_change(nn.BatchNorm1d(3))
    assert not buffers_change(nn.Linear(3, 3))
    assert not buffers_change(nn.BatchNorm1d(3, track_running_stats=False))


@pytest.mark.e2e
def test_defaults_leave_the_loss_curve_unchanged(tmp_path):
    def losses(shim: bool) -> list[float]:
        result, out = run_job(tmp_path, "ddp_losses.py", shim=True, NBDDP_SHIM_DDP_DEFAULTS="1" if shim else "0")
        assert result.ok, out[-2000:]
        return json.loads(out.split("LOSSES ", 1)[1].splitlines()[0])

    without, with_defaults = losses(False), losses(True)
    assert without[-1] < without[0]  # it trains
    assert with_defaults == pytest.approx(without, rel=1e-6)
