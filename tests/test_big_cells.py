"""A cell of hundreds of thousands of short lines converts in time proportional to its size: the line maps
are not diffed line against line where lines repeat (``SequenceMatcher`` costs the product of the two lengths
there: a cell of 8,000 lines with a few ``!`` lines took 13 s, and one of 873,000 would take hours)."""

import difflib

from nbddp.cells import Cell
from nbddp.convert import clean
from nbddp.convert.lines import align


def test_lines_shared_at_both_ends_are_matched_without_a_diff(monkeypatch):
    diffed = []
    real = difflib.SequenceMatcher

    def recording(isjunk=None, a="", b="", autojunk=True):
        diffed.append((len(a), len(b)))
        return real(isjunk, a, b, autojunk)

    monkeypatch.setattr(difflib, "SequenceMatcher", recording)
    before = ["x = 1"] * 2_000
    after = before[:1_000] + ["    x = 1", "y = 2"] + before[1_001:]  # one line indented, one added
    mapped = align(before, after)
    assert diffed == [(0, 1)]  # only the added line is diffed; the indented one matches on its stripped text
    assert mapped[999:1_003] == [999, 1_000, 1_000, 1_001] and mapped[-1] == 1_999


def test_a_long_cell_of_escape_lines_is_mapped_line_for_line(monkeypatch):
    body = ["", *("!ls" if i % 1000 == 0 else "x = 1" for i in range(20_000))]
    monkeypatch.setattr(clean, "align", lambda *a: (_ for _ in ()).throw(AssertionError("diffed")))
    cleaned = clean.clean_cell(Cell(2, "\n".join(body)))
    lines = cleaned.code.splitlines()
    assert len(lines) == 20_000 and lines[19_000].startswith("_nbddp.shell(") and lines[19_001] == "x = 1"
    assert cleaned.line_map[19_000] == 19_002  # the cell's own line: its first line is blank


def test_an_escape_continued_over_lines_is_still_aligned():
    cleaned = clean.clean_cell(Cell(1, "!echo a \\\n  b\nx = 1\n!ls"))
    assert cleaned.code.splitlines()[1:] == ["x = 1", cleaned.code.splitlines()[2]]
    assert cleaned.line_map[1:] == (3, 4)


def test_a_very_long_cell_is_said_before_it_converts(monkeypatch, capsys):
    monkeypatch.setattr(clean, "LONG_CELL_LINES", 1_000)
    clean.clean_cell(Cell(3, "\n".join(["x = 1"] * 999)))
    assert capsys.readouterr().err == ""
    clean.clean_cell(Cell(3, "\n".join(["x = 1"] * 1_200)))
    assert capsys.readouterr().err.startswith("nbddp: cell 3 holds 1,200 lines: converting it takes a while")
