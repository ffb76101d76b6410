"""A notebook that predicts and does not train, run on two gloo ranks: each rank predicts its own block of the
rows, and the files written after are byte for byte those one plain process writes."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from conftest import no_rank_processes
from nbddp.display.view import QuietView
from nbddp.job import run_job
from nbddp.launch import launch, new_run_dir, plan
from nbddp.options import RunOptions
from nbddp.runtime.shares import handed_chunks
from test_predict import CORPUS

pytestmark = pytest.mark.e2e

NOTEBOOK = CORPUS / "predict_classifier.ipynb"
WRITTEN = ("submission.csv", "metrics.json", "answers.json", "votes.csv")


def one_process(folder):
    """The notebook's code cells run in one plain Python process in ``folder``: the reference."""
    nb = nbformat.read(str(NOTEBOOK), as_version=4)
    code = "\n\n".join(c.source for c in nb.cells if c.cell_type == "code")
    return subprocess.run([sys.executable, "-c", code], cwd=folder, check=True, capture_output=True, text=True,
                          timeout=120).stdout


def test_a_predicting_notebook_splits_its_rows_and_writes_what_one_process_writes(tmp_path, monkeypatch):
    reference, ranked = tmp_path / "one", tmp_path / "two"
    reference.mkdir()
    ranked.mkdir()
    printed = one_process(reference).strip()
    shutil.copy(NOTEBOOK, ranked / NOTEBOOK.name)
    monkeypatch.chdir(ranked)
    result = run_job(ranked / NOTEBOOK.name, RunOptions(nproc=2, runs_dir=tmp_path / "runs"), QuietView()).run
    assert result.ok, result.failure
    for name in WRITTEN:
        assert (ranked / name).read_bytes() == (reference / name).read_bytes(), name
    # each rank's share of each loop: a DataLoader's in contiguous blocks in rank order, a list's rows in the
    # chunks handed to whichever rank was free; either way disjoint, together every batch or row once
    shares = {r: [json.loads(ln) for ln in (result.run_dir / "shares" / f"rank{r}.jsonl").read_text().splitlines()]
              for r in (0, 1)}
    loops = {}
    for r in (0, 1):
        for s in shares[r]:
            loops.setdefault(s["loop"], []).append((s["first"], s["end"], r, s["unit"], s["total"]))
    assert [(pieces[0][3], pieces[0][4]) for _, pieces in sorted(loops.items())] == [
        ("batches", 8), ("rows", 11), ("rows", 7)] + [("batches", 8)] * 2
    for pieces in loops.values():
        unit, total = pieces[0][3:]
        covered = sorted((first, end) for first, end, *_ in pieces)
        assert [covered[0][0], *[end for _, end in covered]] == [0, *[first for first, _ in covered[1:]], total]
        if unit == "batches":
            assert [r for *_, r, _, _ in sorted(pieces)] == [0, 1] and 0 < covered[0][1] < total
        else:
            assert covered == handed_chunks(total, 2) and all(s.get("handed_out") for r in (0, 1) for s in shares[r]
                                                              if s["unit"] == "rows")
    # and how long each share took and then waited for the other rank: a line per loop, after its rows
    for r in (0, 1):
        times = [json.loads(ln) for ln in (result.run_dir / "shares" / f"rank{r}-times.jsonl").read_text().splitlines()]
        began = {}
        for s in shares[r]:
            began.setdefault(s["loop"], s["began"])
        assert [t["loop"] for t in times] == sorted(loops)  # every rank gathers every loop, rows taken or not
        assert all(t["rows_s"] >= 0 and t["gather_s"] >= 0 and t["gathered"] >= began.get(t["loop"], 0) for t in times)
    # the code after the loops ran once, on rank 0
    assert printed.startswith("accuracy") and printed in result.rank_log(0).read_text()
    assert "accuracy" not in result.rank_log(1).read_text()
    assert no_rank_processes(str(result.run_dir))


PIPELINE_CELLS = [
    "import random\nimport torch\nfrom tokenizers import Tokenizer, models, pre_tokenizers\n"
    "from transformers import BertConfig, BertForSequenceClassification, PreTrainedTokenizerFast, pipeline\n"
    "words = 'the a movie good bad great awful plot actor was is not very'.split()\n"
    "vocab = {w: i for i, w in enumerate(['[PAD]', '[UNK]', '[CLS]', '[SEP]', '[MASK]'] + words)}\n"
    "wordlevel = Tokenizer(models.WordLevel(vocab, unk_token='[UNK]'))\n"
    "wordlevel.pre_tokenizer = pre_tokenizers.Whitespace()\n"
    "tokenizer = PreTrainedTokenizerFast(tokenizer_object=wordlevel, unk_token='[UNK]', pad_token='[PAD]',\n"
    "                                    cls_token='[CLS]', sep_token='[SEP]')\n"
    "torch.manual_seed(0)\n"
    "model = BertForSequenceClassification(BertConfig(vocab_size=len(vocab), hidden_size=16, num_hidden_layers=1,\n"
    "    num_attention_heads=2, intermediate_size=32, num_labels=3)).eval()\n"
    "classifier = pipeline('text-classification', model=model, tokenizer=tokenizer, device=-1)\n"
    "texts = [' '.join(random.Random(i).choices(words, k=1 + i % 9)) for i in range(23)]",
    "preds = classifier(texts, batch_size=4)",
    "with open('preds.csv', 'w') as fh:\n    for text, p in zip(texts, preds):\n"
    "        fh.write(f\"{text},{p['label']},{p['score']!r}\\n\")\nprint('rows', len(preds))",
]


