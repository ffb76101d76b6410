"""Library log lines every run would show and nobody can act on, dropped in every rank.

bitsandbytes, imported on a CPU with AVX-512 BF16, logs that it could not load an optional CPU kernel
(``Failed to load CPU gemm_4bit_forward from kernels-community: No module named 'kernels'…``): once per rank
and per run, through the logging module's last-resort handler, so a terminal or a notebook shows it on every
job though it only means 4-bit matrix products on the CPU take bitsandbytes' plain path. A filter on the
library's own logger (made here before the library imports it, so no import of the library is needed)
drops exactly these lines; everything else the logger says passes.
"""

from __future__ import annotations

import logging

#: (logger, the message's start, why nobody needs it in a run's stream).
KNOWN: tuple[tuple[str, str, str], ...] = (
    ("bitsandbytes.backends.cpu.ops", "Failed to load CPU gemm_4bit_forward from kernels-community",
     "an optional CPU kernel (pip install kernels); without it bitsandbytes takes its plain CPU path"),
)


class _DropStarting(logging.Filter):
    def __init__(self, start: str):
        super().__init__()
        self.start = start

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.start)


def quiet() -> None:
    """Drop the ``KNOWN`` lines in this process; once (a second call adds nothing)."""
    for name, start, _ in KNOWN:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropStarting) and f.start == start for f in logger.filters):
            logger.addFilter(_DropStarting(start))
