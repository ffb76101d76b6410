"""``_nbddp.data_parallel``, what a notebook's ``nn.DataParallel`` becomes: DDP in a process group, the notebook's
DataParallel in a single process, and rank 0's model after training a DataParallel again (``_nbddp.unwrap``)."""

import torch

from nbddp.runtime import data_parallel, unwrap


def test_a_single_process_gets_the_notebooks_data_parallel():
    model = torch.nn.Linear(2, 1)
    wrapped = data_parallel(model, device_ids=None)
    assert type(wrapped) is torch.nn.DataParallel and wrapped.module is model


def test_in_a_group_it_is_ddp_and_comes_back_as_a_data_parallel(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        model = torch.nn.Linear(2, 1)
        wrapped = data_parallel(model, device_ids=[0, 1])
        assert isinstance(wrapped, torch.nn.parallel.DistributedDataParallel) and wrapped.module is model
        assert sorted(wrapped.state_dict()) == ["module.bias", "module.weight"]  # as DataParallel's keys
        after = unwrap(wrapped)
        assert type(after) is torch.nn.DataParallel and after.module is model
        assert sorted(after.state_dict()) == ["module.bias", "module.weight"]
        assert torch.equal(after(torch.ones(3, 2)), model(torch.ones(3, 2)))  # no collective in its forward
        plain = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 1))
        assert unwrap(plain) is plain.module  # nbddp's own wrap unwraps to the module as before
    finally:
        dist.destroy_process_group()
