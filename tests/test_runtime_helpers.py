"""The runtime helpers the plain-PyTorch rules call, in a real process group (gloo, world of 2)."""

import subprocess
import sys
import textwrap

import pytest

from conftest import ROOT

RANK = textwrap.dedent(
    """
    import json, os, sys
    import torch
    import nbddp.runtime as _nbddp

    _nbddp.setup()
    info = _nbddp.rank_info()
    model = torch.nn.Sequential()
    model.add_module("body", torch.nn.Linear(2, 4))
    model.add_module("head", torch.nn.Linear(4, 1))
    model.note = "mine"
    wrapped = _nbddp.ddp(model)
    data = list(range(10))
    sampler = _nbddp.distributed_sampler(data, shuffle=True)
    loader = torch.utils.data.DataLoader(data, batch_size=5, sampler=sampler)
    first = list(sampler)
    _nbddp.set_epoch(loader, 1)
    _nbddp.set_epoch([1, 2], 1)  # not a loader with a DistributedSampler: nothing happens
    wrapped.note = "set after the wrap"  # net.output_type = ["loss"]: what the model's forward reads
    wrapped.require_backward_grad_sync = True  # DDP's own attribute stays DDP's
    import copy
    copied = copy.deepcopy(wrapped)  # the notebook keeps a copy of its model (peft's MLP example)
    out = {
        "copy": [type(copied).__name__, sorted(dict(copied.named_parameters()))],
        "wrapped": type(wrapped).__name__, "again": _nbddp.ddp(wrapped) is wrapped,
        "head": wrapped.head is model.head, "note": wrapped.note, "unwrap": _nbddp.unwrap(wrapped) is model,
        "set_through": [model.note, "note" in vars(wrapped), "require_backward_grad_sync" in vars(model)],
        "device": str(_nbddp.device()), "share": first, "reshuffled": list(sampler) != first,
        "indexed": wrapped[1] is model.head and [m for m in wrapped] == [model.body, model.head]
                   and len(wrapped) == 2 and bool(_nbddp.ddp(torch.nn.Linear(1, 1))),
    }
    with open(os.path.join(sys.argv[1], f"rank{info.rank}.json"), "w") as fh:
        json.dump(out, fh)
    _nbddp.cleanup()
    """
)


@pytest.mark.e2e
def test_ddp_unwrap_sampler_and_set_epoch_on_two_ranks(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script), str(tmp_path)],
        capture_output=True, text=True, timeout=300, env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    import json

    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for r in ranks:
        assert r["wrapped"] == "NotebookDDP" and r["again"] and r["head"] and r["unwrap"]
        assert r["note"] == "set after the wrap" and r["set_through"] == ["set after the wrap", False, False]
        assert r["device"] == "cpu" and r["reshuffled"] and len(r["share"]) == 5 and r["indexed"]
        # a deep copy of a wrapped model is a copy of the notebook's model: no wrapper, no "module." names
        assert r["copy"] == ["Sequential", ["body.bias", "body.weight", "head.bias", "head.weight"]]
    assert sorted(ranks[0]["share"] + ranks[1]["share"]) == list(range(10))  # disjoint halves


def test_only_the_converters_guard_gathers_sharded_models_under_fsdp(monkeypatch):
    """Gathering a plain loop's sharded models is a collective: ``on_rank0`` (the guard the converter writes,
    which every rank reaches) does it, ``is_main_process`` (which code may ask on rank 0 alone) never does."""
    import nbddp.runtime as rt
    from nbddp.runtime import apply_strategy

    gathered = []
    monkeypatch.setattr(apply_strategy, "gather_for_rank0_code", lambda: gathered.append(True))
    monkeypatch.setenv("NBDDP_STRATEGY", "fsdp")
    assert rt.is_main_process() and gathered == []
    assert rt.on_rank0() and gathered == [True]
    monkeypatch.setenv("NBDDP_STRATEGY", "ddp")
    assert rt.on_rank0() and gathered == [True]
