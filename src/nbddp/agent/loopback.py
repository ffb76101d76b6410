"""A single-machine job listens on loopback only: its stores and its ranks' gloo sockets on 127.0.0.1.

torchrun's ``--standalone`` rendezvous names ``localhost:0``, but torch's TCPStore server listens on every
interface whatever host it is given (its listening socket is made from the port alone), and torch starts two in
the agent: the c10d rendezvous store and the store the ranks share (at ``MASTER_ADDR``, the node's address:
the machine's FQDN unless ``--local-addr`` says). Unauthenticated, both would answer anyone who can reach the
machine. So, for a job whose rendezvous endpoint is loopback (``--standalone``, or ``--rdzv-endpoint`` on
127.0.0.1 / ``localhost``: nodes on this machine only):

- the node's address is 127.0.0.1 (``--local-addr``, where not given), so the ranks' ``MASTER_ADDR`` is too;
- a store server whose host is a loopback address is handed a socket already listening on 127.0.0.1
  (TCPStore's own ``master_listen_fd``), so it listens there and nowhere else;
- gloo's and NCCL's sockets use the loopback interface (``GLOO_SOCKET_IFNAME``, ``NCCL_SOCKET_IFNAME``, each
  where not set), not the address the host name resolves to (NCCL's bootstrap listens on a socket too; between
  GPUs of one machine its data goes by NVLink, PCIe or shared memory, never that socket).

A job of several machines (an endpoint elsewhere) is left as torch runs it: its nodes must reach each other.
Runs in the agent, after torch is imported; the ranks forked from it inherit the store class, used there only
by clients.
"""

from __future__ import annotations

import ipaddress
import os
import socket

LOOPBACK = "127.0.0.1"


def install(argv: list[str]) -> list[str]:
    """torchrun's arguments with the node's address on loopback, where the rendezvous is on this machine only;
    from then on every store server for a loopback host listens on loopback (and gloo too)."""
    args = torchrun_args(argv)
    if args is None or not loopback_rendezvous(args, argv):
        return argv
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend, static_tcp_rendezvous

    store = loopback_store_class(dist.TCPStore)
    for module in (dist, c10d_rendezvous_backend, static_tcp_rendezvous):
        module.TCPStore = store  # the names torch's rendezvous code looks up when it makes a store
    interface = loopback_interface()
    if interface:
        for variable in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            os.environ.setdefault(variable, interface)
    return argv if args.local_addr else [f"--local-addr={LOOPBACK}", *argv]


def torchrun_args(argv: list[str]):
    """torchrun's arguments as its own parser reads them; None where it would refuse them (it says why)."""
    from torch.distributed.run import get_args_parser

    try:
        return get_args_parser().parse_args(argv)
    except SystemExit:
        return None


def loopback_rendezvous(args, argv: list[str]) -> bool:
    """Whether torchrun's arguments (``args`` as its parser reads ``argv``) make a rendezvous of this machine's
    processes only: ``--standalone``, an endpoint on loopback, or the static rendezvous at a loopback
    ``--master-addr`` — torchrun's default 127.0.0.1 for one node; for several, only where it is given (the
    master node of a static job leaves it out and serves the others)."""
    if args.standalone:
        return True
    endpoint = args.rdzv_endpoint
    if not endpoint:
        several = str(args.nnodes).rsplit(":", 1)[-1].strip() not in ("1", "")
        given = any(a.split("=", 1)[0] in ("--master-addr", "--master_addr") for a in argv)
        return args.rdzv_backend == "static" and is_loopback(args.master_addr) and (given or not several)
    host = endpoint.rsplit(":", 1)[0] if endpoint.count(":") == 1 or endpoint.startswith("[") else endpoint
    return is_loopback(host.strip("[]"))


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 or ``localhost``; a name is not resolved (a machine's own name may be reached from
    elsewhere)."""
    if host.lower() in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def loopback_store_class(tcp_store: type) -> type:
    """A ``TCPStore`` whose server, for a loopback host, listens on that address only."""

    class LoopbackTCPStore(tcp_store):
        def __init__(self, host_name, port, *args, **kwargs):
            names = ("world_size", "is_master", "timeout", "wait_for_workers", "multi_tenant", "master_listen_fd",
                     "use_libuv")
            kwargs.update(zip(names, args))
            if kwargs.get("is_master") and kwargs.get("master_listen_fd") is None and is_loopback(str(host_name)):
                listening = listen_on_loopback(int(port), ipv6=str(host_name) == "::1")
                port = listening.getsockname()[1]
                kwargs["master_listen_fd"] = listening.detach()  # the store's from now on
            super().__init__(host_name, port, **kwargs)

    LoopbackTCPStore.__qualname__ = LoopbackTCPStore.__name__ = "TCPStore"
    return LoopbackTCPStore


def listen_on_loopback(port: int, ipv6: bool = False) -> socket.socket:
    """A socket listening on 127.0.0.1 (or ::1) at ``port`` (0: a free one), as torch's own server would."""
    sock = socket.socket(socket.AF_INET6 if ipv6 else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("::1" if ipv6 else LOOPBACK, port))
        sock.listen(socket.SOMAXCONN)
    except OSError as exc:
        sock.close()
        # as torch's own server says a taken port (DistNetworkError, a RuntimeError): torch's rendezvous then
        # joins as a client the store another node of this machine hosts there
        raise RuntimeError(f"the store's port {port} on loopback: {exc.strerror}") from exc
    return sock


def loopback_interface() -> str | None:
    """The name of the interface holding 127.0.0.1 (``lo`` on Linux, ``lo0`` on macOS)."""
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == LOOPBACK for a in addresses):
            return name
    return None
