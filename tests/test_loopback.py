"""A single-machine job's stores listen on loopback only (``agent/loopback.py``); the e2e check of a whole job's
sockets is in ``tests/test_faults.py``."""

import os

import psutil
import pytest

from nbddp.agent.loopback import is_loopback, loopback_rendezvous, loopback_store_class, torchrun_args


@pytest.mark.parametrize("argv, local", [
    (["--standalone", "--nproc_per_node=2", "train.py"], True),
    (["--nnodes=2", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:29400", "train.py"], True),  # nodes here
    (["--nnodes=2", "--rdzv-backend=c10d", "--rdzv-endpoint=localhost", "train.py"], True),
    (["--master-port=29511", "train.py"], True),  # torchrun's static rendezvous at its default 127.0.0.1
    (["--nnodes=2", "--rdzv-backend=c10d", "--rdzv-endpoint=node0:29400", "train.py"], False),
    (["--nnodes=2", "--master-addr=10.0.0.1", "--master-port=29500", "train.py"], False),
    (["--nnodes=2", "--node-rank=0", "--master-port=29500", "train.py"], False),  # a static master serving others
    (["--nnodes=2", "--node-rank=1", "--master-addr=127.0.0.1", "train.py"], True),  # two nodes on this machine
    (["--nnodes=2", "--master-addr=10.0.0.1", "train.py", "--rdzv-endpoint=127.0.0.1:1"], False),  # the script's
])
def test_only_a_rendezvous_of_this_machine_is_kept_on_loopback(argv, local):
    assert loopback_rendezvous(torchrun_args(argv), argv) is local


def test_is_loopback_reads_addresses_not_names():
    assert is_loopback("127.0.0.1") and is_loopback("127.3.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.0.0.1") and not is_loopback("my-host")


def test_a_store_for_a_loopback_host_listens_there_only():
    import datetime

    import torch.distributed as dist

    store_class = loopback_store_class(dist.TCPStore)
    server = store_class("localhost", 0, is_master=True, multi_tenant=True, timeout=datetime.timedelta(seconds=10))
    mine = [c.laddr for c in psutil.Process().net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == server.port]
    assert [a.ip for a in mine] == ["127.0.0.1"]
    client = store_class("127.0.0.1", server.port, is_master=False, timeout=datetime.timedelta(seconds=10))
    client.set("k", "v")
    assert server.get("k") == b"v"
    with pytest.raises(RuntimeError, match="loopback"):  # as torch says a taken port: its rendezvous joins instead
        store_class("127.0.0.1", server.port, is_master=True)


def test_a_single_machine_job_sends_gloo_and_nccls_sockets_over_loopback(monkeypatch):
    """NCCL's bootstrap listens on a socket of the interface it picks, as gloo's do: both are named for the ranks
    (the e2e check sees gloo's; NCCL's is read on GPUs)."""
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend, static_tcp_rendezvous

    from nbddp.agent import loopback

    for module in (dist, c10d_rendezvous_backend, static_tcp_rendezvous):  # install() swaps the store class
        monkeypatch.setattr(module, "TCPStore", module.TCPStore)
    for variable in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        monkeypatch.delenv(variable, raising=False)
    argv = loopback.install(["--standalone", "--nproc_per_node=2", "train.py"])
    assert argv[0] == "--local-addr=127.0.0.1"
    interface = loopback.loopback_interface()
    assert interface and os.environ.get("GLOO_SOCKET_IFNAME") == os.environ.get("NCCL_SOCKET_IFNAME") == interface
