"""DDP × gradient checkpointing on two gloo ranks: each failure reproduced with the shim forced off, then
fixed with it on. One launch per shim setting runs every case in turn (tests/jobs/ckpt_cases.py: the tiny Llama
with LoRA, a frozen base, for 3–4 steps, in a hand-written loop or the HF Trainer); each case's lines are
checked on their own, so any one case regressing fails the test and names the case."""

import re
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


def run_cases(tmp_path, cases: list[str], shim: bool):
    """Run the cases in one job (tests/jobs/ckpt_cases.py). Returns the result, rank 0's whole output and each
    case's part of it (from its ``CASE <name>`` line to the next case's)."""
    result, out = run_job(tmp_path, "ckpt_cases.py", shim, CASES=",".join(cases))
    starts = [(m.group(1), m.start()) for m in re.finditer(r"^CASE (\w+)\n", out, re.M)]
    assert [name for name, _ in starts] == cases, out[-3000:]
    ends = [start for _, start in starts[1:]] + [len(out)]
    return result, out, {name: out[start:end] for (name, start), end in zip(starts, ends)}


def assert_case_fails_with(part, name, text):
    assert f"CASE {name} ERROR:" in part, f"{name} did not fail:\n{part[-2000:]}"
    assert text in part, f"{name}:\n{part[-2000:]}"


def assert_case_trains(part, name):
    assert f"CASE {name} OK" in part, f"{name} did not train:\n{part[-3000:]}"


def assert_job_fails_with(result, text):
    assert not result.ok
    assert result.failure is not None, "no error record"
    assert text in result.failure.message, result.failure.message[:2000]


def test_without_the_shim_each_checkpointing_case_fails_as_torch_does(tmp_path):
    cases = ["trainer_reentrant", "loop_empty", "loop_direct", "loop_vary_static", "trainer_static_accum"]
    result, out, part = run_cases(tmp_path, cases, shim=False)
    # the Trainer picks find_unused_parameters=True for a PeftModel, and reentrant checkpointing breaks it
    assert_case_fails_with(part["trainer_reentrant"], "trainer_reentrant", READY_TWICE)
    # checkpointing that does not say use_reentrant: torch's default is still reentrant
    for name in ("loop_empty", "loop_direct"):
        assert_case_fails_with(part[name], name, READY_TWICE)
    # static_graph while the parameters used change between steps
    assert_case_fails_with(part["loop_vary_static"], "loop_vary_static", GRAPH_CHANGED)
    assert "static_graph" in part["loop_vary_static"].split("ERROR:", 1)[1]
    # static_graph with gradient accumulation trips the reducer (the last case: the job's own error record)
    assert_job_fails_with(result, ACCUMULATION_ASSERT)
    assert "CASE trainer_static_accum OK" not in out and "JOB OK" not in out


def test_with_the_shim_each_checkpointing_case_trains_or_is_named_before_ddp_fails(tmp_path):
    cases = ["trainer_reentrant", "loop_empty", "loop_direct", "loop_vary_static", "trainer_static_accum",
             "trainer_forced_static", "loop_direct_reentrant"]
    result, out, part = run_cases(tmp_path, cases, shim=True)
    # before any case (test_shims_compat.py's setup-imports check): a rank's setup imports none of the
    # notebook's libraries, and importing the Trainer brings nbddp's metrics callback with it
    head = out[:out.index("CASE ")]
    assert "imported by setup: []" in head and "metrics callback: True" in head, head[-2000:]
    for name in cases[:-1]:
        assert_case_trains(part[name], name)

    p = part["trainer_reentrant"]  # find_unused_parameters turned off for reentrant checkpointing
    assert "nbddp: Gradient checkpointing detected on" in p and "reentrant (use_reentrant=True)" in p
    assert "ddp: find_unused_parameters=False static_graph=False" in p

    for name in ("loop_empty", "loop_direct"):  # made non-reentrant: DDP as the script asked
        assert "ddp: find_unused_parameters=True" in part[name], part[name][-2000:]
    assert "non-reentrant (use_reentrant not set; nbddp's default)" in part["loop_empty"]

    p = part["loop_vary_static"]
    assert "nbddp: DDP static_graph turned off: non-reentrant checkpointing does not need it" in p

    p = part["trainer_static_accum"]
    assert "nbddp: DDP static_graph turned off: gradient accumulation is 2 steps" in p
    assert "ddp: find_unused_parameters=False static_graph=False" in p

    p = part["trainer_forced_static"]  # reentrant checkpointing with a static graph at accumulation 1 is fine
    assert "nbddp: DDP static_graph=True (NBDDP_DDP_STATIC_GRAPH=1)." in p
    assert "ddp: find_unused_parameters=False static_graph=True" in p

    # a reentrant checkpoint in the script's own forward: invisible when DDP is built, and insisted on; nbddp
    # cannot repair it, but says why in plain words (the last case: the job's own error record)
    assert_job_fails_with(result, READY_TWICE)
    p = part["loop_direct_reentrant"]
    assert "nbddp: torch.utils.checkpoint(..., use_reentrant=True) runs inside a DDP model built with" in p
    assert "JOB OK" not in out
