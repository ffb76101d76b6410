"""The ``NBDDP_*`` environment settings, spelled once: what the launcher (or the Kaggle export, or a person with
``--env``) tells a rank, and the few a launcher reads for itself that never reach a rank.

Each is a ``Setting``: its name, the kind of value, its default, who writes it and who reads it. ``TO_RANK``
are the ones a rank reads (through ``setup()`` and the modules it installs); ``LAUNCHER_SIDE`` are read by
the launcher's side alone (``NBDDP_RUNS``, ``NBDDP_CACHE``, ``NBDDP_GPU_MEMORY_GIB`` …). ``tests/test_settings.py``
holds every ``NBDDP_`` name in the package to this table, and ``docs/architecture.md`` shows it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Setting:
    """One ``NBDDP_*`` environment setting."""

    name: str
    kind: str  # "int", "flag" (1/0), "path", "text", "choice"
    default: str  # "" where unset means "not given"
    writer: str  # who sets it
    reader: str  # who reads it
    doc: str


TO_RANK: tuple[Setting, ...] = (
    Setting("NBDDP_STRATEGY", "choice", "ddp", "job.py (the decision), export/kaggle.py", "runtime/apply_strategy.py",
            "ddp, fsdp, split or deepspeed: how the rank applies the launcher's choice"),
    Setting("NBDDP_DEEPSPEED_STAGE", "choice", "3", "a person (--env)", "runtime/apply_strategy.py",
            "ZeRO stage under --strategy deepspeed: 2 or 3"),
    Setting("NBDDP_RUN_DIR", "path", "", "launch/planning.py", "runtime/rundir.py, runtime/probe.py",
            "the job's run directory, which the notebook may not delete"),
    Setting("NBDDP_METRICS", "path", "", "launch/planning.py", "runtime/metrics.py, runtime/rich.py",
            "rank 0's metrics.jsonl, streamed back by the launcher"),
    Setting("NBDDP_FAILURES", "path", "", "launch/planning.py", "agent/",
            "where the agent writes which ranks exited how (failures.json)"),
    Setting("NBDDP_LAUNCHER_PID", "int", "0", "launch/planning.py", "agent/",
            "the launcher's pid: the agent dies with it"),
    Setting("NBDDP_TIMEOUT", "int", "", "launch/planning.py, doctor.py", "runtime/lifecycle.py, runtime/probe.py",
            "seconds each collective may wait (the process group's timeout)"),
    Setting("NBDDP_RESUME", "flag", "", "launch/planning.py (--resume)", "runtime/resume.py",
            "resume the Trainer from the last complete checkpoint"),
    Setting("NBDDP_RICH_DISPLAY", "flag", "", "display/panel.py, template.py", "runtime/rich.py",
            "rank 0's display() sends MIME bundles to the metrics file for a kernel to show"),
    Setting("NBDDP_NPROC", "int", "", "export/kaggle.py (split), a person", "runtime/selflaunch.py",
            "processes a self-launching script starts"),
    Setting("NBDDP_TORCHRUN_ARGS", "text", "", "a person", "runtime/selflaunch.py",
            "extra torchrun arguments of a self-launching script"),
    Setting("NBDDP_LOG_DIR", "path", "", "a person", "runtime/selflaunch.py",
            "where a self-launching script's ranks write their logs"),
    Setting("NBDDP_SEED", "text", "", "a person (--env)", "runtime/dist.py",
            "the seed every rank starts from, or 'off'"),
    Setting("NBDDP_BALANCE", "flag", "1", "a person (--env)", "runtime/balance.py",
            "0: the Trainer's sampler is not token-balanced"),
    Setting("NBDDP_FIND_UNUSED_PARAMETERS", "flag", "", "a person (--env)", "runtime/dist.py",
            "0|1: whether nbddp's own DDP wrap looks for unused parameters"),
    Setting("NBDDP_ALLOW_DIVERGENCE", "flag", "", "options.py (--allow-divergence)", "runtime/divergence.py",
            "1: the safety net that stops diverging replicas is off"),
    Setting("NBDDP_DISABLE_CHECKPOINTING", "flag", "", "options.py (--no-checkpointing)",
            "runtime/shims/no_checkpointing.py", "1: gradient checkpointing off"),
    Setting("NBDDP_DDP_STATIC_GRAPH", "choice", "auto", "a person (--env)", "runtime/shims/grad_ckpt.py",
            "auto, 1 or 0: DDP's static_graph under gradient checkpointing"),
    Setting("NBDDP_ASSUME_CC", "text", "", "a person, tests", "runtime/shims/precision.py",
            "a GPU's compute capability to assume, like 7.5"),
    Setting("NBDDP_REPLACE_TORCH", "flag", "", "a person (--env)", "runtime/shell_lines.py, launch/planning.py",
            "1: install lines that would replace the running torch stack are run"),
    Setting("NBDDP_SHIM_<NAME>", "flag", "", "options.py (--shim/--no-shim)", "runtime/shims/__init__.py",
            "1 or 0: a shim on or off, whatever its detection says; also saves, notices, unused_params, launchers, streams (0: off)"),
    Setting("NBDDP_KEEP_SOCKET", "path", "", "kept/channel.py (%%ddp_train --keep)", "runtime/serve.py",
            "the kernel's Unix socket a kept job's ranks serve cells through"),
    Setting("NBDDP_KEEP_KEY", "text", "", "kept/channel.py", "runtime/serve.py",
            "the per-job key the socket's handshake proves"),
    Setting("NBDDP_KEEP_IDLE", "int", "", "kept/channel.py (--idle-limit)", "runtime/serve.py",
            "seconds a kept job waits for a message before its ranks end"),
    Setting("NBDDP_LAUNCHED_NPROC", "int", "", "launched.py (launched mode)",
            "launched.py (the stand-ins), runtime/lifecycle.py (the notebook's process leaves the agent store)",
            "processes the notebook's own launch command is fitted to"),
    Setting("NBDDP_LAUNCHED_DIR", "path", "", "launched.py", "launched.py (the stand-ins)",
            "where the launched command's ranks keep their logs (the run directory's launched/)"),
    Setting("NBDDP_LAUNCHED_INNER", "flag", "", "launched.py", "launched.py (the stand-ins)",
            "set inside a launched command, so its own shell lines are not launched again"),
    Setting("NBDDP_PYTHON", "path", "", "launched.py", "the stand-in launchers on PATH",
            "the Python the stand-ins run nbddp with"),
    Setting("NBDDP_WRITTEN", "text", "", "launched.py", "launched.py (the stand-ins)",
            "JSON: the scripts %%writefile cells wrote, by path, for mapping failures to cell and line"),
)

LAUNCHER_SIDE: tuple[Setting, ...] = (
    Setting("NBDDP_RUNS", "path", "", "a person", "job.py, launch/planning.py",
            "where run directories are made"),
    Setting("NBDDP_CACHE", "path", "", "a person", "demo.py", "where the demo keeps its tiny model"),
    Setting("NBDDP_GPU_MEMORY_GIB", "text", "", "a person", "choose_strategy.py",
            "each GPU's memory, capped, for the strategy's choice"),
    Setting("NBDDP_GPU_COUNT", "int", "", "a person, tests", "preflight.py",
            "the GPUs to count, instead of asking NVML"),
    Setting("NBDDP_FORK_RANKS", "flag", "1", "a person, tests", "agent/forked_ranks.py",
            "ranks forked from torchrun's process, which imported torch once (0: each starts fresh)"),
    Setting("NBDDP_WARM_START", "flag", "1", "a person, tests", "launch/warm_start.py",
            "agents forked from a warm process of a launcher that lives on, which imported torch once (0: each fresh)"),
)

#: Every setting by name (``NBDDP_SHIM_<NAME>`` stands for the whole family).
BY_NAME: dict[str, Setting] = {s.name: s for s in TO_RANK + LAUNCHER_SIDE}


def known(name: str) -> bool:
    """Whether ``name`` is one of the settings (``NBDDP_SHIM_X`` of the shim family)."""
    return name in BY_NAME or name.startswith("NBDDP_SHIM_")


# ---- the rank's record: TO_RANK read once ----------------------------------------------------------------

#: A flag's words: what reads as on, what reads as off; anything else (or unset) is the setting's default.
_ON = ("1", "true", "on", "yes")
_OFF = ("0", "false", "off", "no")


def field_name(setting: Setting) -> str:
    """``NBDDP_DEEPSPEED_STAGE`` -> ``deepspeed_stage``: the record's attribute for a setting."""
    return setting.name.removeprefix("NBDDP_").lower()


