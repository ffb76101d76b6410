"""A kept job's channel and cell conversion, without processes: the socket is this user's alone, the key is
checked, and a %%ddp cell is converted by the job's rules with its own line numbers."""

from __future__ import annotations

import os
import stat
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client

import pytest

from nbddp.cells import Cell
from nbddp.kept.cell import convert_kept_cell
from nbddp.kept.channel import Channel, peer_uid
from nbddp.runtime.kept_protocol import Ended, Hello, Run, Status
from nbddp.runtime.serve import KEY_ENV, SOCKET_ENV


def _wait(predicate, within_s: float = 5.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


@pytest.fixture
def channel():
    ch = Channel(2, idle_limit_s=60)
    yield ch
    ch.close()


def test_the_socket_is_in_a_folder_only_this_user_can_enter(channel):
    assert stat.S_IMODE(channel.folder.stat().st_mode) == 0o700
    assert stat.S_IMODE(os.stat(channel.address).st_mode) == 0o600
    env = channel.env()
    assert env[SOCKET_ENV] == channel.address and bytes.fromhex(env[KEY_ENV]) == channel.key
    assert len(channel.key) == 32


def test_a_client_without_the_key_is_refused(channel):
    with pytest.raises(AuthenticationError):
        Client(channel.address, family="AF_UNIX", authkey=b"x" * 32)
    assert _wait(lambda: channel.refused)
    assert not channel.ranks and not channel.ready()


def test_ranks_with_the_key_are_known_by_their_rank_and_uid(channel):
    clients = []
    for rank in (1, 0):
        conn = Client(channel.address, family="AF_UNIX", authkey=channel.key)
        conn.send(Hello(rank, 1000 + rank, "cpu"))
        clients.append(conn)
    assert _wait(channel.ready)
    assert channel.info == {0: (1000, "cpu"), 1: (1001, "cpu")}
    assert all(peer_uid(conn) == os.getuid() for conn in channel.ranks.values())
    channel.ranks[1].send(Status())
    assert clients[0].recv() == Status()  # the connection that said rank 1
    for conn in clients:
        conn.close()


def test_closing_removes_the_folder():
    ch = Channel(1, idle_limit_s=None)
    assert "NBDDP_KEEP_IDLE" not in ch.env()
    ch.close()
    assert not ch.folder.exists()


HISTORY = [
    Cell(1, "from transformers import Trainer\ntrainer = Trainer(model=model, args=args, train_dataset=ds)\n"),
    Cell(2, "# %%ddp_train --keep\ntrainer.train()\n"),
]


def test_a_second_training_and_generation_run_on_every_rank(tmp_path):
    again = convert_kept_cell("trainer.train()\n", HISTORY, tmp_path, 1)
    assert again.code.splitlines() == ["# [cell 3]", "# %%ddp", "trainer.train()"]  # on every rank, as it is
    generate = convert_kept_cell('out = model.generate(**inputs)\nprint("generated", out)\n',
                                 [*HISTORY, again.cell], tmp_path, 2)
    # out exists on every rank, as in the kernel's one process; only rank 0's print is shown
    assert "_nbddp.on_rank0()" not in generate.code and "print(" in generate.code
    assert generate.path.exists() and generate.path.with_name(generate.path.name + ".map.json").exists()
    # each of the cell's lines keeps its line in the cell (line 1 is the %%ddp line)
    smap = generate.script.source_map
    script_lines = generate.script.text.splitlines()
    printed = next(n for n in range(generate.first, generate.last + 1) if "print(" in script_lines[n - 1])
    assert smap.lookup(printed) == (generate.cell.index, 3)
    assert generate.cell.index == 4  # after every cell of the history


def test_a_rank_gone_between_the_look_and_the_send_ends_the_request_as_a_gone_job(tmp_path, monkeypatch):
    """The ranks end themselves (the idle limit) just after ``check_alive`` looked: the send finds the socket
    closed. The cell says the kept job has ended, as it does when the look sees it, not an internal error."""
    from nbddp.kept import controller
    from nbddp.kept.controller import KeptJob, KeptJobGone

    class Closed:
        def send_bytes(self, data):
            raise BrokenPipeError(32, "Broken pipe")

    class Channel:
        ranks = {0: Closed(), 1: Closed()}
        closed = False

        def close(self):
            self.closed = True

        def last_words(self):
            return None

    class Torchrun:  # running at the look, ended by the time the send fails
        returncode = None

        def poll(self):
            return self.returncode

        def wait(self, timeout=None):
            self.returncode = 0
            return 0

    monkeypatch.setattr(controller, "terminate_tree", lambda process: None)
    monkeypatch.setattr(controller.atexit, "register", lambda func: func)
    job = KeptJob(process=Torchrun(), channel=Channel(), run_dir=tmp_path, cells=[], cwd=tmp_path)
    with pytest.raises(KeptJobGone, match="its ranks exited"):
        job.request(Run("cell.py", 1, 1))
    assert job.channel.closed is False  # ended by the ranks themselves: nothing left to end here


def test_a_connection_that_never_answers_the_handshake_does_not_keep_the_ranks_out():
    """Seen in a fault run: one silent connection held the accept thread, and the kept job's start stalled 90 s."""
    import socket as socketlib

    ch = Channel(1, idle_limit_s=None, handshake_s=0.5)
    try:
        silent = socketlib.socket(socketlib.AF_UNIX)
        silent.connect(ch.address)  # connects, then says nothing
        time_before = time.monotonic()
        rank = Client(ch.address, family="AF_UNIX", authkey=ch.key)
        rank.send(Hello(0, 1000, "cpu"))
        assert _wait(ch.ready, within_s=2.0)
        assert time.monotonic() - time_before < 2.0
        assert _wait(lambda: "no handshake" in ch.refused, within_s=3.0), ch.refused  # the silent one, let go
        silent.close()
        rank.close()
    finally:
        ch.close()


def test_a_channel_folder_whose_kernel_is_gone_is_removed_when_the_next_channel_opens(tmp_path, monkeypatch):
    """A kernel killed (SIGKILL) or restarted with its channel open leaves its folder, naming a process that is
    gone, or a pid another process has since (its start time differs); the next channel removes both."""
    import psutil

    from nbddp.kept import channel as channel_module

    monkeypatch.setattr(channel_module.tempfile, "tempdir", str(tmp_path))
    dead, reused = tmp_path / "nbddp-kept-dead", tmp_path / "nbddp-kept-reused"
    for folder, owner in ((dead, f"{2**22 + 12345} 1700000000.0"), (reused, f"{os.getpid()} 1700000000.0")):
        folder.mkdir(mode=0o700)
        (folder / "owner").write_text(owner)
        (folder / "channel.sock").touch()
    assert not psutil.pid_exists(2**22 + 12345)
    live = Channel(1, idle_limit_s=None)  # this process' own: kept while it lives
    try:
        assert not dead.exists() and not reused.exists()
        again = Channel(1, idle_limit_s=None)
        again.close()
        assert live.folder.exists()
    finally:
        live.close()


def test_after_the_idle_limit_the_next_request_says_so_not_a_guess(tmp_path, monkeypatch):
    """The ranks end themselves after --idle-limit: rank 0 says so on its connection as it goes, and the next
    cell names the idle limit (it used to guess: "the idle limit, or a rank ended itself")."""
    from nbddp.kept import controller
    from nbddp.kept.controller import KeptJob, KeptJobGone

    class Torchrun:  # exited with its ranks
        returncode = 0

        def poll(self):
            return 0

        def wait(self, timeout=None):
            return 0

    monkeypatch.setattr(controller, "terminate_tree", lambda process: None)
    monkeypatch.setattr(controller.atexit, "register", lambda func: func)
    ch = Channel(1, idle_limit_s=12)
    try:
        rank = Client(ch.address, family="AF_UNIX", authkey=ch.key)
        rank.send(Hello(0, 1000, "cpu"))
        assert _wait(ch.ready)
        rank.send(Ended("the idle limit ended it: no request for 0.2 min (--idle-limit)"))
        rank.close()
        job = KeptJob(process=Torchrun(), channel=ch, run_dir=tmp_path, cells=[], cwd=tmp_path)
        with pytest.raises(KeptJobGone, match=r"the idle limit ended it: no request for 0\.2 min"):
            job.check_alive()
    finally:
        ch.close()
