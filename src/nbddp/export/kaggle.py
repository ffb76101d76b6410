"""Export a notebook as a Kaggle Script kernel that trains on every GPU of the kernel's machine.

``export_kaggle`` writes two files into a folder that ``kaggle kernels push -p FOLDER`` uploads:

- ``<slug>.py``, one self-launching script. Run plainly (Kaggle runs a Script kernel with ``python``) it
  runs the notebook's installs once and starts torchrun on itself with one process per GPU
  (``nbddp.runtime.selflaunch``); under torchrun it is the DDP script ``nbddp convert`` writes.
- ``kernel-metadata.json`` with the fields ``kernels push`` reads: id, title, code_file, language,
  kernel_type ``script``, is_private, enable_gpu, enable_internet, machine_shape and the data sources.

nbddp's runtime travels inside the script, zipped and base64-encoded, and is imported from the zip with
Python's own zipimport: the kernel then trains with internet off (as competitions require) and with the very
runtime version that wrote the script, whether or not nbddp is on PyPI or in Kaggle's image.

Before anything is written, every exported cell is checked for hard-coded credentials (``secrets.py``).
"""

from __future__ import annotations

import base64
import io
import json
import os
import pprint
import re
import shlex
import zipfile
from dataclasses import dataclass
from pathlib import Path

from .._version import __version__
from ..cells import read_notebook
from ..convert import convert_cells
from ..convert.launches import leading_launch
from ..errors import NbddpError
from ..runtime.io import atomic_write_text
from ..gpus import Machine
from ..job_plan import Job, plan_job
from ..options import RunOptions
from ..preflight import check_processes
from .secrets import check_secrets, find_leftovers

#: The file name ``kaggle kernels push`` looks for.
METADATA_FILE = "kernel-metadata.json"
#: Accelerators a Kaggle kernel can ask for with ``machine_shape`` ("none": CPU only). NvidiaTeslaT4 is the
#: two-T4 machine ("GPU T4 x2" in Kaggle's editor).
ACCELERATORS = ("NvidiaTeslaT4", "NvidiaTeslaP100", "none")
#: What of nbddp the script carries: the package rank code imports, and the embedded demo model.
EMBEDDED = ("runtime", "demo.py")

_PACKAGE_DIR = Path(__file__).resolve().parent.parent
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]*$")


@dataclass(frozen=True)
class KaggleExport:
    """What ``export_kaggle`` wrote, and what the user should know about it."""

    folder: Path
    script: Path
    metadata_file: Path
    metadata: dict
    warnings: tuple[str, ...] = ()

    def __str__(self) -> str:
        return (
            f"wrote {self.script} and {self.metadata_file}\n"
            f"push it with:  kaggle kernels push -p {shlex.quote(str(self.folder))}"
        )


def slugify(title: str) -> str:
    """Kaggle's slug of a title: lower case, every run of other characters one dash (as python-slugify)."""
    return re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")


def kernel_metadata(
    kernel_id: str,
    *,
    title: str | None = None,
    code_file: str,
    accelerator: str = "NvidiaTeslaT4",
    datasets: tuple[str, ...] | list[str] = (),
    private: bool = True,
    internet: bool = True,
) -> dict:
    """The ``kernel-metadata.json`` of a Script kernel, checked the way ``kaggle kernels push`` checks it.

    Without a title, one is made from the slug (``user/my-ddp-run`` → ``My Ddp Run``) so the two match.
    """
    owner, _, slug = kernel_id.partition("/")
    if not (_NAME.match(owner) and re.fullmatch(r"[a-z0-9][a-z0-9-]*", slug or "")):
        raise NbddpError(f"kernel id {kernel_id!r} is not USER/SLUG (the slug: lower-case letters, digits and dashes)")
    title = title or slug.replace("-", " ").title()
    if len(title) < 5:
        raise NbddpError(f"title {title!r} is too short: Kaggle wants at least five characters")
    if slugify(title) != slug:
        raise NbddpError(
            f"title {title!r} makes the slug {slugify(title)!r}, not {slug!r}: Kaggle would not find the kernel "
            f"again on the next push; choose a title that slugs to {slug!r} or leave --title out"
        )
    if accelerator not in ACCELERATORS:
        raise NbddpError(f"accelerator {accelerator!r} is not one of {', '.join(ACCELERATORS)}")
    for source in datasets:
        if not re.fullmatch(r"[^/\s]+/[^/\s]+", source):
            raise NbddpError(f"dataset {source!r} is not OWNER/DATASET-SLUG")
    gpu = accelerator != "none"
    meta = {
        "id": kernel_id,
        "title": title,
        "code_file": code_file,
        "language": "python",
        "kernel_type": "script",
        "is_private": private,
        "enable_gpu": gpu,
        "enable_tpu": False,
        "enable_internet": internet,
        "dataset_sources": list(datasets),
        "competition_sources": [],
        "kernel_sources": [],
        "model_sources": [],
    }
    if gpu:
        meta["machine_shape"] = accelerator
    return meta


