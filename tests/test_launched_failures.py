"""A failed launched command is said by nbddp first and cleanly: its cell and line, the exception line, the
user's own frames mapped to the script's file and line and the ``%%writefile`` cell (``nbddp.launched``),
torchrun's and nbddp's agent frames never shown. Read from recorded ``stderr.log`` texts: no process starts here.

And an install line nbddp cannot split (an unclosed quote) is a refusal at its cell and line, not an internal
error."""

from __future__ import annotations

import pytest

from nbddp.convert.clean import Install
from nbddp.errors import CellError
from nbddp.launch.planning import run_installs


def test_an_install_with_an_unclosed_quote_is_refused_at_its_cell_and_line():
    install = Install(cell=2, line=3, command="pip install 'torch")
    with pytest.raises(CellError) as err:
        install.argv()
    assert str(err.value).startswith("cell 2, line 3: "), str(err.value)
    assert "quot" in str(err.value) and "pip install 'torch" in str(err.value)
    with pytest.raises(CellError):  # as `nbddp run` runs the installs before launch
        run_installs([install], sink=lambda *_: None)
