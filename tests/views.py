"""The views tests hand to ``run_job`` (``display/view.py``): ``QuietView`` shows nothing, ``Said`` keeps it."""

from nbddp.display.view import QuietView


class Said(QuietView):
    """Each text rank 0 streamed, appended to ``said`` (a list the test holds) as it came; with ``run_dir``, the
    run directory too, when ``on_run_dir`` tells it (first: before any text)."""

    def __init__(self, said: list, run_dir: bool = False):
        self.said, self.run_dir = said, run_dir

    def sink(self, stream: str, text: str) -> None:
        self.said.append(text)

    def on_run_dir(self, run_dir) -> None:
        if self.run_dir:
            self.said.append(run_dir)
