"""Every name a kept job's %%ddp cell binds exists on every rank afterwards (issue 40): the cell runs on every
rank, its writes on rank 0 once with the names they bind sent to the others (``runtime/from_rank0.py``)."""

from __future__ import annotations

import os
import signal
import threading

import pytest
import torch

from kernel import errors, kernel_env, stream
from test_kept_kernel import SMALL_SETUP, SMALL_TRAIN, STILL, STOP, _client, _kernel_family, _run

from nbddp.runtime.from_rank0 import NOT_SENT, UNBOUND, VALUE, RankZeroOnly, pack, unpack


def test_rank0s_names_reach_another_rank_as_rank0_holds_them(tmp_path):
    rank0 = {"commit": {"url": "https://hf.co/me/x", "weights": torch.ones(2)}, "fh": open(tmp_path / "f", "w")}
    rank0["fh"].close()
    packed = pack(rank0, ("commit", "fh", "gone"))
    assert [packed[n][0] for n in ("commit", "fh", "gone")] == [VALUE, NOT_SENT, UNBOUND]
    other = {"gone": "an older value rank 0 no longer holds"}
    unpack(packed, other, "cpu")
    assert other["commit"]["url"] == "https://hf.co/me/x" and torch.equal(other["commit"]["weights"], torch.ones(2))
    assert "gone" not in other  # as on rank 0
    # what rank 0 could not send: a stand-in that says so when used, never a value rank 0 does not hold
    assert isinstance(other["fh"], RankZeroOnly) and "fh exists on rank 0 only" in repr(other["fh"])
    for use in (lambda fh: fh.closed, lambda fh: fh.write("x"), lambda fh: bool(fh), lambda fh: str(fh)):
        with pytest.raises(NameError, match=r"fh exists on rank 0 only: its value \(TextIOWrapper\) cannot be sent"):
            use(other["fh"])


def test_another_rank_takes_rank0s_answer_once_it_is_there_and_the_last_reader_removes_it():
    """The other ranks wait for rank 0's answer in Python, where a Stop can interrupt them (no collective)."""
    import importlib

    module = importlib.import_module("nbddp.runtime.from_rank0")
    store = torch.distributed.HashStore()  # the process group's store, in this process
    threading.Timer(0.05, store.set, ("nbddp/from_rank0/ddp-cell-1.py:3", b"answer")).start()
    assert module._take(store, "nbddp/from_rank0/ddp-cell-1.py:3", readers=2) == b"answer"
    assert store.check(["nbddp/from_rank0/ddp-cell-1.py:3"])  # one rank still to read it
    assert module._take(store, "nbddp/from_rank0/ddp-cell-1.py:3", readers=2) == b"answer"
    assert not store.check(["nbddp/from_rank0/ddp-cell-1.py:3"])


def test_a_kept_block_sees_the_model_unwrapped_and_leaves_it_wrapped():
    """Rank 0's write sees the model as the notebook had it (saves its own keys; no DDP forward on rank 0 alone);
    afterwards every rank holds the wrapper again, so a later training still syncs."""
    from nbddp.runtime import from_rank0

    class Wrapper:  # as runtime/dist.unwrap knows a wrapper that says what the notebook had (DataParallel's)
        def __init__(self, inner):
            self._nbddp_unwrapped = lambda: inner

    inner = torch.nn.Linear(2, 1)
    namespace = {"model": Wrapper(inner)}
    wrapper = namespace["model"]
    with from_rank0(namespace, unwrapped=("model",)):
        assert namespace["model"] is inner
    assert namespace["model"] is wrapper
    with from_rank0(namespace, "model", unwrapped=("model",)):  # rebound in the block: kept (and sent) as bound
        namespace["model"] = replaced = torch.nn.Linear(2, 1)
    assert namespace["model"] is replaced


#: The kept job, with code after its training: what it binds is on every rank too, and its save is rank 0's.
TRAIN = SMALL_TRAIN + "rows = 8\nprint('rows', rows)\ntorch.save(model.state_dict(), 'small.pt')\n"
NAMES = "%%ddp\nn_test = len(torch.arange(5))\nprint('n_test', n_test)\n"
REDUCE = ("%%ddp\ntotal = torch.tensor([float(n_test + rows), float(isinstance(model, torch.nn.parallel.DistributedDataParallel))])\n"
          "torch.distributed.all_reduce(total)\nprint('total', total.tolist())\n")
WRITE = "%%ddp\nwith open('kept-notes.txt', 'a') as fh:\n    written = fh.write('kept\\n')\nprint('wrote', written)\n"
SENT = ("%%ddp\nsent = torch.tensor([float(written), float('rank 0 only' in repr(fh) or fh.closed)])\n"
        "torch.distributed.all_reduce(sent)\nprint('sent', sent.tolist())\n")
SLOW_WRITE = "%%ddp\nimport time\nwith open('slow.txt', 'w') as slow:\n    time.sleep(60)\nprint('not reached')\n"
FAILED_WRITE = "%%ddp\nwith open('no-such-folder/x.txt', 'w') as out:\n    out.write('x')\n"


@pytest.mark.e2e
def test_a_name_a_ddp_cell_binds_is_on_every_rank_for_the_next_cells_all_reduce(tmp_path):
    nb, client = _client(tmp_path)
    with client.setup_kernel(env=kernel_env(NBDDP_CACHE=str(tmp_path / "cache"))):
        cells = _run(client, nb, ["%load_ext nbddp", SMALL_SETUP, TRAIN])
        assert not any(errors(c) for c in cells), [errors(c) for c in cells]

        names, reduce, write, sent = _run(client, nb, [NAMES, REDUCE, WRITE, SENT])
        assert not any(errors(c) for c in (names, reduce, write, sent)), [errors(c) for c in (names, reduce, write, sent)]
        assert "n_test 5" in stream(names, "stdout") and "on rank 0" not in stream(names, "stdout")
        # rank 1 held n_test and rows too, as the kernel's process would, and its model is still DDP's
        assert "total [26.0, 2.0]" in stream(reduce, "stdout")
        assert sorted(torch.load(tmp_path / "small.pt")) == ["bias", "weight"]  # saved by rank 0, the model's own keys
        # the write ran once, on rank 0, and said so; what it bound reached rank 1 (the open file as a stand-in)
        assert (tmp_path / "kept-notes.txt").read_text() == "kept\n"
        assert ("nbddp: warning: this %%ddp cell, line 2: runs on rank 0 only, as it writes or pushes, then fh, "
                "written sent from rank 0 to every rank") in stream(write, "stdout")
        assert "sent [10.0, 2.0]" in stream(sent, "stdout")

        # rank 0's write failing: every rank fails at that line alike, and the job is kept
        failed, still = _run(client, nb, [FAILED_WRITE, STILL])
        text = "\n".join(errors(failed)[0].traceback)
        assert "FileNotFoundError" in text and "line 2" in text and "kept job was ended" not in text, text
        assert "still kept, world 2" in stream(still, "stdout"), still.outputs

        # Stop while rank 0 writes alone (the others wait for what it binds): an interrupt on every rank, kept
        timer = threading.Timer(6, os.kill, (_kernel_family(client)[0].pid, signal.SIGINT))
        timer.start()
        slow, still = _run(client, nb, [SLOW_WRITE, STILL])
        timer.join()
        text = "\n".join(errors(slow)[0].traceback)
        assert "the ranks are kept" in text and "Failed" not in text and "not reached" not in stream(slow, "stdout"), text
        assert "still kept, world 2" in stream(still, "stdout"), still.outputs
        (stop,) = _run(client, nb, [STOP])
        assert "every rank has exited" in stream(stop, "stdout")