def parse(setting: Setting, raw: str | None):
    """One setting's value, typed by its kind: int -> int or None, flag -> True/False/None (not given),
    choice -> lower-case word (the default when empty), path and text -> the string as given (None unset)."""
    if setting.kind == "int":
        try:
            return int(raw) if raw not in (None, "") else (int(setting.default) if setting.default else None)
        except ValueError:
            return int(setting.default) if setting.default else None
    if setting.kind == "flag":
        word = (raw if raw is not None else setting.default).strip().lower()
        return True if word in _ON else False if word in _OFF else None
    if setting.kind == "choice":
        return (raw or "").strip().lower() or setting.default
    return raw if raw is not None else (setting.default or None)  # None: not given


def _record_type():
    from dataclasses import field, make_dataclass

    kinds = {"int": "int | None", "flag": "bool | None", "choice": str, "path": "str | None", "text": "str | None"}
    fields = [(field_name(s), kinds[s.kind]) for s in TO_RANK if "<" not in s.name]
    fields.append(("shims", "tuple[tuple[str, bool | None], ...]", field(default=())))
    return make_dataclass("RankSettings", fields, frozen=True, namespace={"switch": _switch,
                          "__doc__": "Every TO_RANK setting of this rank, typed by its kind, read once by setup()."})


def _switch(self, name: str) -> bool | None:
    """``NBDDP_SHIM_<NAME>``: True (forced on), False (forced off), None (not given)."""
    return dict(self.shims).get(name.upper())


RankSettings = _record_type()


def read(environ=None) -> RankSettings:
    """The rank's settings as the environment holds them now."""
    import os

    env = os.environ if environ is None else environ
    values = {field_name(s): parse(s, env.get(s.name)) for s in TO_RANK if "<" not in s.name}
    family = BY_NAME["NBDDP_SHIM_<NAME>"]
    shims = tuple(sorted((k.removeprefix("NBDDP_SHIM_"), parse(family, v)) for k, v in env.items()
                         if k.startswith("NBDDP_SHIM_")))
    return RankSettings(**values, shims=shims)


#: The record ``setup()`` read; None before it (or outside a rank, where each reader reads afresh).
_loaded: RankSettings | None = None


def load() -> RankSettings:
    """Read the rank's settings once, for the life of the rank (``lifecycle.setup()``)."""
    global _loaded
    _loaded = read()
    return _loaded


def current() -> RankSettings:
    """The record ``setup()`` read, or, before ``setup()`` (tests, the probe, a launcher helper), the
    environment read now."""
    return _loaded if _loaded is not None else read()
