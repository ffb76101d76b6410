"""A split loop over 40 rows on two ranks, as ``rules/predict.py`` writes it, rank 0 twenty times slower a row (a
busier GPU, longer answers): the rows are handed to whichever rank is free. The rows come through a progress bar
(``enumerate(tqdm(rows, total=40))``, written to a buffer). Rank 0 prints ``RESULT {...}``: the gathered list and
sum, the rows each rank took and each rank's bar as it ended."""

import io
import json
import time

import torch.distributed as dist
from tqdm.auto import tqdm

import nbddp.runtime as _nbddp
import nbddp.runtime.predict

_nbddp.setup()
rank = _nbddp.rank_info().rank
answers, total = [], 0
shown = io.StringIO()
dist.barrier()  # both ranks at the loop together: the rows each takes depend on its speed alone
bar = tqdm([3 * k for k in range(40)], total=40, desc="predicting", file=shown, mininterval=0)
for i, x in (_nbddp_rows := _nbddp.predict.Rows(bar, 0, answers=answers, total=total)):
    time.sleep(0.1 if rank == 0 else 0.005)
    answers.append([i, x * x])
    total += _nbddp_rows.add("total", x)
else:
    answers, total = _nbddp_rows.gathered()
    _nbddp_rows.settle(globals(), "i", "x")  # as a kept cell's loop: the names as the last row left them
taken, last, bars = [None, None], [None, None], [None, None]
dist.all_gather_object(bars, shown.getvalue().replace("\r", "\n").strip().splitlines()[-1])
dist.all_gather_object(taken, [(first, end) for first, end, _ in _nbddp_rows.pieces])
dist.all_gather_object(last, [i, x])
if _nbddp.is_main_process():
    print("RESULT " + json.dumps({"answers": answers, "total": total, "taken": taken, "last": last, "bars": bars}), flush=True)
_nbddp.cleanup()
