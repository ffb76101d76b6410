"""tests/jobs/tiny_bert_trainer.py on the ranks: rank 0 prints ``RESULT {...}``."""

import json

import nbddp.runtime as rt

rt.setup()

from tiny_bert_trainer import train_and_evaluate  # noqa: E402

result = train_and_evaluate("trainer-out")
if rt.is_main_process():
    print("RESULT " + json.dumps(result), flush=True)
rt.cleanup()
