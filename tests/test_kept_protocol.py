"""The kept job's messages are types defined once (``runtime/kept_protocol.py``): every request the kernel can
send is one the ranks handle, every reply the ranks send is one the kernel reads, and no side sends a bare
tuple. A kind added on one side only fails here."""

from __future__ import annotations

import ast
import dataclasses
import pickle
from pathlib import Path

import pytest

import nbddp
from nbddp.runtime import kept_protocol, serve
from nbddp.runtime.kept_protocol import REPLIES, REQUESTS, Agree, Failed, Ok, Pull, Push, Run, Status
from nbddp.runtime.rank import rank_info

SRC = Path(nbddp.__file__).parent
KERNEL_SIDE = sorted((SRC / "kept").glob("*.py"))
RANK_SIDE = [SRC / "runtime" / "serve.py"]
MESSAGES = {name for name, obj in vars(kept_protocol).items()
            if dataclasses.is_dataclass(obj) and obj.__module__ == kept_protocol.__name__}


def _uses(paths) -> tuple[set[str], set[str]]:
    """The message types the modules build (called) and those they read (named otherwise: ``isinstance``,
    ``case T(...)``)."""
    built, read = set(), set()
    for path in paths:
        tree = ast.parse(path.read_text(), str(path))
        called = {id(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Name) and node.id in MESSAGES:
                (built if id(node) in called else read).add(node.id)
    return built, read


def _names(types) -> set[str]:
    return {t.__name__ for t in types}


def test_every_message_type_is_a_request_or_a_reply():
    assert MESSAGES == _names(REQUESTS) | _names(REPLIES)
    assert not _names(REQUESTS) & _names(REPLIES)


def test_every_request_is_sent_by_the_kernel_and_handled_by_the_ranks():
    kernel_built, _ = _uses(KERNEL_SIDE)
    _, rank_read = _uses(RANK_SIDE)
    assert _names(REQUESTS) <= kernel_built, _names(REQUESTS) - kernel_built
    assert _names(REQUESTS) <= rank_read, f"requests the ranks do not handle: {_names(REQUESTS) - rank_read}"


def test_every_reply_is_sent_by_the_ranks_and_read_by_the_kernel():
    rank_built, _ = _uses(RANK_SIDE)
    _, kernel_read = _uses(KERNEL_SIDE)
    assert _names(REPLIES) <= rank_built, _names(REPLIES) - rank_built
    assert _names(REPLIES) <= kernel_read, f"replies the kernel does not read: {_names(REPLIES) - kernel_read}"
    assert not (rank_built & _names(REQUESTS)), "a rank builds a request"


@pytest.mark.parametrize("path", KERNEL_SIDE + RANK_SIDE, ids=lambda p: p.name)
def test_no_side_sends_a_bare_tuple_or_reads_a_message_by_position(path):
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "send":
            assert not any(isinstance(arg, ast.Tuple) for arg in node.args), f"{path.name}:{node.lineno}"
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name):
            assert node.value.id not in {"message", "reply", "rep", "hello"}, f"{path.name}:{node.lineno}"


def test_messages_travel_pickled_and_arrive_equal():
    for message in (Run("cell.py", 3, 9), Push("x", [1, 2]), Ok({"rank": 0}), Failed("ValueError: no", "tb")):
        assert pickle.loads(pickle.dumps(message)) == message


def test_the_rank_answers_each_request_of_its_inbox():
    namespace: dict = {}
    info = rank_info()
    assert serve._handle(Push("x", 41), namespace, info) == Ok()
    assert serve._handle(Pull("x"), namespace, info) == Ok(41)
    assert isinstance(serve._handle(Pull("missing"), namespace, info), Failed)
    assert serve._handle(Status(), namespace, info).value["pid"] > 0
    assert serve._handle(Agree(), namespace, info) == Ok(None)  # one process, no group: nothing to disagree on