def runtime_zip() -> bytes:
    """nbddp's runtime and demo as a zip importable with zipimport; the same bytes for the same sources."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        def add(name: str, text: str) -> None:
            zf.writestr(zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0)), text, zipfile.ZIP_DEFLATED)

        # Its own top module: the real __init__ may import notebook-side code that is not embedded.
        add("nbddp/__init__.py", f'"""nbddp {__version__}, runtime only (embedded by nbddp export)."""\n\n'
                                 f'__version__ = "{__version__}"\n')
        for entry in EMBEDDED:
            path = _PACKAGE_DIR / entry
            files = sorted(path.rglob("*.py")) if path.is_dir() else [path]
            for f in files:
                add(f"nbddp/{f.relative_to(_PACKAGE_DIR).as_posix()}", f.read_text(encoding="utf-8"))
    return buf.getvalue()


_LAUNCHER = '''\
# Exported by nbddp {version} from {origin} as a Kaggle Script kernel (push: kaggle kernels push -p FOLDER).
# Run plainly, as Kaggle runs a script, this file runs the notebook's installs once, then starts torchrun on
# itself with one process per GPU (two CPU processes without GPUs); under torchrun every process trains.
# nbddp's runtime travels inside this file (a zip imported with zipimport): no internet or nbddp install needed.
import base64
import hashlib
import os
import sys
import tempfile

#: nbddp {version}'s runtime package and demo model code: a zip, base64-encoded.
_NBDDP_ZIP = "{payload}"
#: The notebook's installs, run once before torchrun starts.
_NBDDP_INSTALLS = {installs}


def _nbddp_zip_path() -> str:
    """Write the zip once per machine (a temporary file renamed into place) and return its path."""
    data = base64.b64decode(_NBDDP_ZIP)
    path = os.path.join(tempfile.gettempdir(), "nbddp-" + hashlib.sha256(data).hexdigest()[:16] + ".zip")
    if not os.path.exists(path):
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".zip")
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    return path


sys.path.insert(0, _nbddp_zip_path())
from nbddp.runtime import selflaunch as _selflaunch  # noqa: E402

{strategy_lines}

_selflaunch.main(__file__, _NBDDP_INSTALLS)  # plain run: launch torchrun on this file, then exit

# ---- under torchrun: the training script ----------------------------------------------------------------
'''


#: A Kaggle kernel's CPU cores (its CPU machine and its GPU machines alike), for ``--nproc`` without GPUs.
KAGGLE_CPU_CORES = 4
#: Free bytes of each GPU of a Kaggle accelerator, for ``auto``'s choice at export time.
ACCELERATOR_GPUS = {"NvidiaTeslaT4": (int(14.5 * 2**30),) * 2, "NvidiaTeslaP100": (int(15.5 * 2**30),)}


def _env_lines(env: dict[str, str]) -> str:
    """The launcher's lines telling torchrun and the ranks what the export's options say (the strategy, split's
    one process, the run options' variables); a variable set in the kernel's environment wins."""
    return "\n".join(f"os.environ.setdefault({json.dumps(k)}, {json.dumps(v)})" for k, v in env.items())


def kernel_env(plan, nproc: int | None) -> dict[str, str]:
    """What the exported kernel's launcher sets, from the job's plan (``job_plan.JobPlan``) and its options: the
    ranks' variables (the strategy, ``--env``, the shims' switches, ``RunOptions.job_env``), and for
    ``runtime/selflaunch.py`` the processes (``NBDDP_NPROC``: split's one, or ``--nproc``; otherwise one per GPU
    of the machine it runs on) and torchrun's options (``NBDDP_TORCHRUN_ARGS``)."""
    env = {**plan.env, **plan.options.job_env}
    if plan.strategy == "split" or nproc:
        env["NBDDP_NPROC"] = str(plan.processes if plan.strategy == "split" else nproc)
    if plan.options.torchrun_argv:
        env["NBDDP_TORCHRUN_ARGS"] = shlex.join(plan.options.torchrun_argv)
    return env


