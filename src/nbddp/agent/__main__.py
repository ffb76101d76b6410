"""``python -m nbddp.agent <torchrun arguments>``: torchrun's process (``nbddp.agent.main``)."""

import sys

from . import exit_without_teardown, main

try:
    main()
except Exception:  # a failed rank (ChildFailedError), a stop (torchrun's SignalException):
    # said as Python says an uncaught error, exit status 1 as then; torchrun has stopped every rank already,
    # so the end is the same as after a job that ended well, without the teardown (0.7 s of each stop)
    sys.excepthook(*sys.exc_info())
    exit_without_teardown(1)
exit_without_teardown(0)  # every rank ended well
