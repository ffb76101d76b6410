"""Token-balanced shards (runtime/balance.py): the dealing, the lengths, and the Trainer's route."""

from __future__ import annotations

import collections
import random
import statistics

import pytest
import torch
from torch.utils.data import BatchSampler, DistributedSampler

from nbddp.runtime import balance


def long_tailed(n: int, seed: int = 0) -> list[int]:
    """Instruction-data-like lengths: log-normal (median ~150 tokens, a tail past 1000), cut to 8..2048."""
    rng = random.Random(seed)
    return [min(2048, max(8, int(rng.lognormvariate(5.0, 0.9)))) for _ in range(n)]


def rank_lists(sampler_cls, lengths, world, epoch=0, seed=0, **kw):
    out = []
    for rank in range(world):
        if sampler_cls is DistributedSampler:
            s = DistributedSampler(lengths, num_replicas=world, rank=rank, shuffle=True, seed=seed, **kw)
        else:
            s = balance.TokenBalancedSampler(lengths, lengths, num_replicas=world, rank=rank, seed=seed, **kw)
        s.set_epoch(epoch)
        out.append(list(s))
    return out


def step_imbalance(ranks, lengths, batch) -> float:
    """Mean over steps of (most tokens − fewest tokens) / mean tokens among the ranks' micro-batches."""
    steps = min(len(r) for r in ranks) // batch
    spreads = []
    for s in range(steps):
        tokens = [sum(lengths[i] for i in r[s * batch:(s + 1) * batch]) for r in ranks]
        spreads.append((max(tokens) - min(tokens)) / statistics.mean(tokens))
    return statistics.mean(spreads)


@pytest.mark.parametrize("n,world,drop_last", [(1000, 2, False), (1001, 2, False), (1003, 4, False),
                                               (1003, 4, True), (37, 8, False)])
def test_each_epoch_holds_distributed_samplers_samples_every_one_once(n, world, drop_last):
    lengths = long_tailed(n)
    for epoch in (0, 1):
        balanced = rank_lists(balance.TokenBalancedSampler, lengths, world, epoch, drop_last=drop_last)
        plain = rank_lists(DistributedSampler, lengths, world, epoch, drop_last=drop_last)
        assert [len(r) for r in balanced] == [len(r) for r in plain]
        assert collections.Counter(sum(balanced, [])) == collections.Counter(sum(plain, []))
        if not drop_last:
            assert set(sum(balanced, [])) == set(range(n))
        if n % world == 0:
            assert sorted(sum(balanced, [])) == list(range(n))


@pytest.mark.parametrize("world,batch", [(2, 1), (2, 4), (4, 2), (8, 8)])
def test_per_step_token_imbalance_is_far_below_distributed_samplers(world, batch):
    lengths = long_tailed(4096)
    plain = step_imbalance(rank_lists(DistributedSampler, lengths, world), lengths, batch)
    balanced = step_imbalance(rank_lists(balance.TokenBalancedSampler, lengths, world), lengths, batch)
    assert plain > 0.3  # the long tail makes a random split uneven
    assert balanced < plain / 8, (balanced, plain)


def test_batches_keep_their_random_mix_of_lengths():
    """Not grouped by length: a micro-batch's padding (longest − mean) stays what random batches have."""
    lengths = long_tailed(4096)

    def padding(ranks, batch=4):
        pads = []
        for r in ranks:
            for s in range(0, len(r) - batch + 1, batch):
                chunk = [lengths[i] for i in r[s:s + batch]]
                pads.append(max(chunk) - statistics.mean(chunk))
        return statistics.mean(pads)

    plain = padding(rank_lists(DistributedSampler, lengths, 2))
    balanced = padding(rank_lists(balance.TokenBalancedSampler, lengths, 2))
    assert abs(balanced - plain) / plain < 0.15, (balanced, plain)


