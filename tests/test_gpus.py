"""The launcher's GPUs from NVIDIA's driver (``gpus.py``), read without torch: the query parsed, and
``CUDA_VISIBLE_DEVICES`` applied as CUDA applies it."""

import os
import stat

import pytest

from nbddp import gpus
from nbddp.gpus import Gpu, apply_visible, parse_query

QUERY = "0, GPU-aaaa-1111, 15095\n1, GPU-bbbb-2222, 14000\n"
TWO = parse_query(QUERY)


def test_the_query_is_read_with_free_memory_in_bytes():
    assert TWO == (Gpu(0, "GPU-aaaa-1111", 15095 * 2**20), Gpu(1, "GPU-bbbb-2222", 14000 * 2**20))
    assert parse_query("") == ()
    assert parse_query("0, GPU-x, [N/A]\n") is None  # unreadable: the caller asks torch


@pytest.mark.parametrize("visible, indices", [
    (None, [0, 1]), ("", []), ("1", [1]), ("1,0", [1, 0]), ("0,7,1", [0]), ("-1", []), ("GPU-bbbb", [1]),
    ("GPU-", []),  # a prefix naming two GPUs names none
    ("0,0", [0]),
])
def test_cuda_visible_devices_is_applied_as_cuda_applies_it(visible, indices):
    assert [g.index for g in apply_visible(TWO, visible)] == indices


def test_mig_instances_are_left_to_torch():
    assert apply_visible(TWO, "MIG-1234") is None


@pytest.mark.e2e
def test_visible_gpus_asks_nvidia_smi(tmp_path, monkeypatch):
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\ncat <<'END'\n" + QUERY + "END\n")
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert gpus.visible_gpus() == (TWO[1],)
    smi.write_text("#!/bin/sh\nexit 9\n")
    assert gpus.visible_gpus() is None


def test_one_reading_gives_the_count_and_the_free_memory(tmp_path, monkeypatch):
    asked = []
    monkeypatch.setattr(gpus, "query", lambda timeout_s=10.0: asked.append(1) or QUERY)
    monkeypatch.setattr(gpus, "GPU_DEVICE_FILES", (str(tmp_path / "none"),))
    monkeypatch.delenv("NBDDP_GPU_COUNT", raising=False)
    monkeypatch.delenv("NBDDP_GPU_MEMORY_GIB", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert gpus.read_machine() == gpus.Machine(0) and asked == []  # no driver: nothing asked
    (tmp_path / "none").write_text("")
    assert gpus.read_machine() == gpus.Machine(2, (15095 * 2**20, 14000 * 2**20)) and len(asked) == 1
    monkeypatch.setenv("NBDDP_GPU_MEMORY_GIB", "10")
    assert gpus.read_machine().free_bytes == (10 * 2**30,) * 2 and len(asked) == 2
    monkeypatch.setenv("NBDDP_GPU_COUNT", "4")  # a machine stated whole: nothing asked
    assert gpus.read_machine() == gpus.Machine(4, (10 * 2**30,) * 4) and len(asked) == 2
    assert gpus.read_machine(memory=False) == gpus.Machine(4)
    assert (gpus.Machine(4).processes(), gpus.Machine(4).processes(3), gpus.Machine(0).processes()) == (4, 3, 2)
