"""A notebook that only predicts with a Trainer (``trainer.predict``, ``trainer.evaluate()``), run on two gloo ranks:
the Trainer splits and gathers its rows itself, the files written after are written once, by rank 0, byte for
byte what one plain process writes (the predictions and the loss: ``token_average`` keeps the loss one process's)."""

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
    "ids, ys = torch.randint(5, 90, (16, 12), generator=g), torch.randint(0, 3, (16,), generator=g)\n"
    "test_ds = [{'input_ids': ids[i], 'labels': ys[i]} for i in range(16)]\n"
    "trainer = Trainer(model=model, args=TrainingArguments('out', per_device_eval_batch_size=4, report_to=[]))",
    "out = trainer.predict(test_ds)",
    "metrics = trainer.evaluate(test_ds)",
    "with open('submission.csv', 'w') as fh:\n"
    "    fh.write('id,label,logits\\n')\n"
    "    for i, row in enumerate(out.predictions):\n"
    "        fh.write(f'{i},{row.argmax()},{row.tolist()!r}\\n')\n"
    "json.dump({'test_loss': out.metrics['test_loss'], 'eval_loss': metrics['eval_loss']}, open('metrics.json', 'w'))\n"
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
    assert "rows written 16" in result.rank_log(0).read_text()
    assert "rows written" not in result.rank_log(1).read_text()  # the code after runs once, on rank 0
