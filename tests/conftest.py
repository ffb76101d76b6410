import os
import sys
from pathlib import Path

import nbformat
import pytest

# lanes: fails a test whose e2e mark does not match whether it started a process (tests/lanes.py);
# shared_jobs: jobs several tests read, launched once per session
pytest_plugins = ["lanes", "pytester", "shared_jobs"]

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART = ROOT / "notebooks" / "quickstart.ipynb"


@pytest.fixture(scope="session", autouse=True)
def _private_cache(tmp_path_factory):
    """The tiny model and run directories of the tests live in a temporary folder."""
    os.environ["NBDDP_CACHE"] = str(tmp_path_factory.mktemp("nbddp-cache"))
    yield


def write_notebook(path: Path, sources: list[str], markdown_first: bool = False) -> Path:
    """A notebook of code cells (optionally preceded by a markdown cell), valid under nbformat."""
    cells = [nbformat.v4.new_markdown_cell("# title")] if markdown_first else []
    cells += [nbformat.v4.new_code_cell(src) for src in sources]
    nb = nbformat.v4.new_notebook(cells=cells)
    nbformat.write(nb, str(path))
    return path


@pytest.fixture
def notebook(tmp_path):
    def make(sources, name="nb.ipynb", markdown_first=False):
        return write_notebook(tmp_path / name, sources, markdown_first)

    return make


def no_rank_processes(marker: str) -> bool:
    """True when no process whose command line holds ``marker`` is alive."""
    import psutil

    me = os.getpid()
    for p in psutil.process_iter(["pid", "cmdline"]):
        if p.info["pid"] != me and marker in " ".join(p.info["cmdline"] or []):
            return False
    return True
