"""A rank's share of a loop fed without a DataLoader, and a sharded loader made whole again (no ranks: the rank
is read from torchrun's environment variables)."""

import numpy
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from nbddp.runtime.loaders import shard_items, shard_range, whole_loader


@pytest.fixture
def rank(monkeypatch):
    def be(r, world=2):
        monkeypatch.setenv("RANK", str(r))
        monkeypatch.setenv("WORLD_SIZE", str(world))

    return be


def test_each_rank_takes_its_own_batch_positions_as_many_as_the_others(rank):
    positions = range(0, 60, 8)  # 8 positions
    rank(0)
    first = list(shard_range(positions))
    rank(1)
    second = list(shard_range(positions))
    assert first == [0, 16, 32, 48] and second == [8, 24, 40, 56]
    rank(2, world=3)
    assert list(shard_range(positions)) == [16, 40]  # 8 positions over 3 ranks: 2 each, the last 2 left out
    assert list(shard_range(range(2))) == [0, 1]  # fewer positions than ranks: as given


def test_samples_of_a_list_a_tensor_an_array_or_a_dataset_are_shared_and_a_loader_is_not(rank):
    rank(1)
    assert shard_items(list("abcde")) == ["b", "d"]
    assert shard_items(torch.arange(6)).tolist() == [1, 3, 5]
    assert shard_items(numpy.arange(4)).tolist() == [1, 3]
    data = TensorDataset(torch.arange(6.0))
    assert [x.item() for (x,) in shard_items(data)] == [1.0, 3.0, 5.0]
    loader = DataLoader(data, batch_size=2)
    assert shard_items(loader) is loader and shard_items({"a": 1, "b": 2}) == {"a": 1, "b": 2}


def test_a_sharded_loader_is_whole_again_for_rank_zeros_metrics():
    data = TensorDataset(torch.arange(10.0))
    sharded = DataLoader(data, batch_size=4, sampler=DistributedSampler(data, num_replicas=2, rank=0, shuffle=True))
    assert sum(len(x) for (x,) in sharded) == 5
    whole = whole_loader(sharded)
    assert sorted(v.item() for (x,) in whole for v in x) == list(map(float, range(10)))
    assert whole.batch_size == 4
    plain = DataLoader(data, batch_size=4)
    assert whole_loader(plain) is plain
