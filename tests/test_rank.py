"""runtime/rank.py: where this process sits, and ``say``, the one way the runtime prints its own lines."""

import io
import sys

from nbddp.runtime import rank


class Stream(io.StringIO):
    """stdout that counts what was in it when each flush came."""

    def __init__(self):
        super().__init__()
        self.flushed: list[str] = []

    def flush(self):
        self.flushed.append(self.getvalue())


def as_rank(monkeypatch, number: int) -> Stream:
    """This process as ``number`` of a 2-rank job, nothing said yet; its stdout, to read what it says."""
    info = rank.RankInfo(rank=number, local_rank=number, world_size=2, backend="gloo", device="cpu")
    monkeypatch.setattr(rank, "_info", info)
    monkeypatch.setattr(rank, "_said", set())
    stream = Stream()
    monkeypatch.setattr(sys, "stdout", stream)  # here, not in a fixture: pytest sets its capture up in between
    return stream


def test_rank_0_says_a_keyed_line_once_and_a_plain_line_each_time_flushed(monkeypatch):
    stdout = as_rank(monkeypatch, 0)
    rank.say("nbddp: first 1", once="first")
    rank.say("nbddp: first 2", once="first")  # the same key with other figures: said already
    rank.say("nbddp: second", once="second")
    rank.say("nbddp: each time")
    rank.say("nbddp: each time")
    said = "nbddp: first 1\nnbddp: second\nnbddp: each time\nnbddp: each time\n"
    assert stdout.getvalue() == said
    assert stdout.flushed[-1] == said  # flushed as said, so the launcher streams it at once


def test_other_ranks_say_nothing(monkeypatch):
    stdout = as_rank(monkeypatch, 1)
    rank.say("nbddp: keyed", once="keyed")
    rank.say("nbddp: plain")
    assert stdout.getvalue() == ""
