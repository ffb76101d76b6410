import os
import sys
from pathlib import Path

import nbformat
import pytest

from nbddp.agent import forked_ranks

# lanes: fails a test whose e2e mark does not match whether it started a process (tests/lanes.py);
# shared_jobs: jobs several tests read, launched once per session
pytest_plugins = ["lanes", "pytester", "shared_jobs"]

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART = ROOT / "notebooks" / "quickstart.ipynb"
#: The xdist group of the tests that bind torchrun's default port 29500 (or hold it on purpose): one worker runs
#: them one after another, so none finds the port taken by another.
DEFAULT_PORT_GROUP = "default-port-29500"

#: The test files whose tests run longest (each a minute or more of launches on a 2-core machine), started first:
#: pytest-xdist hands tests out in collection order, so a long test collected last leaves one worker running it
#: alone while the other idles. Longest first is the classic greedy schedule (LPT); the rest keep their order.
LONGEST_FIRST = ("test_runnable_corpus.py", "test_runnable_launched.py", "test_kept_kernel.py", "test_launched.py",
                 "test_grad_ckpt.py", "test_fsdp_saves.py", "test_loss_filter.py", "test_clean_exit.py",
                 "test_no_checkpointing.py", "test_faults.py", "test_magics_kernel.py",
                 "test_strategy.py", "test_part_optimizer.py", "test_train_correctly.py")


def pytest_collection_modifyitems(items):
    place = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: place.get(item.path.name, len(place)))  # a stable sort: the rest as collected


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


#: For a test of forked ranks themselves: off Linux, ranks start fresh by design, whatever the switch says
#: (with GPUs they are forked too: ``tests/gpu/check_forked_ranks.py`` proves it there).
NEEDS_FORKED_RANKS = pytest.mark.skipif(not forked_ranks.possible_here(), reason="ranks start fresh off Linux")



def rewrite_cells(cells, every_statement: bool):
    """Cells (dedented) through the rules, with the precheck or over every statement (the reference the checks
    are tested against): the new sources and the ``(cell position, rule, line, message)`` changes."""
    import textwrap

    from nbddp.convert.code import CellCode
    from nbddp.convert.engine.plan import plan_cell
    from nbddp.convert.engine.rewrite import rewrite as rewrite_cell
    from nbddp.convert.facts import gather_facts
    from nbddp.convert.rules import RULES

    codes = [CellCode.read(textwrap.dedent(c), position=i) for i, c in enumerate(cells)]
    facts = gather_facts(codes)
    out, changes = [], []
    for code in codes:
        plan = plan_cell(code, facts, RULES, every_statement=every_statement)
        new, made = rewrite_cell(code, plan, facts) if plan is not None else (code.code, [])
        out.append(new)
        changes += [(code.position, *change) for change in made]
    return out, changes


@pytest.fixture(params=["checks", "every statement"])
def rewrite(request):
    """``rewrite_cells`` both ways: the new sources and the ``(rule, line, message)`` changes."""

    def run(*cells):
        out, changes = rewrite_cells(cells, every_statement=request.param != "checks")
        return out, [change[1:] for change in changes]

    return run
