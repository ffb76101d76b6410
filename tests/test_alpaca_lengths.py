"""The Alpaca length statistics (benchmarks/alpaca_lengths.py) and the variable-length workload drawn from them."""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))
import alpaca_lengths  # noqa: E402
import varlen_workload  # noqa: E402

RECORDS = [
    {"instruction": "Give three tips for staying healthy.", "input": "", "output": "Eat well. Sleep. Move."},
    {"instruction": "Translate to French.", "input": "Good morning", "output": "Bonjour"},
    {"instruction": "Write a poem.", "input": "", "output": " ".join(["line"] * 200)},
]


def test_rows_are_formatted_as_the_notebook_does():
    text = alpaca_lengths.formatted(RECORDS[1])
    assert text.startswith("Below is an instruction that describes a task, paired with an input")
    assert "### Instruction:\nTranslate to French.\n\n### Input:\nGood morning\n\n### Response:\nBonjour" in text


def test_summary_counts_characters_and_estimated_tokens(tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in RECORDS))
    records = alpaca_lengths.load([data])
    summary = alpaca_lengths.summarize(records, alpaca_lengths.token_counter(None, 4.0), "estimate", "test")
    expected = sorted(math.ceil(len(alpaca_lengths.formatted(r)) / 4) + 2 for r in RECORDS)
    assert summary["rows"] == 3 and summary["share_with_input"] == pytest.approx(1 / 3, abs=1e-4)
    assert summary["tokens"]["min"] == expected[0] and summary["tokens"]["max"] == expected[-1]
    assert summary["tokens"]["mean"] == pytest.approx(statistics.fmean(expected), abs=0.01)
    assert summary["token_percentiles"][0] == expected[0] and summary["token_percentiles"][50] == expected[1]
    assert sum(b["count"] for b in summary["tokens_histogram"]) == 3


def test_committed_summary_is_statistics_only():
    summary = json.loads((BENCH / "results" / "alpaca_lengths.json").read_text())
    table = summary["token_percentiles"]
    assert len(table) == 101 and table == sorted(table)
    assert summary["rows"] >= 1000
    assert "instruction" not in json.dumps({k: v for k, v in summary.items() if k != "format"})


def test_workload_lengths_follow_the_measured_percentiles():
    table = varlen_workload.token_percentiles()
    drawn = sorted(varlen_workload.lengths(20000, seed=3))
    assert drawn == sorted(varlen_workload.lengths(20000, seed=3))  # the same rows for every configuration
    for q in (5, 50, 95):
        assert drawn[len(drawn) * q // 100] == pytest.approx(table[q], rel=0.05)
    assert min(drawn) >= max(8, math.floor(table[0])) and max(drawn) <= math.ceil(table[100])


def test_draw_length_interpolates_between_percentiles():
    table = list(range(0, 202, 2))  # percentile q is 2q
    assert varlen_workload.draw_length(table, 0.0) == 0
    assert varlen_workload.draw_length(table, 0.505) == pytest.approx(101)
    assert varlen_workload.draw_length(table, 1.0) == 200
