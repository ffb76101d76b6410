"""What is at a path nbddp writes stays what it is: a symlink is written through to its target and stays a
link; a FIFO or a device given to ``-o`` is refused with one line before anything is written (a rename over it
would replace the node with a regular file: ``-o /dev/null`` as root, the machine's ``/dev/null``)."""

import os
import stat

import nbformat
import pytest

from nbddp import cli
from nbddp.runtime.io import atomic_write_text, not_a_file


@pytest.fixture
def notebook(tmp_path):
    path = tmp_path / "nb.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("print('converted')")]), str(path))
    return path


def test_a_fifo_given_to_o_is_refused_before_anything_is_written(notebook, tmp_path, capsys):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    before = sorted(tmp_path.iterdir())
    assert cli.main(["convert", str(notebook), "-o", str(fifo)]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [
        f"nbddp: error: -o {fifo} is a FIFO (named pipe), not a file: give the path of a file to write "
        "(to check that a notebook converts, leave -o out: the script goes to stdout)"]
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)  # still a FIFO, not replaced by a file
    assert sorted(tmp_path.iterdir()) == before  # no map file beside it either


def test_a_link_to_a_fifo_is_refused_naming_both(notebook, tmp_path, capsys):
    os.mkfifo(tmp_path / "pipe")
    (tmp_path / "out.py").symlink_to("pipe")
    assert cli.main(["convert", str(notebook), "-o", str(tmp_path / "out.py")]) == 2
    assert f"(a link to {tmp_path / 'pipe'}) is a FIFO (named pipe), not a file" in capsys.readouterr().err
    assert (tmp_path / "out.py").is_symlink() and stat.S_ISFIFO(os.lstat(tmp_path / "pipe").st_mode)


def test_a_symlink_given_to_o_stays_a_link_and_its_target_is_written(notebook, tmp_path, capsys):
    (tmp_path / "scripts").mkdir()
    target = tmp_path / "scripts" / "train.py"
    target.write_text("old\n")
    link = tmp_path / "train.py"
    link.symlink_to(target)
    assert cli.main(["convert", str(notebook), "-o", str(link)]) == 0
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert "print('converted')" in target.read_text()
    assert not [p for p in target.parent.iterdir() if p.name.startswith(".")]  # no temporary file left


def test_a_dangling_symlink_is_written_through_creating_its_target(tmp_path):
    link = tmp_path / "out.txt"
    link.symlink_to(tmp_path / "made.txt")
    atomic_write_text(link, "hello")
    assert link.is_symlink() and (tmp_path / "made.txt").read_text() == "hello"


def test_what_a_path_is_when_it_is_not_a_regular_file(tmp_path):
    os.mkfifo(tmp_path / "pipe")
    (tmp_path / "file").write_text("x")
    (tmp_path / "link").symlink_to(tmp_path / "file")
    assert not_a_file(tmp_path / "pipe") == "a FIFO (named pipe)"
    assert not_a_file(tmp_path) == "a folder"
    assert not_a_file(tmp_path / "file") is None and not_a_file(tmp_path / "link") is None
    assert not_a_file(tmp_path / "new.py") is None and not_a_file(tmp_path / "file" / "x") is None
