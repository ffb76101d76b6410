"""The ``magic`` check of ``run_all.sh``: ``notebooks/magics.ipynb`` executed in a real kernel (nbclient), its
``%%ddp_train`` cell training on every GPU, the next cells reading ``_ddp``.

What the cell shows is read as a person sees it: the streams, and the displays' text and HTML. nbddp's
start-up lines (the ``backend nccl`` one among them) live in the log view's folded HTML, not in a stream, so a
check that read the streams alone failed on a run that trained and saved.

    python tests/gpu/check_magics.py                  # on GPUs: backend nccl
    python tests/gpu/check_magics.py --backend gloo   # on CPU

The test suite reads this check (``missing``, ``cell_text``) on its own kernel run of the notebook on CPU
(``tests/test_magics_kernel.py``), not on a second one.

Exit status 0 when the notebook trained, 1 otherwise.
"""

from __future__ import annotations

import argparse
import html
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "notebooks" / "magics.ipynb"


def cell_text(nb) -> str:
    """Everything the notebook's code cells show: stream text, and each display's text and HTML (tags dropped)."""
    parts = []
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        for output in cell.get("outputs", []):
            parts.append(output.get("text", ""))
            data = output.get("data", {})
            parts.append(data.get("text/plain", ""))
            parts.append(html.unescape(re.sub(r"<[^>]+>", "\n", data.get("text/html", ""))))
    return "\n".join(p for p in parts if p)


def nbformat_like(*outputs_of_cells: list[dict]):
    """A notebook whose code cells hold these outputs (for the test of ``cell_text``)."""
    import nbformat

    cells = [nbformat.v4.new_code_cell("", outputs=[nbformat.from_dict(o) for o in outputs])
             for outputs in outputs_of_cells]
    return nbformat.v4.new_notebook(cells=cells)


def missing(text: str, backend: str) -> list[str]:
    """What a good run shows that ``text`` lacks."""
    wanted = [f"backend {backend}", "JobResult(ok", "adapter:", "nbddp: finished in"]
    return [w for w in wanted if w not in text]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="nccl", help="the backend rank 0 must report (nccl on GPUs, gloo on CPU)")
    ap.add_argument("--timeout", type=int, default=600)
    ap.add_argument("--workdir", type=Path, default=NOTEBOOK.parent,
                    help="where the kernel runs and the job writes (default: the notebook's folder)")
    args = ap.parse_args(argv)
    import nbclient
    import nbformat

    nb = nbformat.read(str(NOTEBOOK), 4)
    nbclient.NotebookClient(nb, timeout=args.timeout, kernel_name="python3",
                            resources={"metadata": {"path": str(args.workdir)}}).execute()
    text = cell_text(nb)
    print(text[-4000:])
    lacking = missing(text, args.backend)
    print("PASS" if not lacking else f"FAIL: the cells do not show {lacking}")
    return 0 if not lacking else 1


if __name__ == "__main__":
    sys.exit(main())
