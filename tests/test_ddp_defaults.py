"""Performance defaults for DDP wrappers (shim ddp_defaults), checked on real wrappers on two gloo ranks."""

import json

import pytest
from torch import nn

from nbddp.runtime.shims.ddp_defaults import buffers_change
from test_grad_ckpt import run_job

def run(tmp_path, shim: bool) -> tuple[dict, list[float]]:
    """One launch of tests/jobs/ddp_args.py: the settings its DDP wrappers ended up with, then a loss curve."""
    result, out = run_job(tmp_path, "ddp_args.py", shim=True,
                          NBDDP_SHIM_DDP_DEFAULTS="1" if shim else "0")
    assert result.ok, out[-2000:]
    return (json.loads(out.split("DDP_ARGS ", 1)[1].splitlines()[0]),
            json.loads(out.split("LOSSES ", 1)[1].splitlines()[0]))


@pytest.mark.e2e
def test_defaults_apply_where_they_cannot_change_results_keep_what_the_caller_wrote_and_the_loss_curve(tmp_path):
    (settings_without, without), (settings_with, with_defaults) = run(tmp_path, False), run(tmp_path, True)
    assert settings_without == {  # torch's own defaults, for comparison
        "constant_buffer": {"broadcast_buffers": True, "gradient_as_bucket_view": False},
        "batchnorm": {"broadcast_buffers": True, "gradient_as_bucket_view": False},
        "explicit": {"broadcast_buffers": True, "gradient_as_bucket_view": False},
    }
    assert settings_with == {
        "constant_buffer": {"broadcast_buffers": False, "gradient_as_bucket_view": True},
        "batchnorm": {"broadcast_buffers": True, "gradient_as_bucket_view": True},  # running stats stay in sync
        "explicit": {"broadcast_buffers": True, "gradient_as_bucket_view": False},  # the caller's values
    }
    # the defaults leave the loss curve unchanged
    assert without[-1] < without[0]  # it trains
    assert with_defaults == pytest.approx(without, rel=1e-6)


def test_which_buffers_change_in_training():
    assert buffers_change(nn.BatchNorm1d(3))
    assert not buffers_change(nn.Linear(3, 3))
    assert not buffers_change(nn.BatchNorm1d(3, track_running_stats=False))
