"""Length distribution of Alpaca rows as the Unsloth Kaggle Alpaca notebooks format them for training.

    python benchmarks/alpaca_lengths.py DATA.json [DATA2.json ...] --source "where the file came from" \\
        [--tokenizer tokenizer.json] [--out benchmarks/results/alpaca_lengths.json]

Each record (``instruction``, ``input``, ``output``) is formatted exactly as the notebooks' cell does it
(``alpaca_prompt.format(instruction, input, output) + EOS_TOKEN``, ``ALPACA_PROMPT`` below, copied from
``Kaggle-Llama3.1_(8B)-Alpaca.ipynb`` of unslothai/notebooks) and measured in characters, words and tokens.
Tokens: with ``--tokenizer`` (a ``tokenizer.json``, e.g. Llama 3.1's), the real count of that tokenizer plus
its BOS; without one, ``ceil(characters / --chars-per-token)`` plus 2 (BOS and EOS): an estimate, and the
summary says which was used.

The summary (written to ``--out``) holds statistics only, never rows: the data sets' licence (Alpaca is
CC BY-NC 4.0) does not allow committing them. It has the count, the share of rows with an input, mean, sd
and quantiles of each measure, a histogram of tokens on log-spaced bins, a fitted log-normal, and
``token_percentiles``: the 0th..100th percentile of tokens, which ``varlen_workload.py`` draws lengths from.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

HERE = Path(__file__).resolve().parent

#: The notebooks' ``alpaca_prompt`` (Unsloth's Kaggle Alpaca notebooks, e.g. Llama 3.1 8B), verbatim.
ALPACA_PROMPT = """Below is an instruction that describes a task, paired with an input that provides further context. Write a response that appropriately completes the request.

### Instruction:
{}

### Input:
{}

### Response:
{}"""
#: Llama 3.1's EOS as the notebook appends it (``tokenizer.eos_token``); one token to the tokenizer.
EOS = "<|end_of_text|>"
QUANTILES = (1, 5, 10, 25, 50, 75, 90, 95, 99)


def formatted(record: dict) -> str:
    """One row's training text, as ``formatting_prompts_func`` builds it (EOS not included here)."""
    return ALPACA_PROMPT.format(record["instruction"], record.get("input", ""), record["output"])


def load(paths: list[Path]) -> list[dict]:
    """Records from JSON files, each a list of records (``alpaca_data.json``) or one record per line."""
    records = []
    for path in paths:
        text = path.read_text(encoding="utf-8")
        records += json.loads(text) if text.lstrip().startswith("[") else [json.loads(x) for x in text.splitlines()
                                                                          if x.strip()]
    return records


def token_counter(tokenizer: Path | None, chars_per_token: float):
    """A function text → tokens: the tokenizer's count (+ BOS, + EOS) or the characters-per-token estimate."""
    if tokenizer is None:
        return lambda text: math.ceil(len(text) / chars_per_token) + 2
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer))
    return lambda text: len(tok.encode(text + EOS, add_special_tokens=False).ids) + 1


def percentile(sorted_values: list[float], q: float) -> float:
    """The q-th percentile (0..100), linear between the closest ranks (numpy's default)."""
    pos = (len(sorted_values) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def describe(values: list[float]) -> dict:
    ordered = sorted(values)
    return {"mean": round(statistics.fmean(ordered), 2), "sd": round(statistics.pstdev(ordered), 2),
            "min": ordered[0], "max": ordered[-1],
            "quantiles": {f"p{q}": round(percentile(ordered, q), 1) for q in QUANTILES}}


def histogram(values: list[int], edges: tuple[int, ...] = (8, 16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024,
                                                           2048, 10**9)) -> list[dict]:
    """Counts per bin [lo, hi) over tokens; the bins double, with halves in the bulk."""
    rows = [{"from": lo, "to": hi, "count": sum(lo <= v < hi for v in values)} for lo, hi in zip(edges, edges[1:])]
    below = sum(v < edges[0] for v in values)
    return ([{"from": 0, "to": edges[0], "count": below}] if below else []) + [r for r in rows if r["count"]]


def lognormal_fit(values: list[int]) -> dict:
    """Maximum-likelihood log-normal: mu and sigma of log(tokens)."""
    logs = [math.log(v) for v in values]
    return {"mu": round(statistics.fmean(logs), 4), "sigma": round(statistics.pstdev(logs), 4)}


def summarize(records: list[dict], count_tokens, token_method: str, source: str) -> dict:
    texts = [formatted(r) for r in records]
    tokens = [count_tokens(t) for t in texts]
    ordered = sorted(tokens)
    return {
        "source": source,
        "format": "alpaca_prompt.format(instruction, input, output) + EOS_TOKEN, as in unslothai/notebooks "
                  "Kaggle-Llama3.1_(8B)-Alpaca.ipynb (benchmarks/alpaca_lengths.py ALPACA_PROMPT)",
        "token_method": token_method,
        "rows": len(records),
        "share_with_input": round(sum(bool(r.get("input", "").strip()) for r in records) / len(records), 4),
        "characters": describe([len(t) + len(EOS) for t in texts]),
        "words": describe([len(t.split()) for t in texts]),
        "tokens": describe(tokens),
        "tokens_histogram": histogram(tokens),
        "tokens_lognormal_fit": lognormal_fit(tokens),
        "token_percentiles": [round(percentile(ordered, q), 1) for q in range(101)],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("data", type=Path, nargs="+", help="Alpaca JSON files (a list of records, or JSON lines)")
    ap.add_argument("--source", required=True, help="where the data came from (repository, commit, path)")
    ap.add_argument("--tokenizer", type=Path, help="a tokenizer.json to count real tokens with")
    ap.add_argument("--chars-per-token", type=float, default=4.0,
                    help="without --tokenizer: characters per token of English text (default 4.0)")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "alpaca_lengths.json")
    args = ap.parse_args()
    method = (f"tokenizer {args.tokenizer.name} (+BOS, +EOS)" if args.tokenizer else
              f"estimate: ceil(characters / {args.chars_per_token:g}) + 2 (BOS, EOS); no tokenizer was available")
    summary = summarize(load(args.data), token_counter(args.tokenizer, args.chars_per_token), method, args.source)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k not in ("token_percentiles", "tokens_histogram")},
                     indent=1))


if __name__ == "__main__":
    main()
