"""A rank whose work is done exits cleanly: no abort in gloo's worker threads at interpreter exit."""

import sys

import pytest
import torch

from nbddp.launch import launch, new_run_dir, plan
from nbddp.options import RunOptions
from nbddp.runtime import sync
from test_grad_ckpt import JOBS

#: With the runtime before the fix about one launch of two ranks in five aborted (SIGABRT, "terminate called
#: without an active exception"), and the test failed in its 5th launch of 2 ranks. What races is each rank's
#: own interpreter exit, so the test keeps its 16 racing exits (8 launches of 2 ranks before) in 2 launches of
#: 8 ranks: the ranks' start and exit are the work; each launch's agent and rendezvous are paid twice, not 8 times.
LAUNCHES, RANKS = 2, 8


@pytest.mark.e2e
def test_a_finished_job_never_aborts_at_exit(tmp_path):
    for attempt in range(LAUNCHES):
        chunks = []
        result = launch(plan(JOBS / "exit_race.py", new_run_dir(tmp_path / "runs", "exit_race"),
                             RunOptions(timeout_s=500), nproc=RANKS, cwd=tmp_path, env={}),
                        sink=lambda stream, text: chunks.append(text))
        out = "".join(chunks)
        assert result.ok, f"launch {attempt + 1}: {(result.failure and result.failure.message[-1500:]) or out[-1500:]}"
        assert "JOB OK" in out
        assert "terminate called" not in out
        logs = [result.rank_log(rank, "stderr") for rank in range(RANKS)]  # every rank's exit, not rank 0's alone
        aborted = [rank for rank, log in enumerate(logs) if log and "terminate called" in log.read_text()]
        assert not aborted, f"launch {attempt + 1}: rank(s) {aborted} aborted at exit"


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
