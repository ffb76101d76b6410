"""What a job shows, as one object: ``run_job(source, options, view)`` hands a view everything a person may see.

A view is anything with the four methods of ``JobView`` (a ``typing.Protocol``: structural, nothing to
inherit). The live panel (``panel.LivePanel``), the terminal's (``terminal.TerminalView``), a template's
(``template.TemplateView``) and a kept job's cell (``kept.view.CellView``) are views; ``QuietView`` shows
nothing and is the base for a view that needs only some of the methods (a test's, collecting what it is
told); ``PrintView``, rank 0's text on this process's stdout and stderr, is the view when none is given.
"""

from __future__ import annotations

import os
from typing import Protocol, runtime_checkable


@runtime_checkable
class JobView(Protocol):
    """What a job tells its view, in the order it does: ``rank_env`` before launch, ``on_run_dir`` once the run
    directory exists, then ``sink`` and ``on_metrics`` while the ranks run."""

    def rank_env(self) -> dict[str, str]:
        """Variables the ranks need for this view (``NBDDP_RICH_DISPLAY``: rank 0's ``display()`` sent here)."""

    def on_run_dir(self, run_dir: str | os.PathLike) -> None:
        """The job's run directory, as soon as it is made (a notebook's log view names it while the job runs)."""

    def sink(self, stream: str, text: str) -> None:
        """Text rank 0 wrote on ``stream`` (``"stdout"`` or ``"stderr"``), and nbddp's own lines about the job."""

    def on_metrics(self, record: dict) -> None:
        """One event rank 0 wrote (``runtime/records.Event``: the Trainer's begin, log and end, a display)."""


class QuietView:
    """A view that shows nothing: the base of a view that needs only some of ``JobView``'s methods."""

    def rank_env(self) -> dict[str, str]:
        return {}

    def on_run_dir(self, run_dir: str | os.PathLike) -> None:
        pass

    def sink(self, stream: str, text: str) -> None:
        pass

    def on_metrics(self, record: dict) -> None:
        pass


class PrintView(QuietView):
    """The view when none is given: rank 0's text on this process's stdout and stderr, as it comes."""

    def sink(self, stream: str, text: str) -> None:
        from ..launch import stdout_sink

        stdout_sink(stream, text)
