"""Jobs that several tests read, each launched once per session: a launch is ~10 s of the end-to-end lane,
and a test that only reads what a job left proves as much as one that launches it again.

Registered in ``tests/conftest.py`` (``pytest_plugins``), so each fixture is one fixture for the whole suite.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import write_notebook

#: A greeting from each rank, then a draw from each random generator after nbddp's seeding.
GREETING_CELLS = [
    "import os\nrank = int(os.environ['RANK'])",
    "print(f'hello from rank {rank}', flush=True)",
    "import random\nimport torch\nprint('draw', random.random(), torch.rand(1).item(), flush=True)",
]
GREETING_SEED = 1234


@dataclass(frozen=True)
class Launched:
    folder: Path  # where the notebook is (the ranks' working directory)
    job: object  # the JobResult
    said: list  # the run directory first (on_run_dir), then each text rank 0 streamed

    @property
    def streamed(self) -> str:
        return "".join(s for s in self.said if isinstance(s, str))


@pytest.fixture(scope="session")
def greeting_job(tmp_path_factory) -> Launched:
    """``greet.ipynb`` (``GREETING_CELLS``) through ``run_job`` on 2 ranks, seeded with ``GREETING_SEED``."""
    from nbddp.job import run_job
    from nbddp.options import RunOptions
    from views import Said

    folder = tmp_path_factory.mktemp("greeting")
    said: list = []
    job = run_job(write_notebook(folder / "greet.ipynb", GREETING_CELLS),
                  RunOptions(every_rank=True, nproc=2, runs_dir=folder / "runs", env={"NBDDP_SEED": str(GREETING_SEED)}),
                  Said(said, run_dir=True))
    return Launched(folder, job, said)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups (make test-e2e runs --dist loadgroup)
def pytest_collection_modifyitems(items):
    """The tests reading a session job form one xdist group, so they run on one worker and the job is launched
    once, not once per worker."""
    for item in items:
        for name in SESSION_JOBS:
            if name in getattr(item, "fixturenames", ()):
                item.add_marker(pytest.mark.xdist_group(name))


#: The session-scoped job fixtures above, by name.
SESSION_JOBS = ("greeting_job",)