def _refuse_launched(plan) -> None:
    """The exported script runs every cell on every rank, with no stand-in launchers (``nbddp.launched``): a
    notebook whose training is a command it launches (the plan's ``launched`` mode) is refused; one with no
    training call was refused by the plan, as ``nbddp run`` refuses it (unless ``--every-rank``)."""
    from ..job_plan import LAUNCHED

    if plan.mode == LAUNCHED:
        script = plan.script
        raise NbddpError(
            f"{script.source_map.origin}: the notebook starts its training from a shell line ({leading_launch(script.launches)}); "
            "an exported Kaggle script runs every cell on every GPU, so that command would start once per GPU. "
            "Run it with `nbddp run` or `%%ddp_train` (its cells once, the command on every GPU), or put the "
            "training in the notebook's cells to export it"
        )


def export_kaggle(
    notebook: str | os.PathLike,
    folder: str | os.PathLike,
    *,
    kernel_id: str,
    title: str | None = None,
    accelerator: str = "NvidiaTeslaT4",
    datasets: tuple[str, ...] | list[str] = (),
    private: bool = True,
    allow_secrets: bool = False,
    nproc: int | None = None,
    **run,
) -> KaggleExport:
    """Write ``folder/<slug>.py`` (self-launching) and ``folder/kernel-metadata.json`` for a notebook.

    Raises ``SecretError`` (cell and line) for a credential written in a cell unless ``allow_secrets``,
    ``NbddpError`` for metadata Kaggle would refuse, and the conversion's own errors. ``run``: the run options
    (``RunOptions``' keywords: ``strategy``, ``every_rank``, ``skip_bad_cells``, ``env``, ``shim`` …), checked
    as ``nbddp run`` checks them; ``nproc`` is checked against the accelerator's GPUs, not this machine's. The
    job is planned as ``nbddp run`` plans it (``job_plan.plan_job``) on the accelerator's machine
    (``ACCELERATOR_GPUS``): its mode, its strategy (``auto`` decided for those GPUs), before anything is
    written; the plan's variables go into the launcher (``kernel_env``).
    """
    notebook, folder = Path(notebook), Path(folder)
    slug = kernel_id.partition("/")[2]
    meta = kernel_metadata(kernel_id, title=title, code_file=f"{slug}.py", accelerator=accelerator,
                           datasets=datasets, private=private)
    cells = read_notebook(notebook)
    if not allow_secrets:
        check_secrets(cells)
    options = RunOptions(**run)
    free = ACCELERATOR_GPUS.get(accelerator, ())
    check_processes(nproc, gpus=len(free), cores=KAGGLE_CPU_CORES)
    script = convert_cells(cells, origin=notebook.name, skip_bad_cells=options.skip_bad_cells)
    job = Job(script, notebook.resolve().parent, notebook.stem)
    plan = plan_job(job, options, machine=Machine(len(free), free, here=False))  # on the accelerator's GPUs
    _refuse_launched(plan)
    decision = plan.decision
    launcher = _LAUNCHER.format(
        strategy_lines=_env_lines(kernel_env(plan, nproc)),
        version=__version__,
        origin=notebook.name,
        payload=base64.b64encode(runtime_zip()).decode("ascii"),
        installs=pprint.pformat([i.argv() for i in script.installs], width=100),
    )
    script_path = atomic_write_text(folder / meta["code_file"], launcher + script.text, mode=0o644)
    meta_path = atomic_write_text(folder / METADATA_FILE, json.dumps(meta, indent=2) + "\n", mode=0o644)
    said = options.strategy != "auto" or decision.strategy != "ddp"  # plain DDP, chosen, is what exports always did
    notes = tuple(line.removeprefix("nbddp: ") for line in decision.summary().splitlines()) if said else ()
    return KaggleExport(folder, script_path, meta_path, meta, (*find_leftovers(notebook), *script.warnings, *notes))
