"""A rank whose work is done exits cleanly: no abort in gloo's worker threads at interpreter exit."""

import sys

import pytest
import torch

from nbddp.runtime import sync
from test_grad_ckpt import run_job

#: Launches of the racing job: with the runtime before the fix about one in five aborted (SIGABRT, "terminate
#: called without an active exception"), and this test failed in its 5th launch.
LAUNCHES = 8


@pytest.mark.e2e
def test_a_finished_job_never_aborts_at_exit(tmp_path):
    for attempt in range(LAUNCHES):
        result, out = run_job(tmp_path / str(attempt), "exit_race.py", shim=True)
        assert result.ok, f"launch {attempt + 1}: {(result.failure and result.failure.message[-1500:]) or out[-1500:]}"
        assert "JOB OK" in out
        assert "terminate called" not in out


def test_the_final_wait_starts_its_collective_with_no_python_state_and_restores_it():
    torch.set_default_device("cpu")  # pushes a torch-function mode
    try:
        torch._C._stash_obj_in_tls("context", object())
        before = torch._C._len_torch_function_stack()
        with sync.no_python_thread_state():
            assert torch._C._len_torch_function_stack() == 0
            assert not torch._C._is_key_in_tls("context")
        assert torch._C._len_torch_function_stack() == before == 1
        assert torch._C._is_key_in_tls("context")
    finally:
        torch._C._remove_obj_from_tls("context")
        torch.set_default_device(None)
