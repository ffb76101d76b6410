"""A notebook that only predicts with a Trainer (``trainer.predict``, ``trainer.evaluate()``), run on two gloo ranks:
the files written after are written once, by rank 0, byte for byte what one plain process writes (the predictions
and the loss: ``token_average`` keeps the loss one process's). Its 19 rows do not fill the ranks' last batches (4 a
rank, 8 a step), which the Trainer would pad with repeated rows: each rank computes its own block of whole batches
instead (``runtime/trainer_rows.py``), and the blocks are gathered once."""

import json
import subprocess
import sys

import pytest

from conftest import write_notebook
from nbddp.display.view import QuietView
from nbddp.job import run_job
from nbddp.options import RunOptions

pytestmark = pytest.mark.e2e

CELLS = [
    "import json, torch\n"
    "from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments\n"
    "torch.manual_seed(0)\n"
    "model = BertForSequenceClassification(BertConfig(vocab_size=100, hidden_size=16, num_hidden_layers=1,\n"
    "    num_attention_heads=2, intermediate_size=32, num_labels=3))\n"
    "g = torch.Generator().manual_seed(1)\n"
    "ids, ys = torch.randint(5, 90, (19, 12), generator=g), torch.randint(0, 3, (19,), generator=g)\n"
    "test_ds = [{'input_ids': ids[i], 'labels': ys[i]} for i in range(19)]\n"
    "def accuracy(p):\n"
    "    return {'accuracy': float((p.predictions.argmax(-1) == p.label_ids).mean()), 'rows': len(p.label_ids)}\n"
    "trainer = Trainer(model=model, args=TrainingArguments('out', per_device_eval_batch_size=4, report_to=[]),\n"
    "                  compute_metrics=accuracy)",
    "out = trainer.predict(test_ds)",
    "metrics = trainer.evaluate(test_ds)",
    "with open('submission.csv', 'w') as fh:\n"
    "    fh.write('id,label,logits\\n')\n"
    "    for i, row in enumerate(out.predictions):\n"
    "        fh.write(f'{i},{row.argmax()},{row.tolist()!r}\\n')\n"
    "json.dump({k: v for k, v in {**out.metrics, **metrics}.items() if 'loss' in k or 'accuracy' in k or 'rows' in k},\n"
    "          open('metrics.json', 'w'))\n"
    "print('rows written', len(out.predictions))",
]


def test_a_trainer_only_predicting_notebook_writes_what_one_process_writes(tmp_path, monkeypatch):
    reference, ranked = tmp_path / "one", tmp_path / "two"
    reference.mkdir()
    ranked.mkdir()
    subprocess.run([sys.executable, "-c", "\n\n".join(CELLS)], cwd=reference, check=True, capture_output=True,
                   timeout=180)
    write_notebook(ranked / "nb.ipynb", CELLS)
    monkeypatch.chdir(ranked)
    result = run_job(ranked / "nb.ipynb", RunOptions(nproc=2, runs_dir=tmp_path / "runs"), QuietView()).run
    assert result.ok, result.failure
    for name in ("submission.csv", "metrics.json"):
        assert (ranked / name).read_bytes() == (reference / name).read_bytes(), name
    # compute_metrics saw every row once, for predict and for evaluate
    assert {k: v for k, v in json.loads((ranked / "metrics.json").read_text()).items() if "rows" in k} == {
        "test_rows": 19, "eval_rows": 19}
    assert "rows written 19" in result.rank_log(0).read_text()
    assert "rows written" not in result.rank_log(1).read_text()  # the code after runs once, on rank 0
    # each call (predict, evaluate) took blocks of whole batches: rows [0, 8) on rank 0, [8, 19) on rank 1
    shares = [[json.loads(line) for line in (result.run_dir / "shares" / f"rank{r}.jsonl").read_text().splitlines()]
              for r in (0, 1)]
    assert [[(s["first"], s["end"], s["total"]) for s in rank] for rank in shares] == [[(0, 8, 19)] * 2,
                                                                                       [(8, 19, 19)] * 2]
