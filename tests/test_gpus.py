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
