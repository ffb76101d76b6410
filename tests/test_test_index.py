"""``tests/README.md``'s index says where each module's tests are: every module of ``src/nbddp`` has its row,
every test file is listed somewhere, and every name in the index exists. A module or test file added, renamed
or removed without its row fails here, with the row to add or mend."""

from __future__ import annotations

import ast
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent
PACKAGE = TESTS.parent / "src" / "nbddp"
README = TESTS / "README.md"
MODULES_HEADING = "## Module → its tests"
OTHERS_HEADING = "## What else the tests hold"
TICKED = re.compile(r"`([^`]+)`")


def is_module(path: Path) -> bool:
    """A module of the index: every ``.py`` file of the package but ``_version.py`` and an ``__init__.py`` holding
    no more than its docstring (a folder's marker, with nothing in it to test)."""
    if path.name == "_version.py":
        return False
    if path.name != "__init__.py":
        return True
    body = ast.parse(path.read_text(encoding="utf-8")).body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    return bool(body)


def package_modules() -> set[str]:
    """The modules the index must name, as it names them: paths relative to ``src/nbddp``."""
    return {path.relative_to(PACKAGE).as_posix() for path in PACKAGE.rglob("*.py") if is_module(path)}


def collected_test_files() -> set[str]:
    """The test files, relative to ``tests/``: ``test_*.py`` there and one folder down (``browser/…``)."""
    return {path.relative_to(TESTS).as_posix() for path in [*TESTS.glob("test_*.py"), *TESTS.glob("*/test_*.py")]}


def table_rows(heading: str) -> list[tuple[list[str], list[str]]]:
    """The rows of the table under ``heading`` in tests/README.md, header and rule left out, each as (the names
    ticked in its first cell, the names ticked in its second)."""
    lines = README.read_text(encoding="utf-8").splitlines()
    assert heading in lines, f"tests/README.md has no line {heading!r}: the index is read from the table under it"
    rows = []
    for line in lines[lines.index(heading) + 1:]:
        if line.startswith("## "):
            break
        if not line.startswith("|") or line.startswith("|---"):
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) < 2 or not cells[0].startswith("`"):
            continue  # the header row
        rows.append((TICKED.findall(cells[0]), TICKED.findall(cells[1])))
    assert rows, f"the table under {heading!r} in tests/README.md has no rows"
    return rows


def test_every_module_of_the_package_has_one_row():
    rows = table_rows(MODULES_HEADING)
    named = [module for modules, _ in rows for module in modules]
    missing = sorted(package_modules() - set(named))
    assert not missing, (
        f"modules of src/nbddp with no row in tests/README.md's index: {missing}; add a row for each under "
        f"{MODULES_HEADING!r}: | `<module>` | `test_….py`, … | (the test files that exercise it, the one "
        f"testing it most directly first; none yet where none does)")
    twice = sorted({module for module in named if named.count(module) > 1})
    assert not twice, f"modules with more than one row in tests/README.md's index: {twice}; keep one row each"


def test_every_module_the_index_names_exists():
    modules = package_modules()
    unknown = sorted({module for named, _ in table_rows(MODULES_HEADING) for module in named} - modules)
    assert not unknown, (
        f"tests/README.md's index names modules src/nbddp does not have (or an __init__.py with nothing in it): "
        f"{unknown}; remove their rows, or rename them to the module's path relative to src/nbddp")


def test_every_test_file_is_in_the_index():
    listed = {name for heading in (MODULES_HEADING, OTHERS_HEADING) for _, names in table_rows(heading)
              for name in names}
    missing = sorted(collected_test_files() - listed)
    assert not missing, (
        f"test files tests/README.md's index does not list: {missing}; add each to the row of every module it "
        f"tests under {MODULES_HEADING!r} (or, for a test of no module, a row under {OTHERS_HEADING!r})")


def test_every_test_file_the_index_names_exists():
    named = {name for heading in (MODULES_HEADING, OTHERS_HEADING) for _, names in table_rows(heading)
             for name in names if name.endswith(".py")}
    unknown = sorted(named - collected_test_files())
    assert not unknown, (
        f"tests/README.md's index names test files that are not in tests/: {unknown}; remove them from their rows, "
        f"or give the file's new name (relative to tests/)")
