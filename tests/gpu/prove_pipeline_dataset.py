"""GPU proof: a pipeline over a dataset's column, ``for out in pipe(KeyDataset(ds, "text"), batch_size=4)`` (the
way transformers documents for a dataset), split over two GPUs by ``nbddp run``, writes what one process writes.

The notebook: a tiny BERT classifier made from a config (no download) in a ``pipeline(…, device=0)``, 23 texts
as a list of rows, the loop over the pipeline's results, then ``preds.csv`` (text, label, the score's repr: every
bit of it). Run as written in one process on GPU 0 (the kernel's baseline), then through ``run_job`` (what
``nbddp run NB --nproc 2`` and ``%%ddp_train`` run) on two ranks. Passes when the job ended well, each rank's
pipeline was on its own card (``cuda:0``, ``cuda:1``, printed by the notebook before it predicts), the ranks'
blocks were whole batches of 4, disjoint and together the 23 rows, and ``preds.csv`` is byte for byte the one
process's. Exit 0 on a pass, 1 on a failure, 2 (SKIP) with fewer than 2 GPUs; ``--cpu`` runs it on two gloo
processes (``device=-1``).

    python tests/gpu/prove_pipeline_dataset.py [--cpu]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import nbformat

CELLS = [
    "import random\nimport torch\nfrom tokenizers import Tokenizer, models, pre_tokenizers\n"
    "from transformers import BertConfig, BertForSequenceClassification, PreTrainedTokenizerFast, pipeline\n"
    "words = 'the a movie good bad great awful plot actor was is not very'.split()\n"
    "vocab = {w: i for i, w in enumerate(['[PAD]', '[UNK]', '[CLS]', '[SEP]', '[MASK]'] + words)}\n"
    "wordlevel = Tokenizer(models.WordLevel(vocab, unk_token='[UNK]'))\n"
    "wordlevel.pre_tokenizer = pre_tokenizers.Whitespace()\n"
    "tokenizer = PreTrainedTokenizerFast(tokenizer_object=wordlevel, unk_token='[UNK]', pad_token='[PAD]',\n"
    "                                    cls_token='[CLS]', sep_token='[SEP]')\n"
    "torch.manual_seed(0)\n"
    "model = BertForSequenceClassification(BertConfig(vocab_size=len(vocab), hidden_size=64, num_hidden_layers=2,\n"
    "    num_attention_heads=4, intermediate_size=128, num_labels=3)).eval()\n"
    "classifier = pipeline('text-classification', model=model, tokenizer=tokenizer, device=DEVICE)\n"
    "texts = [' '.join(random.Random(i).choices(words, k=1 + i % 9)) for i in range(23)]\n"
    "print('pipeline on', classifier.device, flush=True)",
    "from transformers.pipelines.pt_utils import KeyDataset\n"
    "ds = [{'text': t, 'id': i} for i, t in enumerate(texts)]\npreds = []\n"
    "for out in classifier(KeyDataset(ds, 'text'), batch_size=4):\n    preds.append(out)",
    "with open('preds.csv', 'w') as fh:\n    for text, p in zip(texts, preds):\n"
    "        fh.write(f\"{text},{p['label']},{p['score']!r}\\n\")\nprint('rows', len(preds))",
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="two gloo processes, device=-1")
    args = parser.parse_args()
    import torch

    if not args.cpu and torch.cuda.device_count() < 2:
        print(f"SKIP: {torch.cuda.device_count()} GPU(s) here, 2 needed")
        return 2
    cells = [c.replace("DEVICE", "-1" if args.cpu else "0") for c in CELLS]
    tmp = Path(tempfile.mkdtemp(prefix="prove-pipeline-dataset-"))
    one, two = tmp / "one", tmp / "two"
    one.mkdir()
    two.mkdir()
    baseline = subprocess.run([sys.executable, "-c", "\n\n".join(cells)], cwd=one, capture_output=True, text=True,
                              timeout=300)
    if baseline.returncode != 0:
        print("FAIL: the notebook in one process:", baseline.stderr[-2000:])
        return 1
    notebook = two / "pipe.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells]), str(notebook))
    os.chdir(two)
    from nbddp.display.view import QuietView
    from nbddp.job import run_job
    from nbddp.options import RunOptions

    result = run_job(notebook, RunOptions(nproc=2, runs_dir=tmp / "runs"), QuietView()).run
    if not result.ok:
        print("FAIL: the job:", result.failure, result.run_dir)
        return 1
    problems = []
    logs = [(result.rank_log(r).read_text() if result.rank_log(r) else "") for r in (0, 1)]
    devices = [next((ln.split()[-1] for ln in log.splitlines() if ln.startswith("pipeline on")), None) for log in logs]
    want = ["cpu", "cpu"] if args.cpu else ["cuda:0", "cuda:1"]
    if devices != want:
        problems.append(f"each rank's pipeline on its own card: {devices}, not {want}")
    shares = [json.loads((result.run_dir / "shares" / f"rank{r}.jsonl").read_text()) for r in (0, 1)]
    blocks = [(s["first"], s["end"], s["total"]) for s in shares]
    if blocks != [(0, 12, 23), (12, 23, 23)]:
        problems.append(f"blocks of whole batches of 4, [0, 12) and [12, 23): {blocks}")
    same = (two / "preds.csv").read_bytes() == (one / "preds.csv").read_bytes()
    if not same:
        problems.append("preds.csv byte for byte the one process's")
    print(f"one process: {baseline.stdout.splitlines()[0]}; ranks: {devices}; blocks {blocks}; "
          f"preds.csv equal: {same}; run directory {result.run_dir}")
    for problem in problems:
        print("FAIL:", problem)
    print("PASS" if not problems else "FAIL")
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