def test_order_changes_per_epoch_is_deterministic_and_each_rank_sees_the_same_deal():
    lengths = long_tailed(512)
    epoch0 = rank_lists(balance.TokenBalancedSampler, lengths, 2, epoch=0)
    epoch1 = rank_lists(balance.TokenBalancedSampler, lengths, 2, epoch=1)
    assert epoch0 != epoch1 and epoch0[0][:20] != epoch1[0][:20]
    assert epoch0 == rank_lists(balance.TokenBalancedSampler, lengths, 2, epoch=0)
    assert epoch0 != rank_lists(balance.TokenBalancedSampler, lengths, 2, epoch=0, seed=1)
    for rank in range(2):  # what each rank computes for every rank is what each rank then takes
        s = balance.TokenBalancedSampler(lengths, lengths, num_replicas=2, rank=rank)
        assert s.rank_lists() == epoch0


def test_fixed_lengths_or_no_shuffle_is_exactly_distributed_sampler():
    fixed = [64] * 101
    assert rank_lists(balance.TokenBalancedSampler, fixed, 2, epoch=3) == rank_lists(DistributedSampler, fixed, 2,
                                                                                     epoch=3)
    lengths = long_tailed(101)
    for rank in range(2):
        ours = balance.TokenBalancedSampler(lengths, lengths, num_replicas=2, rank=rank, shuffle=False)
        assert list(ours) == list(DistributedSampler(lengths, num_replicas=2, rank=rank, shuffle=False))


def accelerate_shards(sampler, world, batch):
    """What each rank's Trainer loader yields: accelerate's own batch sharding over the sampler."""
    from accelerate.data_loader import BatchSamplerShard

    batches = BatchSampler(sampler, batch, drop_last=False)
    return [list(BatchSamplerShard(batches, num_processes=world, process_index=r)) for r in range(world)]


@pytest.mark.parametrize("n,world,batch,accum", [(1000, 2, 4, 1), (1001, 2, 2, 4), (999, 4, 1, 2)])
def test_trainer_order_sharded_by_accelerate_is_balanced_and_covers_the_epoch(n, world, batch, accum):
    lengths = long_tailed(n)
    sampler = balance.BalancedGlobalSampler(lengths, world, batch, accum, seed=42)
    order = list(sampler)
    assert sorted(order) == list(range(n))
    shards = accelerate_shards(sampler, world, batch)
    assert set(i for shard in shards for b in shard for i in b) == set(range(n))
    flat = [[i for b in shard for i in b] for shard in shards]
    steps = (n // (world * batch)) * batch  # the whole rounds; accelerate completes the tail as it always does
    balanced = step_imbalance([f[:steps] for f in flat], lengths, batch)
    plain = step_imbalance([f[:steps] for f in (
        [[i for b in s for i in b] for s in accelerate_shards(torch.randperm(n).tolist(), world, batch)])],
        lengths, batch)
    assert balanced < plain / 5, (balanced, plain)
    sampler.set_epoch(1)
    assert list(sampler) != order


def test_lengths_from_arrow_columns_index_mappings_and_plain_datasets():
    import datasets

    lengths = long_tailed(200)
    ds = datasets.Dataset.from_dict({"input_ids": [[1] * n for n in lengths]})
    assert balance.dataset_lengths(ds) == lengths
    picked = ds.shuffle(seed=3).select(range(50))
    assert balance.dataset_lengths(picked) == [len(x) for x in picked["input_ids"]]
    with_column = ds.add_column("length", [7] * 200)
    assert balance.dataset_lengths(with_column) == [7] * 200
    plain = [{"input_ids": torch.ones(n)} for n in lengths[:20]]
    assert balance.dataset_lengths(plain) == lengths[:20]
    assert balance.dataset_lengths([(torch.ones(3), 1)]) is None
    assert balance.dataset_lengths(datasets.Dataset.from_dict({"text": ["a", "b"]})) is None


def test_distributed_sampler_helper_balances_unless_told_not_to(monkeypatch):
    data = [{"input_ids": [0] * n} for n in long_tailed(64)]
    assert isinstance(balance.sampler_for(data, 2, 0, shuffle=True), balance.TokenBalancedSampler)
    assert type(balance.sampler_for(data, 2, 0, shuffle=False)) is DistributedSampler
    assert type(balance.sampler_for([{"input_ids": [0] * 8}] * 64, 2, 0, shuffle=True)) is DistributedSampler
    monkeypatch.setenv("NBDDP_BALANCE", "0")
    assert type(balance.sampler_for(data, 2, 0, shuffle=True)) is DistributedSampler


def run_trainer_job(tmp_path, name: str, **env):
    """tests/jobs/balance_trainer.py on 2 gloo ranks under torchrun; each rank's record and rank 0's output."""
    import json
    from pathlib import Path

    from nbddp.launch import launch, new_run_dir, plan
    from nbddp.options import RunOptions

    out = tmp_path / name
    out.mkdir()
    env = {"OUT": str(out), **{k: str(v) for k, v in env.items()}}
    chunks = []
    job = Path(__file__).resolve().parent / "jobs" / "balance_trainer.py"
    result = launch(plan(job, new_run_dir(tmp_path / "runs", name), RunOptions(timeout_s=500), nproc=2, cwd=tmp_path,
                         env=env),
                    sink=lambda stream, text: chunks.append(text))
    text = "".join(chunks)
    assert result.ok, (result.failure and result.failure.message[:2000]) or text[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)], text


