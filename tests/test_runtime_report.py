"""The configuration report and the seeds ``setup()`` sets."""

import random
from types import SimpleNamespace

import pytest
import torch

from nbddp.runtime import GPUInfo, MultiGPUConfig, RankInfo, get_multi_gpu_config, seed_everything
from nbddp.runtime.report import gpu_info

GIB = 2**30


def props(name, major, minor, gib):
    """The fields of ``torch.cuda.get_device_properties`` the report reads."""
    return SimpleNamespace(name=name, major=major, minor=minor, total_memory=int(gib * GIB))


def test_a_t4_has_fp16_but_no_native_bf16():
    t4 = gpu_info(0, props("Tesla T4", 7, 5, 15))
    assert (t4.fp16, t4.bf16) == (True, False)
    assert t4.describe() == "Tesla T4 (sm 7.5, 15.0 GiB): fp16, no native bf16"


def test_an_a100_has_both():
    a100 = gpu_info(0, props("NVIDIA A100-SXM4-40GB", 8, 0, 40))
    assert (a100.fp16, a100.bf16) == (True, True)


def test_the_summary_groups_identical_gpus_and_names_the_job():
    t4 = [gpu_info(i, props("Tesla T4", 7, 5, 15)) for i in range(2)]
    config = MultiGPUConfig(
        world_size=4, rank=0, local_rank=0, local_world_size=2, backend="nccl", device="cuda:0", seed=7, gpus=tuple(t4)
    )
    assert config.nodes == 2 and config.fp16 and not config.bf16
    assert config.summary().splitlines() == [
        "nbddp: 4 process(es) on 2 machines, backend nccl, rank 0 on cuda:0, seed 7",
        "nbddp:   2× Tesla T4 (sm 7.5, 15.0 GiB): fp16, no native bf16",
    ]


def test_mixed_gpus_support_bf16_only_if_all_do():
    gpus = (gpu_info(0, props("A", 8, 6, 24)), gpu_info(1, props("B", 7, 0, 16)))
    config = MultiGPUConfig(2, 0, 0, 2, "nccl", "cuda:0", 0, gpus)
    assert config.fp16 and not config.bf16
    assert len(config.summary().splitlines()) == 3


def test_on_this_machine(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    info = RankInfo(rank=1, local_rank=1, world_size=2, backend="gloo", device="cpu")
    config = get_multi_gpu_config(info, seed=0)
    assert (config.world_size, config.rank, config.local_rank, config.nodes) == (2, 1, 1, 1)
    assert config.gpus == tuple(gpu_info(i, torch.cuda.get_device_properties(i)) for i in range(torch.cuda.device_count()))
    if not config.gpus:
        assert not config.bf16 and not config.fp16
        assert config.summary() == "nbddp: 2 process(es), backend gloo, rank 0 on cpu, seed 0; no GPU: fp32 only"
    assert isinstance(config.gpus, tuple) and all(isinstance(g, GPUInfo) for g in config.gpus)


def draws():
    return random.random(), torch.rand(1).item()


def test_seeds_follow_nbddp_seed(monkeypatch):
    monkeypatch.setenv("NBDDP_SEED", "123")
    assert seed_everything() == 123
    first = draws()
    seed_everything()
    assert draws() == first
    monkeypatch.setenv("NBDDP_SEED", "124")
    seed_everything()
    assert draws() != first


def test_seeding_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("NBDDP_SEED", "off")
    seed_everything(0)  # an explicit seed still seeds
    draws()
    second = draws()
    seed_everything(0)
    draws()
    assert seed_everything() is None
    assert draws() == second  # the generators went on untouched, not reseeded


def test_a_bad_seed_is_named(monkeypatch):
    monkeypatch.setenv("NBDDP_SEED", "abc")
    with pytest.raises(ValueError, match="NBDDP_SEED must be a whole number"):
        seed_everything()


@pytest.mark.e2e
def test_every_rank_starts_from_the_same_seed_and_rank_0_reports_the_job(greeting_job):
    # shared_jobs.greeting_job ran with NBDDP_SEED=1234 (GREETING_SEED)
    result, out = greeting_job.job.run, greeting_job.streamed
    assert result.ok
    assert "nbddp: 2 process(es), backend " in out and ", seed 1234" in out
    draw0 = next(line for line in out.splitlines() if line.startswith("draw"))
    draw1 = next(line for line in result.rank_log(1).read_text().splitlines() if line.startswith("draw"))
    assert draw0 == draw1
    random.seed(1234)
    torch.manual_seed(1234)
    assert draw0 == f"draw {random.random()} {torch.rand(1).item()}"
