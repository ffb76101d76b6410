"""What a person sees of a job: in a notebook cell a few outputs updated in place (``panel``), in a terminal
rank 0's text with a compact metrics table (``terminal``), and when it ends a summary or the failure with one
traceback mapped to the notebook (``text``). Each is a ``JobView`` (``view``), the one object ``run_job`` shows
a job through.

``progress`` reads rank 0's Trainer events; ``stream`` makes rank 0's raw output short.
"""

from .panel import LivePanel, in_kernel
from .progress import MetricsTable, Progress, loss_plot_png
from .stream import CarriageReturns, RankLog
from .terminal import TerminalView
from .view import JobView, PrintView, QuietView
from .text import cell_label, clean_traceback, failure_headline, failure_report, outcome_error, summary

__all__ = [
    "CarriageReturns", "JobView", "LivePanel", "MetricsTable", "PrintView", "Progress", "QuietView", "RankLog",
    "TerminalView", "cell_label",
    "clean_traceback", "failure_headline", "failure_report", "in_kernel", "loss_plot_png", "outcome_error", "summary",
]
