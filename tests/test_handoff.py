"""``_nbddp.for_accelerate``: what nbddp distributed for plain loops goes to ``accelerator.prepare`` as the
notebook made it (the two-rank run of course ch3 §4 is in ``test_runnable_corpus.py``)."""

import torch
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, SequentialSampler

from nbddp.runtime import for_accelerate


def collate(batch):
    return torch.stack(batch)


def test_a_loader_over_nbddps_sampler_comes_back_whole_with_its_arguments():
    data = list(torch.arange(10.0))
    sharded = DataLoader(data, sampler=DistributedSampler(data, num_replicas=2, rank=0, shuffle=True),
                         batch_size=3, collate_fn=collate, drop_last=True)
    whole = for_accelerate(sharded)
    assert isinstance(whole.sampler, RandomSampler) and len(whole.dataset) == 10
    assert (whole.batch_size, whole.collate_fn, whole.drop_last) == (3, collate, True)
    assert sorted(x for b in whole for x in b.tolist()) != sorted(x for b in sharded for x in b.tolist())
    in_order = DataLoader(data, sampler=DistributedSampler(data, num_replicas=2, rank=0, shuffle=False))
    assert isinstance(for_accelerate(in_order).sampler, SequentialSampler)


def test_what_nbddp_did_not_touch_is_handed_over_as_it_is():
    data = list(range(4))
    plain, model = DataLoader(data, shuffle=True), torch.nn.Linear(2, 2)
    assert for_accelerate(plain) is plain and for_accelerate(model) is model and for_accelerate(3) == 3


def test_a_model_in_ddp_comes_back_as_the_module(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        model = torch.nn.Linear(2, 2)
        assert for_accelerate(torch.nn.parallel.DistributedDataParallel(model)) is model
    finally:
        dist.destroy_process_group()