def test_a_pipeline_given_a_whole_list_splits_it_and_writes_what_one_process_writes(tmp_path, monkeypatch):
    from conftest import write_notebook

    reference, ranked = tmp_path / "one", tmp_path / "two"
    reference.mkdir()
    ranked.mkdir()
    subprocess.run([sys.executable, "-c", "\n\n".join(PIPELINE_CELLS)], cwd=reference, check=True,
                   capture_output=True, text=True, timeout=120)
    notebook = write_notebook(ranked / "pipe.ipynb", PIPELINE_CELLS)
    monkeypatch.chdir(ranked)
    result = run_job(notebook, RunOptions(nproc=2, runs_dir=tmp_path / "runs"), QuietView()).run
    assert result.ok, result.failure
    assert (ranked / "preds.csv").read_bytes() == (reference / "preds.csv").read_bytes()
    assert len((ranked / "preds.csv").read_text().splitlines()) == 23
    # 23 rows in 6 batches of 4: the first rank three whole batches, the second the other three
    shares = [json.loads((result.run_dir / "shares" / f"rank{r}.jsonl").read_text()) for r in (0, 1)]
    assert [(s["unit"], s["first"], s["end"], s["total"], s["world"]) for s in shares] == [
        ("rows", 0, 12, 23, 2), ("rows", 12, 23, 23, 2)]
    for r in (0, 1):
        times_file = result.run_dir / "shares" / f"rank{r}-times.jsonl"
        (times,) = [json.loads(ln) for ln in times_file.read_text().splitlines()]
        assert times["loop"] == shares[r]["loop"] and times["rows_s"] >= 0 and times["gather_s"] >= 0
    assert "rows 23" in result.rank_log(0).read_text() and "rows 23" not in result.rank_log(1).read_text()
    assert no_rank_processes(str(result.run_dir))


def test_a_loop_over_a_pipeline_given_a_dataset_column_splits_it_and_writes_what_one_process_writes(
        tmp_path, monkeypatch):
    """``for out in pipe(KeyDataset(ds, "text"), batch_size=4)``, transformers' documented way over a dataset: each
    rank calls the pipeline on its block of whole batches of the column, every rank walks every result."""
    from conftest import write_notebook

    cells = [PIPELINE_CELLS[0],
             "from tqdm.auto import tqdm\nfrom transformers.pipelines.pt_utils import KeyDataset\n"
             "ds = [{'text': t, 'id': i} for i, t in enumerate(texts)]\npreds = []\n"
             "for out in tqdm(classifier(KeyDataset(ds, 'text'), batch_size=4), total=len(ds)):\n"
             "    preds.append(out)",
             PIPELINE_CELLS[2]]
    reference, ranked = tmp_path / "one", tmp_path / "two"
    reference.mkdir()
    ranked.mkdir()
    subprocess.run([sys.executable, "-c", "\n\n".join(cells)], cwd=reference, check=True, capture_output=True,
                   text=True, timeout=120)
    notebook = write_notebook(ranked / "pipe.ipynb", cells)
    monkeypatch.chdir(ranked)
    result = run_job(notebook, RunOptions(nproc=2, runs_dir=tmp_path / "runs"), QuietView()).run
    assert result.ok, result.failure
    assert (ranked / "preds.csv").read_bytes() == (reference / "preds.csv").read_bytes()
    assert len((ranked / "preds.csv").read_text().splitlines()) == 23
    shares = [json.loads((result.run_dir / "shares" / f"rank{r}.jsonl").read_text()) for r in (0, 1)]
    assert [(s["unit"], s["first"], s["end"], s["total"]) for s in shares] == [("rows", 0, 12, 23), ("rows", 12, 23, 23)]
    assert "rows 23" in result.rank_log(0).read_text() and "rows 23" not in result.rank_log(1).read_text()
    assert no_rank_processes(str(result.run_dir))


def test_rows_go_to_whichever_rank_is_free_and_come_back_in_order(tmp_path):
    job = Path(__file__).resolve().parent / "jobs" / "handed_rows.py"
    chunks = []
    res = launch(plan(job, new_run_dir(tmp_path / "runs", "handed_rows"), RunOptions(timeout_s=120), nproc=2,
                      cwd=tmp_path, env={}), sink=lambda stream, text: chunks.append(text))
    out = "".join(chunks)
    assert res.ok, out[-3000:]
    result = json.loads(out.split("RESULT ", 1)[1].splitlines()[0])
    assert result["answers"] == [[i, (3 * i) ** 2] for i in range(40)] and result["total"] == 3 * sum(range(40))
    taken = [[tuple(piece) for piece in rank] for rank in result["taken"]]
    assert sorted(taken[0] + taken[1]) == handed_chunks(40, 2)  # every chunk once, on one rank
    rows = [sum(end - first for first, end in rank) for rank in taken]
    assert rows[1] > 2 * rows[0], taken  # the slow rank took fewer: its contiguous half would have been 20
    assert result["last"] == [[39, 117], [39, 117]]  # every rank holds the last row's names, whoever ran it
    for rank, bar in enumerate(result["bars"]):  # each rank's bar ends full, at the rows it took
        assert bar.startswith(f"predicting (rank {rank}'s share): 100%") and f"{rows[rank]}/{rows[rank]}" in bar, bar
