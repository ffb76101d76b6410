"""A split loop over 40 rows on two ranks, as ``rules/predict.py`` writes it, rank 0 twenty times slower a row (a
busier GPU, longer answers): the rows are handed to whichever rank is free. Rank 0 prints ``RESULT {...}``: the
gathered list and sum, and the rows each rank took."""

import json
import time

import torch.distributed as dist

import nbddp.runtime as _nbddp
import nbddp.runtime.predict

_nbddp.setup()
rank = _nbddp.rank_info().rank
answers, total = [], 0
dist.barrier()  # both ranks at the loop together: the rows each takes depend on its speed alone
for i, x in (_nbddp_rows := _nbddp.predict.Rows([3 * k for k in range(40)], 0, answers=answers, total=total)):
    time.sleep(0.1 if rank == 0 else 0.005)
    answers.append([i, x * x])
    total += _nbddp_rows.add("total", x)
else:
    answers, total = _nbddp_rows.gathered()
    _nbddp_rows.settle(globals(), "i", "x")  # as a kept cell's loop: the names as the last row left them
taken, last = [None, None], [None, None]
dist.all_gather_object(taken, [(first, end) for first, end, _ in _nbddp_rows.pieces])
dist.all_gather_object(last, [i, x])
if _nbddp.is_main_process():
    print("RESULT " + json.dumps({"answers": answers, "total": total, "taken": taken, "last": last}), flush=True)
_nbddp.cleanup()
