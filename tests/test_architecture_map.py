"""The map at the top of ``docs/architecture.md`` matches the code: every module and folder of the package is in
a row of its rooms table, and every ``NBDDP_`` setting of ``runtime/settings.py`` is in its settings table."""

import re
from pathlib import Path

import nbddp
from nbddp.runtime import settings

SRC = Path(nbddp.__file__).resolve().parent
DOC = (SRC.parents[1] / "docs" / "architecture.md").read_text()


def section(heading: str) -> str:
    """The text under a ``### heading`` of the map, up to the next heading."""
    start = DOC.index(f"### {heading}")
    end = re.compile(r"^#{2,3} ", re.M).search(DOC, start + 4)
    return DOC[start:end.start() if end else len(DOC)]


def rows(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("|---")]


def test_every_module_and_folder_of_the_package_is_in_the_rooms_table():
    table = "\n".join(rows(section("The rooms")))
    named = set(re.findall(r"`([\w./]+)`", table))
    parts = sorted(p.name + ("/" if p.is_dir() else "") for p in SRC.iterdir()
                   if (p.suffix == ".py" or (p.is_dir() and (p / "__init__.py").exists())))
    assert len(parts) > 20
    assert [p for p in parts if p not in named] == []


def test_every_setting_is_in_the_settings_table():
    table = "\n".join(rows(section("The launcher↔rank settings")))
    named = set(re.findall(r"`(NBDDP_[A-Z0-9_<>]+)`", table))
    names = [s.name for s in settings.TO_RANK + settings.LAUNCHER_SIDE]
    assert len(names) > 30
    assert [n for n in names if n not in named] == []
