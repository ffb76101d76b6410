"""A kept rank's own costs, without a job: when it looks at the stop flag, and its heap settled between cells."""

from __future__ import annotations

import gc
import weakref

from nbddp.runtime.kept_protocol import Interrupted, Run
from nbddp.runtime.serve import MAX_STOP_INTERVAL, STOP_CHECK_S, StopSchedule, settle_heap


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_the_stop_flag_is_looked_at_on_the_first_step_then_about_every_quarter_second():
    clock = Clock()
    schedule = StopSchedule(clock)
    schedule.begin(0)
    assert [s for s in range(1, 5) if schedule.due(s)] == [1, 2, 3, 4]  # nothing agreed yet: the first step looks
    clock.now += 0.05  # one step of 0.05 s
    assert schedule.proposal(1) == 5 == round(STOP_CHECK_S / 0.05)
    schedule.agreed(1, 5)  # another rank proposed more steps: the largest is taken by all
    assert [s for s in range(2, 12) if schedule.due(s)] == [6, 7, 8, 9, 10, 11]
    clock.now += 5 * 2.0  # slow steps: every step looks, never fewer than one
    assert schedule.proposal(6) == 1
    schedule.agreed(6, 0)
    assert schedule.due(7)
    clock.now += 1e-6 * 1  # tiny steps: bounded
    assert schedule.proposal(7) == MAX_STOP_INTERVAL
    schedule.begin(30)  # a new train() from step 30 looks at its first step again
    assert schedule.due(31) and not schedule.due(30)


def test_every_rank_takes_the_same_steps_from_the_agreed_interval():
    """Two ranks whose steps took different times propose different intervals; with the MAX all-reduce's
    answer both look at the same steps, so none waits in an all-reduce the other never enters."""
    fast, slow = Clock(), Clock()
    ranks = [StopSchedule(fast), StopSchedule(slow)]
    looked = [[], []]
    for step in range(1, 200):
        fast.now += 0.01
        slow.now += 0.03
        due = [r.due(step) for r in ranks]
        assert due[0] == due[1]
        if due[0]:
            agreed = max(r.proposal(step) for r in ranks)
            for i, r in enumerate(ranks):
                r.agreed(step, agreed)
                looked[i].append(step)
    assert looked[0] == looked[1] and looked[0][0] == 1 and 5 < len(looked[0]) < 20


class Node:
    def __init__(self):
        self.me = self  # a reference cycle: only the collector frees it


def test_settling_freezes_the_heap_and_frees_what_was_dropped_since_at_the_next_settle():
    try:
        garbage = Node()
        gone = weakref.ref(garbage)
        del garbage
        kept = Node()
        settle_heap()
        assert gone() is None and gc.get_freeze_count() > 0
        dropped = weakref.ref(kept)
        del kept  # frozen, then dropped (a cell replaced the model): a plain collection leaves it ...
        gc.collect()
        assert dropped() is not None
        settle_heap()  # ... the next settle frees it
        assert dropped() is None
    finally:
        gc.unfreeze()




def test_a_stop_interrupts_a_cell_where_it_waits_and_the_rank_answers_where(tmp_path):
    """The kernel's Stop reaches a cell sleeping in a plain loop at once (SIGINT to the main thread, not after the
    sleep), answered as an interrupt at its line, not a failure; between cells the signal is let go."""
    import signal
    import threading
    import time

    from nbddp.runtime import serve
    from nbddp.runtime.rank import rank_info

    cell = tmp_path / "ddp-cell-1.py"
    cell.write_text("import time\nfor i in range(60):\n    time.sleep(1)\n")
    info = rank_info()
    previous = signal.signal(signal.SIGINT, serve._interrupt_cell)
    try:
        seen = []
        threading.Timer(0.3, lambda: seen.append(serve.where())).start()
        threading.Timer(0.5, serve.interrupt).start()
        began = time.monotonic()
        reply = serve._handle(Run(str(cell), 1, 3), {}, info)
        took = time.monotonic() - began
        assert isinstance(reply, Interrupted) and "KeyboardInterrupt" in reply.traceback, reply
        assert f'File "{cell}", line 3' in reply.traceback
        assert took < 0.9, took  # the sleep of 1 s was cut short
        assert seen == [3]  # where the main thread was, as the reader thread answers it
        serve._interrupt_cell(signal.SIGINT, None)  # no cell running: nothing raised
        assert serve.agree() is None  # one process, no group: nothing to agree on
    finally:
        signal.signal(signal.SIGINT, previous)
        serve._stop_requested.clear()


def test_a_stop_during_a_training_is_left_to_the_step_not_a_signal(tmp_path, monkeypatch):
    from nbddp.runtime import serve

    sent = []
    monkeypatch.setattr(serve.signal, "pthread_kill", lambda *a: sent.append(a))
    serve._cell_running.set()
    serve._training.set()
    try:
        serve.interrupt()
        assert serve._stop_requested.is_set() and not sent  # StopAtStep stops it at the agreed step
        serve._training.clear()
        serve.interrupt()
        assert len(sent) == 1
    finally:
        serve._cell_running.clear()
        serve._training.clear()
        serve._stop_requested.clear()
