"""An install in the ``except ImportError:`` of a ``try:`` of imports runs before launch only where the import
fails, as in the kernel: where the package imports, nothing is installed (a failing install would have stopped
the job). No process is started: the install that is skipped is never run."""

from __future__ import annotations

import textwrap

import pytest

from nbddp.cells import Cell
from nbddp.convert.script import convert_cells
from nbddp.launch import run_installs


def convert(*sources):
    return convert_cells([Cell(i, textwrap.dedent(s)) for i, s in enumerate(sources, start=1)])


@pytest.mark.parametrize("handler", ["except ImportError:", "except (ImportError, OSError):", "except:"])
def test_an_install_where_an_import_fails_knows_its_import(handler):
    script = convert("import os\n", f"try:\n    import json\n    from email.mime import text\n{handler}\n"
                                    "    !pip install --no-index nbddp-no-such-pkg\n    import json\n")
    [install] = script.installs
    assert (install.cell, install.line, install.unless_importable) == (2, 5, ("json", "email"))


def test_an_install_outside_such_an_except_is_unconditional():
    script = convert("try:\n    import json\n    x = json.loads('1')\nexcept ImportError:\n    !pip install a\n",
                     "!pip install b\n")
    assert [i.unless_importable for i in script.installs] == [(), ()]


def test_an_install_whose_import_works_here_is_not_run():
    # before: it ran unconditionally and its failure (no index here) stopped the job before launch
    script = convert("try:\n    import json\nexcept ImportError:\n    !pip install --no-index nbddp-no-such-pkg\n")
    said = []
    run_installs(script.installs, sink=lambda stream, text: said.append(text))
    assert said == ["nbddp: cell 1, line 4: not installing `pip install --no-index nbddp-no-such-pkg`: json imports "
                    "here, and the notebook installs it only where the import fails\n"]
