"""``MemoryError()`` carries no text: a rank's failure and nbddp's own say what it is (out of memory) and where,
never an empty message nor "a bug in nbddp"."""

import os

import nbformat
import pytest

import nbddp.convert
from nbddp import cli
from nbddp.convert.script import SourceMap, map_path
from nbddp.launch import read_failure
from nbddp.runtime.lifecycle import write_error_file
from nbddp.runtime.records import OUT_OF_MEMORY, error_record


def test_an_exception_without_text_is_said_for_what_it_is():
    assert error_record(MemoryError, MemoryError(), None, rank=0)["message"]["message"] == \
        f"MemoryError: {OUT_OF_MEMORY}"
    assert error_record(ValueError, ValueError(), None, rank=0)["message"]["message"] == "ValueError"
    assert error_record(MemoryError, MemoryError("numpy: 8 GiB"), None, rank=0)["message"]["message"] == \
        "MemoryError: numpy: 8 GiB"


def test_a_rank_out_of_memory_is_named_at_its_cell_and_line(tmp_path, monkeypatch):
    script = tmp_path / "script.py"
    script.write_text("\n".join(f"line{n}" for n in range(1, 21)) + "\n")
    map_path(script).write_text(SourceMap("nb.ipynb", {10: (2, 1), 11: (2, 2)}).to_json())
    rank_folder = tmp_path / "logs" / "run" / "attempt_0" / "0"
    rank_folder.mkdir(parents=True)
    try:
        exec(compile("\n" * 10 + "raise MemoryError()", str(script), "exec"), {})
    except MemoryError as exc:
        monkeypatch.setenv("RANK", "0")
        write_error_file(str(rank_folder / "error.json"), type(exc), exc, exc.__traceback__)
    failure = read_failure(tmp_path / "logs", script)
    assert str(failure).startswith("rank 0 failed in cell 2, line 2: MemoryError: out of memory: this process could "
                                   "not allocate more of the machine's memory (RAM, not a GPU's)")


def test_nbddp_itself_out_of_memory_is_said_as_such_not_as_a_bug(tmp_path, monkeypatch, capsys):
    path = tmp_path / "nb.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x = 1")]), str(path))

    def no_memory(*args, **kwargs):
        raise MemoryError()

    monkeypatch.setattr(nbddp.convert, "convert_notebook", no_memory)
    assert cli.main(["convert", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"nbddp: error: out of memory while running nbddp convert {path} (in cli.py, line ")
    assert "the machine had no more memory to give (" in err and " GiB available now); close what else" in err
    assert "internal error" not in err and "bug in nbddp" not in err and "Traceback" not in err


@pytest.mark.skipif(not os.path.exists("/proc/meminfo"), reason="the available memory is read from /proc/meminfo")
def test_the_available_memory_is_read():
    from nbddp.guard import _memory_available

    assert _memory_available().endswith(" GiB")
