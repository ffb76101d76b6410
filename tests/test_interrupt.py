"""The stop button: a kernel interrupt mid-training ends every rank and torchrun, and the cell runs again at once."""

import time

import pytest
from jupyter_client.manager import start_new_kernel

from conftest import no_rank_processes
from kernel import kernel_env

pytestmark = pytest.mark.e2e

TICKING = '''%%ddp_train --nproc 2 --every-rank
import time
for i in range(600):
    print("tick", i, flush=True)
    time.sleep(0.1)'''


def execute(kc, code, timeout=300, until=None):
    """Run ``code``; return (reply status, stdout+stderr text, error contents). ``until(text)`` is called as
    output arrives; when it returns True, the waiting stops there and the caller takes over."""
    msg_id = kc.execute(code)
    text, errors = "", []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        msg = kc.get_iopub_msg(timeout=deadline - time.monotonic())
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream" or kind in ("display_data", "update_display_data"):
            # rank 0's lines are in the cell's log view, a display updated in place: its text as it is now
            text += content["text"] if kind == "stream" else content["data"].get("text/plain", "") + "\n"
            if until and until(text):
                return msg_id, text, errors
        elif kind == "error":
            errors.append(content)
        elif kind == "status" and content["execution_state"] == "idle":
            return reply(kc, msg_id)["status"], text, errors
    raise TimeoutError(f"no answer within {timeout} s; output so far:\n{text}")


def reply(kc, msg_id):
    """The shell channel's execute reply to ``msg_id`` (replies to earlier requests are passed over)."""
    while True:
        msg = kc.get_shell_msg(timeout=30)
        if msg["parent_header"].get("msg_id") == msg_id:
            return msg["content"]


def finish(kc, msg_id, timeout=60):
    """Wait for the end of a cell already running; return its errors."""
    errors = []
    while True:
        msg = kc.get_iopub_msg(timeout=timeout)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "error":
            errors.append(msg["content"])
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            assert reply(kc, msg_id)["status"] == "error"
            return errors


def test_interrupting_the_kernel_stops_every_rank_and_a_rerun_works(tmp_path):
    km, kc = start_new_kernel(kernel_name="python3", env=kernel_env(), cwd=str(tmp_path))
    try:
        assert execute(kc, "%load_ext nbddp")[0] == "ok"
        msg_id, text, _ = execute(kc, TICKING, until=lambda t: "tick 3" in t)
        assert not no_rank_processes(str(tmp_path))  # training is under way

        pressed = time.monotonic()
        km.interrupt_kernel()
        errors = finish(kc, msg_id)
        assert time.monotonic() - pressed < 5
        assert no_rank_processes(str(tmp_path))
        (error,) = errors
        assert error["ename"] == "JobInterrupted" and "every rank and torchrun have exited" in error["evalue"]
        assert error["traceback"] == [f"JobInterrupted: {error['evalue']}"]

        status, text, errors = execute(kc, '%%ddp_train --nproc 2 --every-rank\nimport os\nprint("again on", os.environ["RANK"])')
        assert status == "ok" and not errors and "again on 0" in text and "finished in" in text, (text, errors)
        assert no_rank_processes(str(tmp_path))
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
