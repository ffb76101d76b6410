"""A notebook's installs and uninstalls run before launch in the notebook's order (``!pip uninstall -y protobuf``
then ``!pip install protobuf==…`` leaves protobuf installed, as in the kernel), and an install that fails
before launch is said at its cell and line with ``--skip-installs``. No process is started by the fast tests."""

from __future__ import annotations

import sys
import textwrap

import pytest

from nbddp.cells import Cell
from nbddp.convert.script import convert_cells
from nbddp.errors import LaunchError
from nbddp.launch import run_installs


def convert(*sources):
    return convert_cells([Cell(i, textwrap.dedent(s)) for i, s in enumerate(sources, start=1)])


def test_an_uninstall_runs_before_launch_in_its_place_among_the_installs():
    script = convert("!pip install -q transformers\n",
                     "!pip uninstall -y protobuf\n%pip install protobuf==3.20.3\n",
                     "import torch\nprint(torch.__version__)\n")
    assert [i.argv() for i in script.installs] == [
        ["pip", "install", "-q", "transformers"], ["pip", "uninstall", "-y", "protobuf"],
        ["pip", "install", "protobuf==3.20.3"]]
    ran_in_the_ranks = [line for line in script.text.splitlines()
                        if "uninstall" in line and "# nbddp" not in line and not line.lstrip().startswith("#")]
    assert ran_in_the_ranks == []


@pytest.mark.e2e
def test_a_failed_install_names_its_cell_and_line_and_skip_installs():
    # a real pip, run before launch: it fails at once on a package name no index has
    script = convert("import os\n", "try:\n    import nbddp_no_such_pkg\nexcept ImportError:\n"
                                    "    !{} -m pip install --no-index nbddp-no-such-pkg\n".format(sys.executable))
    assert script.installs == ()  # an install that expands {…} stays in the ranks, in its place
    script = convert("import os\n", "try:\n    import nbddp_no_such_pkg\nexcept ImportError:\n"
                                    "    !pip install --no-index nbddp-no-such-pkg\n")
    [install] = script.installs
    with pytest.raises(LaunchError) as info:
        run_installs(script.installs, sink=lambda stream, text: None)
    message = str(info.value)
    assert "cell 2, line 4" in message and "--skip-installs" in message and "nbddp-no-such-pkg" in message
