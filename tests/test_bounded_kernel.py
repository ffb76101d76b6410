"""A long %%ddp_train in a real kernel (nbclient, as papermill runs it): the saved cell is a few outputs and
small, however many steps and logs the run has."""

import json

import pytest

from conftest import no_rank_processes
from kernel import displays, errors, execute, stream
from long_run import sources

pytestmark = pytest.mark.e2e


def test_a_long_run_saves_a_few_small_outputs(tmp_path):
    # 400 steps with a log every 5: 80 table rows and 80 Trainer dict lines, 400 bar redraws (the browser
    # test runs 2000 steps); every part of the cell is bounded by lines and rows, not by steps
    nb, client = execute(tmp_path / "long.ipynb", sources(steps=400, logging_steps=5), timeout=900,
                         NBDDP_CACHE=str(tmp_path / "cache"))
    train = nb.cells[-1]
    assert not errors(train)
    assert [o.output_type for o in train.outputs] == ["stream", "display_data", "display_data", "stream"]
    assert len(json.dumps(train)) <= 100_000
    panel, log = displays(train)
    assert panel.startswith("nbddp · 2 processes · done · step 400/400")
    assert len(panel.splitlines()) == 10 and panel.splitlines()[-1].split()[0] == "400"  # header + last 8 rows
    assert "{'loss'" not in log and len(log.splitlines()) < 25 and "400/400 [" in log
    assert log.count("UserWarning: 'pin_memory'") == 1
    assert stream(train, "stdout").rstrip().splitlines()[-4].startswith("nbddp: finished in")
    train_index = len(nb.cells) - 1
    updates = [m for m in client.messages if m[0] == train_index and m[1] == "update_display_data"]
    assert len(updates) > 20  # live all along, in place
    assert no_rank_processes(str(tmp_path))
