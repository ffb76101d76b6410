"""nbformat is imported without compiling rfc3987_syntax's IRI grammars (``nbddp.notebook_format``): 2.6 s
of CPU per ``nbddp run`` on the 2-core machine, before torchrun starts. The checkers jsonschema builds on
them still work, loading the real module on their first use."""

import sys

import pytest

from nbddp import notebook_format


@pytest.fixture
def fresh_jsonschema():
    """jsonschema and rfc3987_syntax as if never imported; the modules of this process put back after."""
    names = [n for n in sys.modules if n.split(".")[0] in ("jsonschema", "rfc3987_syntax")]
    kept = {n: sys.modules.pop(n) for n in names}
    yield
    for n in [n for n in sys.modules if n.split(".")[0] in ("jsonschema", "rfc3987_syntax")]:
        del sys.modules[n]
    sys.modules.update(kept)


def test_jsonschema_loads_without_the_iri_grammars_which_load_on_first_use(fresh_jsonschema):
    assert notebook_format.import_jsonschema_lazily()  # rfc3987-syntax is installed (dev extras), rfc3987 not
    assert "jsonschema" in sys.modules
    assert "rfc3987_syntax" not in sys.modules and "rfc3987_syntax.syntax_helpers" not in sys.modules

    import jsonschema

    checker = jsonschema.FormatChecker()
    assert "iri" in checker.checkers and "iri-reference" in checker.checkers
    assert checker.conforms("http://example.com/päth", "iri")
    assert not checker.conforms("http://exa mple.com", "iri")  # a space: the real grammar said no
    import rfc3987_syntax

    assert hasattr(rfc3987_syntax, "parse")  # the real module now, not the stand-in


def test_nothing_is_done_once_jsonschema_is_in(fresh_jsonschema):
    import jsonschema  # noqa: F401

    assert not notebook_format.import_jsonschema_lazily()
