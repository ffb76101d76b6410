"""``trainer.predict``/``evaluate`` in a kept job's ``%%ddp`` cell, over 19 rows in batches of 4 on two ranks (rows
that do not fill the last step): ``python kept_trainer_rows.py one`` is the kernel's one process; on the ranks,
each rank is a kept job's as ``serve`` makes it (``listen_for_stop`` at the start, a cell running), and it looks
at the kernel's Stop at every prediction step. Rank 0 (or the one process) writes submission.csv and metrics.json;
rank 0 prints ``RESULT {...}``: the steps each rank's Stop callback counted."""

import json
import os
import sys

ONE = sys.argv[1:] == ["one"]
if not ONE:
    import nbddp.runtime as rt
    import nbddp.runtime.interactive
    from nbddp.runtime import serve

    rt.setup()
    os.environ[serve.SOCKET_ENV] = os.path.join(os.getcwd(), "kernel.sock")  # a kept job's rank
    rt.interactive.guard()  # serve.listen_for_stop: the Trainer's blocks, then the Stop's looks
    serve.STOP_CHECK_S = 0.0  # a look at every prediction step: a block of fewer batches must take the missed ones

import torch  # noqa: E402
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments  # noqa: E402

torch.manual_seed(0)
model = BertForSequenceClassification(BertConfig(vocab_size=100, hidden_size=16, num_hidden_layers=1,
                                                 num_attention_heads=2, intermediate_size=32, num_labels=3))
g = torch.Generator().manual_seed(1)
ids, ys = torch.randint(5, 90, (19, 12), generator=g), torch.randint(0, 3, (19,), generator=g)
test_ds = [{"input_ids": ids[i], "labels": ys[i]} for i in range(19)]


def accuracy(p):
    return {"accuracy": float((p.predictions.argmax(-1) == p.label_ids).mean()), "rows": len(p.label_ids)}


trainer = Trainer(model=model, args=TrainingArguments("out", per_device_eval_batch_size=4, report_to=[]),
                  compute_metrics=accuracy)
if not ONE:
    serve._cell_running.set()  # as while the kernel's %%ddp cell runs (serve._handle)
out = trainer.predict(test_ds)
metrics = trainer.evaluate(test_ds)
if ONE or rt.is_main_process():
    with open("submission.csv", "w") as fh:
        fh.write("id,label,logits\n")
        for i, row in enumerate(out.predictions):
            fh.write(f"{i},{row.argmax()},{row.tolist()!r}\n")
    json.dump({k: v for k, v in {**out.metrics, **metrics}.items() if "loss" in k or "accuracy" in k or "rows" in k},
              open("metrics.json", "w"))
if not ONE:
    serve._cell_running.clear()
    steps = [cb.predicted for cb in trainer.callback_handler.callbacks if hasattr(cb, "finish_evaluation")]
    every = [None] * rt.rank_info().world_size
    torch.distributed.all_gather_object(every, steps)
    if rt.is_main_process():
        print("RESULT " + json.dumps({"steps": every}), flush=True)
    os.environ.pop(serve.SOCKET_ENV)  # the end of the job, not a kept job's serving
    rt.cleanup()
