"""Stop in a kept job (a real kernel, 2 gloo ranks): during the --keep cell's own training the ranks stop at a step
and stay up; during a plain %%ddp loop every rank is interrupted where it is within a second, and the ranks stay up
with what they hold. Neither is called a failure."""

from __future__ import annotations

import re
import time

import pytest
from jupyter_client.manager import start_new_kernel

from kernel import kernel_env
from test_interrupt import execute, finish
from test_kept_kernel import SETUP

pytestmark = pytest.mark.e2e

LONG_SETUP = SETUP.replace("max_steps=30", "max_steps=100000")
TRAIN = "%%ddp_train --keep --nproc 2\ntrainer.train()\n"
TRAINING = re.compile(r"\b([2-9]|[1-9]\d+)/100000\b")
HELD = ("%%ddp\nheld = sum(p.detach().double().sum().item() for p in model.parameters())\n"
        "step = trainer.state.global_step\nprint('held at step', step)")
LOOP = "%%ddp\nimport time\nfor i in range(60):\n    time.sleep(1)\n    print('tick', i, flush=True)\n"
SLOW_RANK1 = "%%ddp --timeout 8\nimport time\nif torch.distributed.get_rank() == 1:\n    time.sleep(60)\nprint('rank 0 done')\n"
EVALUATE = "%%ddp\nprint('evaluating', flush=True)\nmetrics = trainer.evaluate()\n"
STUCK = ("%%ddp\nimport time\nprint('waiting', flush=True)\nif torch.distributed.get_rank() == 1:\n"
         "    torch.distributed.all_reduce(torch.ones(1))\nelse:\n    time.sleep(60)\n")
AFTER = ("%%ddp\nsame = sum(p.detach().double().sum().item() for p in model.parameters()) == held\n"
         "total = torch.ones(1)\ntorch.distributed.all_reduce(total)\n"
         "print('after', same, trainer.state.global_step == step, int(total.item()))")


def _said(errors) -> str:
    return "\n".join(f"{e['ename']}: {e['evalue']}\n" + "\n".join(e["traceback"]) for e in errors)


def test_stop_keeps_the_ranks_in_the_keep_training_and_in_a_plain_loop(tmp_path):
    km, kc = start_new_kernel(kernel_name="python3", env=kernel_env(NBDDP_CACHE=str(tmp_path / "cache")),
                              cwd=str(tmp_path))
    try:
        assert execute(kc, "%load_ext nbddp")[0] == "ok"
        assert execute(kc, LONG_SETUP)[0] == "ok"

        # Stop during the --keep cell's own training: it stops at a step, and the ranks stay up
        began = time.monotonic()
        msg_id, text, _ = execute(kc, TRAIN, until=lambda t: TRAINING.search(t) is not None)
        km.interrupt_kernel()
        said = _said(finish(kc, msg_id, timeout=120))
        kept_at = time.monotonic()
        assert "JobInterrupted" in said and "the ranks are kept" in said and "Failed" not in said, said
        status, text, errors = execute(kc, HELD)
        assert status == "ok" and re.search(r"held at step [1-9]", text), (text, errors)

        # Stop during an evaluation: every rank stops at the same prediction step, none left inside a gather
        prepared = ("%%ddp\nimport datasets\n"
                    "trainer.eval_dataset = datasets.concatenate_datasets([trainer.train_dataset] * 100)")
        assert execute(kc, prepared)[0] == "ok"  # prepared already: the Stop comes inside the evaluation loop
        msg_id, text, _ = execute(kc, EVALUATE, until=lambda t: "evaluating" in t)
        time.sleep(1.5)
        km.interrupt_kernel()
        said = _said(finish(kc, msg_id, timeout=60))
        assert "interrupted at line 3 of this %%ddp cell (metrics = trainer.evaluate()), the ranks are kept" \
            in said, said

        # Stop during a plain loop: every rank interrupted where it is, the cell over within a second or so
        msg_id, text, _ = execute(kc, LOOP, until=lambda t: "tick 1" in t)
        pressed = time.monotonic()
        km.interrupt_kernel()
        said = _said(finish(kc, msg_id, timeout=60))
        took = time.monotonic() - pressed
        print(f"Stop in a plain %%ddp loop: the cell ended {took:.2f} s after the interrupt")
        assert took < 5, took  # 1 s on a quiet machine; the bound leaves room for a shared one
        assert "interrupted at line 4 of this %%ddp cell (time.sleep(1)), the ranks are kept" in said, said
        assert "Failed" not in said, said
        # one rank done, the other not: said while the cell waits (which rank, where), then --timeout stops it
        msg_id, text, _ = execute(kc, SLOW_RANK1, until=lambda t: "still running" in t)
        said = _said(finish(kc, msg_id, timeout=60))
        assert re.search(r"rank 1 is still running this cell, at line 4 of this %%ddp cell \(time\.sleep\(60\)\), "
                         r"\d+ s after rank\(s\) 0 finished", text), text
        assert "timed out after 8 s (--timeout) at line 4 of this %%ddp cell (time.sleep(60)), the ranks are kept" in said
        status, text, errors = execute(kc, AFTER)
        assert status == "ok" and "after True True 2" in text, (text, errors)
        # what was sent where; how long the ranks have been up: from the job's start, not from its training's end
        status, text, _ = execute(kc, "shared = {'scale': 21}\n%ddp_push shared")
        assert status == "ok" and re.search(r"nbddp: sent shared \(dict, \d+ bytes\) to rank\(s\) 0, 1", text), text
        since_kept, since_cell = time.monotonic() - kept_at, time.monotonic() - began
        status, text, _ = execute(kc, "%ddp_status")
        up = re.search(r"up (?:(\d+) min )?(\d+) s", text)
        up_s = int(up[1] or 0) * 60 + int(up[2]) if up else -1
        # the ranks' start-up and training before the Stop count; the cell's conversion before launch does not
        assert since_kept + 3 <= up_s <= since_cell + 1, (text, since_kept, since_cell)

        # a rank stuck inside a collective the interrupted rank left: the job is ended, said why and where
        msg_id, text, _ = execute(kc, STUCK, until=lambda t: "waiting" in t)
        km.interrupt_kernel()
        said = _said(finish(kc, msg_id, timeout=60))
        assert "JobInterrupted" in said and "Failed" not in said, said
        assert "rank(s) 1 did not come back from the Stop: stuck inside a collective" in said, said
        assert "rank 1 was at line 5 of this %%ddp cell (torch.distributed.all_reduce(torch.ones(1)))" in said, said
        assert "no kept job" in execute(kc, "%ddp_status")[1]
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
