"""The NBDDP_* settings are spelled once (``runtime/settings.py``): every name the package uses is in the
table, and the table names nothing the package does not use."""

import re
from pathlib import Path

import nbddp
from nbddp.runtime import settings

SRC = Path(nbddp.__file__).resolve().parent
NAME = re.compile(r"(?<![\w])NBDDP_[A-Z0-9_]*[A-Z0-9]_?")


def used_names() -> set[str]:
    found = set()
    for path in SRC.rglob("*.py"):
        if path.name != "settings.py":
            found |= set(NAME.findall(path.read_text()))
    return found


def test_every_nbddp_setting_the_package_uses_is_in_the_table():
    unknown = sorted(n for n in used_names() if not settings.known(n.rstrip("_") if n.endswith("_") else n)
                     and not n.startswith("NBDDP_SHIM_"))
    assert unknown == []


def test_the_table_names_only_settings_the_package_uses_and_each_once():
    used = used_names()
    names = [s.name for s in settings.TO_RANK + settings.LAUNCHER_SIDE]
    assert len(names) == len(set(names))
    assert sorted(n for n in names if "<" not in n and n not in used) == []
    assert {"NBDDP_RUNS", "NBDDP_CACHE", "NBDDP_GPU_MEMORY_GIB"} <= {s.name for s in settings.LAUNCHER_SIDE}
