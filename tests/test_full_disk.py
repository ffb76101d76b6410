"""nbddp's bookkeeping never ends a training: a record, a step or a printed line the disk refuses (full: ENOSPC)
is dropped with one warning, and the job's end says which folder is full. The disk's refusal is simulated here
(``os.write`` raising ENOSPC, a short write); ``test_fault_matrix.py`` fills a real small disk under a job."""

import errno
import io
import json
import os
from types import SimpleNamespace

import pytest

from nbddp.launch import postmortem
from nbddp.runtime import records, streams

REAL_WRITE = os.write


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(records, "_DROPPED", {})


def disk_full_for(path_or_fd):
    """``os.write`` that raises ENOSPC for one file (by descriptor or path) and writes the rest."""
    def write(fd, data):
        target = os.readlink(f"/proc/self/fd/{fd}")
        if fd == path_or_fd or target == str(path_or_fd):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return REAL_WRITE(fd, data)

    return write


def test_a_record_the_disk_refuses_is_dropped_with_one_warning(tmp_path, monkeypatch, capsys):
    path = tmp_path / "metrics.jsonl"
    assert records.append_line(path, '{"event": "begin"}')
    monkeypatch.setattr(os, "write", disk_full_for(path))
    assert records.append_line(path, '{"event": "log"}') is False  # nothing raised
    assert records.append_line(path, '{"event": "log"}') is False
    err = capsys.readouterr().err
    assert err.count("nbddp: warning:") == 1
    assert f"nbddp: warning: cannot write {path} (No space left on device): nbddp drops what it writes there, " \
           "and the training goes on" in err
    assert path.read_text() == '{"event": "begin"}\n'
    assert records.dropped() == {str(path): "No space left on device"}


def test_a_record_the_disk_took_only_part_of_is_cut_back(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    records.append_line(path, '{"event": "begin"}')
    monkeypatch.setattr(os, "write", lambda fd, data: REAL_WRITE(fd, data[:5]))  # the disk's last bytes
    assert records.append_line(path, '{"event": "step", "step": 60}') is False
    assert path.read_text() == '{"event": "begin"}\n'  # no half line for the launcher to read


def test_a_folder_gone_drops_the_record_too(tmp_path):
    assert records.append_line(tmp_path / "gone" / "metrics.jsonl", "{}") is False


def test_the_trainers_events_on_a_full_disk_never_raise_into_the_training(tmp_path, monkeypatch):
    import sys

    from nbddp.runtime.metrics import make_callback

    if "transformers" not in sys.modules:  # its base class is all the callback takes of it: not seconds of import
        monkeypatch.setitem(sys.modules, "transformers", SimpleNamespace(TrainerCallback=object))

    path = tmp_path / "metrics.jsonl"
    callback = make_callback(str(path))()
    state = SimpleNamespace(is_world_process_zero=True, global_step=60, max_steps=60, epoch=1.0)
    callback.on_step_end(None, state, None)
    monkeypatch.setattr(os, "write", disk_full_for(path))
    monkeypatch.setattr(os, "pwrite", lambda *a: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space left")))
    callback.on_log(None, state, None, logs={"loss": 1.0})  # used to raise OSError into trainer.train()
    callback.on_step_end(None, state, None)
    callback.on_train_end(None, state, None)
    assert [json.loads(line)["event"] for line in path.read_text().splitlines()] == ["step"]


def test_printed_output_the_disk_refuses_is_dropped_not_raised(tmp_path, monkeypatch):
    log = open(tmp_path / "stdout.log", "w", encoding="utf-8")  # as torchrun opens a rank's stdout
    stream = streams._tolerant(log, "<stdout>")
    stream.write("step 1\n")
    stream.flush()
    monkeypatch.setattr(os, "write", disk_full_for(log.fileno()))
    stream.write("step 2 " * 5000 + "\n")  # more than a buffer: written at once, refused
    stream.flush()  # neither raises
    monkeypatch.setattr(os, "write", REAL_WRITE)  # room again: output comes through again
    stream.write("step 3\n")
    stream.flush()
    assert (tmp_path / "stdout.log").read_text() == "step 1\nstep 3\n"
    assert "<stdout>" in records.dropped()


def test_only_a_stream_that_is_a_file_is_put_over_the_dropping_layer(tmp_path):
    assert streams._tolerant(io.StringIO(), "<stdout>") is None
    read, write = os.pipe()
    with os.fdopen(write, "w") as pipe:
        assert streams._tolerant(pipe, "<stdout>") is None  # a pipe has no disk to fill
    os.close(read)
    with open(tmp_path / "log", "w") as log:
        once = streams._tolerant(log, "<stdout>")
        assert once is not None and streams._tolerant(once, "<stdout>") is None  # never twice


def test_the_jobs_end_says_which_folder_is_full(tmp_path, monkeypatch):
    monkeypatch.setattr("shutil.disk_usage", lambda path: SimpleNamespace(total=4 << 20, used=4 << 20, free=0))
    line = postmortem.full_disk(tmp_path)
    assert f"nbddp: warning: the disk of the run directory {tmp_path} is full (0 KiB free)" in line
    assert "--runs-dir DIR, or NBDDP_RUNS" in line
    monkeypatch.setattr("shutil.disk_usage", lambda path: SimpleNamespace(total=1 << 40, used=0, free=1 << 40))
    assert postmortem.full_disk(tmp_path) is None
