"""DDP × gradient checkpointing on two gloo ranks: each failure reproduced with the shim forced off, then
fixed with it on. The jobs (tests/jobs/) train the tiny Llama with LoRA, a frozen base, for 3–4 steps."""

from pathlib import Path

import pytest

from nbddp.launch import launch, new_run_dir, plan
from nbddp.options import RunOptions

pytestmark = pytest.mark.e2e

JOBS = Path(__file__).resolve().parent / "jobs"
READY_TWICE = "has been marked as ready twice"
GRAPH_CHANGED = "training graph has changed in this iteration"
ACCUMULATION_ASSERT = "expect_autograd_hooks_ INTERNAL ASSERT FAILED"


def run_job(tmp_path, job: str, shim: bool, **env):
    """Run a job on 2 ranks; the grad_ckpt shim forced on or off. Returns the result and rank 0's output."""
    env = {k: str(v) for k, v in env.items()}
    env["NBDDP_SHIM_GRAD_CKPT"] = "1" if shim else "0"
    run_dir = new_run_dir(tmp_path / "runs", job)
    chunks = []
    result = launch(
        plan(JOBS / job, run_dir, RunOptions(timeout_s=500), nproc=2, cwd=tmp_path, env=env),
        sink=lambda stream, text: chunks.append(text),
    )
    return result, "".join(chunks)


def assert_fails_with(result, text):
    assert not result.ok
    assert result.failure is not None, "no error record"
    assert text in result.failure.message, result.failure.message[:2000]


def assert_trains(result, out):
    assert result.ok, (result.failure and result.failure.message[:2000]) or out[-3000:]
    assert "JOB OK" in out


def test_trainer_picks_find_unused_for_a_peft_model_and_reentrant_checkpointing_breaks(tmp_path):
    result, _ = run_job(tmp_path, "ckpt_trainer.py", shim=False, REENTRANT=1)
    assert_fails_with(result, READY_TWICE)
    result, out = run_job(tmp_path, "ckpt_trainer.py", shim=True, REENTRANT=1)
    assert_trains(result, out)
    assert "nbddp: Gradient checkpointing detected on" in out and "reentrant (use_reentrant=True)" in out
    assert "ddp: find_unused_parameters=False static_graph=False" in out


@pytest.mark.parametrize(
    "ckpt",
    [
        "empty",  # gradient_checkpointing_kwargs={}, as PEFT's prepare_model_for_kbit_training passes
        "direct",  # torch.utils.checkpoint.checkpoint called by the script itself
    ],
)
def test_checkpointing_that_does_not_say_use_reentrant_is_made_non_reentrant(tmp_path, ckpt):
    result, _ = run_job(tmp_path, "ckpt_loop.py", shim=False, CKPT=ckpt, FIND_UNUSED=1)
    assert_fails_with(result, READY_TWICE)  # torch's default is still reentrant
    result, out = run_job(tmp_path, "ckpt_loop.py", shim=True, CKPT=ckpt, FIND_UNUSED=1)
    assert_trains(result, out)
    assert "ddp: find_unused_parameters=True" in out  # DDP as the script asked: non-reentrant needs no change
    if ckpt == "empty":
        assert "non-reentrant (use_reentrant not set; nbddp's default)" in out


def test_a_reentrant_checkpoint_in_the_scripts_own_forward_is_named_before_ddp_fails(tmp_path):
    # invisible when DDP is built, and insisted on: nbddp cannot repair it, but says why in plain words
    result, out = run_job(tmp_path, "ckpt_loop.py", shim=True, CKPT="direct", REENTRANT=1, FIND_UNUSED=1)
    assert_fails_with(result, READY_TWICE)
    assert "nbddp: torch.utils.checkpoint(..., use_reentrant=True) runs inside a DDP model built with" in out


def test_static_graph_while_the_parameters_used_change_between_steps(tmp_path):
    job = dict(CKPT="hf", FIND_UNUSED=1, STATIC=1, VARY=1)
    result, _ = run_job(tmp_path, "ckpt_loop.py", shim=False, **job)
    assert_fails_with(result, GRAPH_CHANGED)
    assert "static_graph" in result.failure.message
    result, out = run_job(tmp_path, "ckpt_loop.py", shim=True, **job)
    assert_trains(result, out)
    assert "nbddp: DDP static_graph turned off: non-reentrant checkpointing does not need it" in out


def test_static_graph_with_gradient_accumulation_trips_the_reducer(tmp_path):
    job = dict(REENTRANT=1, STATIC=1, ACCUM=2)
    result, _ = run_job(tmp_path, "ckpt_trainer.py", shim=False, **job)
    assert_fails_with(result, ACCUMULATION_ASSERT)
    result, out = run_job(tmp_path, "ckpt_trainer.py", shim=True, **job)
    assert_trains(result, out)
    assert "nbddp: DDP static_graph turned off: gradient accumulation is 2 steps" in out
    assert "ddp: find_unused_parameters=False static_graph=False" in out


def test_static_graph_can_be_forced_on(tmp_path):
    result, out = run_job(tmp_path, "ckpt_trainer.py", shim=True, REENTRANT=1, NBDDP_DDP_STATIC_GRAPH=1)
    assert_trains(result, out)  # reentrant checkpointing with a static graph at accumulation 1 is fine
    assert "nbddp: DDP static_graph=True (NBDDP_DDP_STATIC_GRAPH=1)." in out
    assert "ddp: find_unused_parameters=False static_graph=True" in out
