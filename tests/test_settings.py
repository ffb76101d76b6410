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


def test_the_rank_record_has_a_typed_field_for_every_rank_setting():
    record = settings.read({"NBDDP_TIMEOUT": "60", "NBDDP_BALANCE": "off", "NBDDP_RESUME": "1",
                            "NBDDP_STRATEGY": " FSDP ", "NBDDP_SHIM_PRECISION": "0", "NBDDP_SEED": ""})
    assert (record.timeout, record.balance, record.resume, record.strategy) == (60, False, True, "fsdp")
    assert record.seed == "" and settings.read({}).seed is None  # given empty (off) is not unset (the default)
    assert settings.read({"NBDDP_TIMEOUT": "soon"}).timeout is None  # the reader's default, as env_int did
    assert record.switch("precision") is False and record.switch("unsloth") is None
    fields = {f for f in record.__dataclass_fields__}
    assert fields == {settings.field_name(s) for s in settings.TO_RANK if "<" not in s.name} | {"shims"}


def test_the_older_no_checkpointing_name_is_an_alias_of_its_shim_switch(monkeypatch):
    from nbddp.runtime import shims

    monkeypatch.setattr(settings, "_loaded", None)
    monkeypatch.setenv("NBDDP_DISABLE_CHECKPOINTING", "1")
    assert shims.switch("no_checkpointing") is True
    monkeypatch.setenv("NBDDP_SHIM_NO_CHECKPOINTING", "0")  # the shim's own switch wins
    assert shims.switch("no_checkpointing") is False


def test_every_install_of_setup_is_listed_once_with_one_switch():
    import importlib

    from nbddp.runtime import lifecycle

    for item in lifecycle.INSTALLS:
        assert callable(getattr(importlib.import_module(f"nbddp.runtime.{item.module}"), item.call))
        assert settings.known(item.switch)
    assert len({i.module for i in lifecycle.INSTALLS}) == len(lifecycle.INSTALLS)
    assert [i.phase for i in lifecycle.INSTALLS] == sorted((i.phase for i in lifecycle.INSTALLS),
                                                           key=["before torch", "after the group", "after the summary"].index)