def pair_imbalance(records) -> float:
    """Mean over micro-steps of |tokens on rank 0 − tokens on rank 1| / their mean."""
    pairs = list(zip(records[0]["tokens"], records[1]["tokens"]))
    return statistics.mean(abs(a - b) / ((a + b) / 2) for a, b in pairs)


@pytest.mark.e2e
def test_a_trainer_job_under_torchrun_trains_on_token_balanced_shards(tmp_path):
    balanced, out = run_trainer_job(tmp_path, "balanced", N=96, BATCH=2, EPOCHS=2)
    assert "nbddp: token-balanced shards: every rank gets micro-batches of nearly equal token count" in out
    assert out.count("token-balanced shards") == 1
    plain, plain_out = run_trainer_job(tmp_path, "plain", N=96, BATCH=2, EPOCHS=2, NBDDP_BALANCE=0)
    assert "token-balanced" not in plain_out
    assert balanced[0]["sampler"] == "BalancedGlobalSampler" and plain[0]["sampler"] == "RandomSampler"
    for records in (balanced, plain):
        for epoch in ("0", "1"):
            both = records[0]["seen"][epoch] + records[1]["seen"][epoch]
            assert sorted(both) == list(range(96))  # every sample once per epoch, across the two ranks
    assert balanced[0]["seen"]["0"] != balanced[0]["seen"]["1"]  # a new order each epoch
    assert pair_imbalance(balanced) < pair_imbalance(plain) / 4, (pair_imbalance(balanced), pair_imbalance(plain))


def test_the_trainers_own_choices_keep_their_sampler(tmp_path):
    """group_by_length and other strategies, TRL's packing, an IterableDataset, a sampler of the Trainer's own."""
    from torch.utils.data import IterableDataset, RandomSampler, SequentialSampler
    from transformers import TrainingArguments
    from trl import SFTConfig

    def why(args, dataset=(), sampler=RandomSampler(range(4))):
        return balance._why_not(args, dataset, sampler, IterableDataset, RandomSampler)

    plain = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    assert why(plain) is None
    grouped = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none",
                                train_sampling_strategy="group_by_length")
    assert "group_by_length" in why(grouped)
    packed = SFTConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", packing=True)
    assert "packing" in why(packed)
    assert why(SFTConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", padding_free=True)) is None

    class Stream(IterableDataset):
        def __iter__(self):
            yield {"input_ids": [1]}

    assert "IterableDataset" in why(plain, Stream())
    assert "SequentialSampler" in why(plain, sampler=SequentialSampler(range(4)))
