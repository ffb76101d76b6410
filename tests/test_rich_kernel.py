"""Rank 0's rich output in the job's cell: HTML and the notebook's own plot, each once (issue 18, item 7)."""

import pytest

from kernel import execute, stream

pytestmark = pytest.mark.e2e

RICH = '''%%ddp_train --nproc 2 --every-rank
import matplotlib.pyplot as plt
from IPython.display import HTML, display
display(HTML("<b>RICH-HTML</b>"))
plt.plot([1, 2, 3])
plt.show()
print("JOB TEXT")'''


def test_display_and_plt_show_in_the_ranks_reach_the_cell_as_rich_output_once(tmp_path):
    nb, _ = execute(tmp_path / "nb.ipynb", ["%load_ext nbddp", RICH], NBDDP_CACHE=str(tmp_path / "cache"))
    cell = nb.cells[1]
    assert not [o for o in cell.outputs if o.output_type == "error"], cell.outputs
    data = [o.data for o in cell.outputs if o.output_type == "display_data"]
    html = [d for d in data if "RICH-HTML" in d.get("text/html", "")]
    images = [d for d in data if "image/png" in d]
    assert len(html) == 1 and len(images) == 1, [sorted(d) for d in data]
    printed = stream(cell, "stdout") + str([d.get("text/html", "") for d in data if d not in html + images])
    assert "IPython.core.display.HTML object" not in printed and "RICH-HTML" not in printed  # not as text besides
