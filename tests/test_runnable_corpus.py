"""Public notebooks made runnable offline train the same under ``nbddp run --nproc 2`` as in one process.

``tests/corpus/runnable/`` holds copies of public notebooks (``MANIFEST.json`` names each original in
``tests/corpus/public/``) with the few lines that need the Hub or a GPU replaced, each marked
``# nbddp-offline:`` (``make_runnable.py`` writes them). Each is run twice: as written, top to bottom in one
Python process (``run_cells.py``: the honest baseline), and on two gloo ranks through ``run_job``, the funnel of
``nbddp run`` and ``%%ddp_train``, from this process as from a kernel (``run_here``). A test-only recorder
(``tests/gpu/rank_record/sitecustomize.py``, the GPU proofs' too, on ``PYTHONPATH``) writes what each process
read, its losses, the hash of each optimizer's weights after its last step, and the files it wrote. The
two-rank run must see each training sample once per epoch in total, end with the same weights on both ranks,
write each of the notebook's files once (rank 0), and its loss must fall; where the manifest lists the sizes
of evaluation sets (``whole``), rank 0 reads each of them whole.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
RUNNABLE = ROOT / "tests" / "corpus" / "runnable"
RECORDER = ROOT / "tests" / "gpu" / "rank_record"
sys.path.insert(0, str(RUNNABLE))
import make_runnable  # noqa: E402
import tiny  # noqa: E402

MANIFEST = {e["file"].removesuffix(".ipynb"): e for e in json.loads((RUNNABLE / "MANIFEST.json").read_text())}
#: Runnable notebook → the bug its two-rank run shows, not fixed yet. Strict: a fix makes it pass, and its entry goes.
KNOWN: dict[str, str] = {}
#: Files a Trainer writes once per process by design (its RNG state in each checkpoint).
PER_PROCESS = ("rng_state",)


def test_the_copies_are_what_make_runnable_writes_and_every_edit_is_marked(tmp_path):
    written = make_runnable.write_all(tmp_path)
    assert sorted(p.name for p in written) == sorted(f"{n}.ipynb" for n in MANIFEST)
    assert len({e["style"] for e in MANIFEST.values()}) == len(MANIFEST)
    for path in written:
        assert path.read_bytes() == (RUNNABLE / path.name).read_bytes(), "run tests/corpus/runnable/make_runnable.py"
        entry = MANIFEST[path.stem]
        original = nbformat.read(ROOT / "tests" / "corpus" / "public" / entry["original"], as_version=4).cells
        copy = nbformat.read(path, as_version=4).cells
        assert len(copy) == len(original)
        for old, new in zip(original, copy):
            added = [ln for ln in difflib.ndiff(old.source.splitlines(), new.source.splitlines())
                     if ln.startswith("+ ")]
            assert all(make_runnable.MARK in ln for ln in added), added


# ------------------------------------------------------------------------------------------- the runs


def environment(record: Path, folder: Path, **more) -> dict:
    """The runs' environment: offline, recorded, and one thread of torch per process. torchrun gives each of
    its ranks one thread (``OMP_NUM_THREADS=1``) when it starts several; the one-process baseline gets the
    same, so a tiny model's steps do not spend most of their CPU making two threads meet (a wav2vec2 step took
    18 times the CPU with two threads on a loaded 2-core machine)."""
    env = dict(os.environ)
    env.update(NBDDP_TEST_RECORD=str(record), NBDDP_TEST_RECORD_ROOT=str(folder), HF_HUB_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", WANDB_MODE="disabled", TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(RECORDER), str(ROOT / "src"), env.get("PYTHONPATH", "")]))
    env.pop("RANK", None)
    env.update(more)
    return env


def run(argv, env, log: Path) -> None:
    with open(log, "w") as fh:
        done = subprocess.run(argv, env=env, stdout=fh, stderr=subprocess.STDOUT, timeout=500)
    assert done.returncode == 0, log.read_text()[-4000:]


def run_here(notebook: Path, env: dict, runs: Path, log: Path) -> None:
    """``nbddp run NOTEBOOK --nproc 2 --timeout 450`` through its funnel, ``run_job``, in this process as a kernel
    runs it: the ranks get ``env``'s settings (offline, recorded, one thread), and this process's later jobs fork
    their agents from its warm process (``launch/warm_start.py``) instead of starting a new interpreter each.
    Rank 0's output goes to ``log``."""
    from nbddp.display.view import QuietView
    from nbddp.job import run_job
    from nbddp.options import RunOptions

    with open(log, "w") as fh:
        class Logged(QuietView):
            def sink(self, stream: str, text: str) -> None:
                fh.write(text)

        rank_env = {k: v for k, v in env.items() if os.environ.get(k) != v}
        job = run_job(str(notebook), RunOptions(nproc=2, runs_dir=runs, timeout_s=450, env=rank_env), Logged())
    assert job.run.returncode == 0, log.read_text()[-4000:]


def records(folder: Path) -> dict[str, dict]:
    """Each label's (``single``, ``0``, ``1``) records, merged over its processes."""
    merged: dict[str, dict] = {}
    for path in sorted(folder.glob("*.json")):
        label = path.name.split("-")[0]
        data = json.loads(path.read_text())
        into = merged.setdefault(label, {"passes": [], "losses": [], "optimizers": [], "writes": []})
        for key in into:
            into[key] += data[key]
    return merged


def training_passes(rec: dict, size: int) -> list[list[int]]:
    return [p["indices"] for p in rec["passes"] if p["size"] == size and p["steps"]]


def loss_falls(rec: dict) -> list[tuple[float, float]]:
    """First and last quarter's mean loss of each optimizer that stepped."""
    out = []
    for k, opt in enumerate(rec["optimizers"]):
        values = [v for o, v in rec["losses"] if o == k]
        if opt["steps"] and values:
            q = max(1, len(values) // 4)
            out.append((sum(values[:q]) / q, sum(values[-q:]) / q))
    return out


#: ``checkpoint-12`` in one process is ``checkpoint-6`` on two ranks: the same checkpoint.
STEP = re.compile(r"checkpoint-\d+")
#: A file written atomically: ``dir/.name.x1y2z3ab`` first, then renamed to ``dir/name``.
ATOMIC = re.compile(r"(^|/)\.([^/]+)\.\w{8}$")


def files(rec: dict) -> set[str]:
    """The notebook's outputs, named alike in both runs; not the stand-ins' folder (``datasets`` caches its
    maps there)."""
    return {ATOMIC.sub(r"\1\2", STEP.sub("checkpoint-N", w)) for w in rec["writes"]
            if not w.startswith("tiny/") and not any(t in w for t in PER_PROCESS)}


@pytest.mark.e2e
@pytest.mark.timeout(900)  # two runs of a notebook, each importing transformers
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=KNOWN[n]))
                                  if n in KNOWN else n for n in sorted(MANIFEST)])
def test_runnable_notebook_trains_the_same_on_two_ranks(tmp_path, name):
    entry, size = MANIFEST[name], MANIFEST[name]["train_size"]
    assets = tiny.build(entry["tiny"], tmp_path / "assets")
    folders = {}
    for run_name in ("single", "ranks"):
        folders[run_name] = shutil.copytree(assets, tmp_path / run_name)
        shutil.copy(RUNNABLE / entry["file"], folders[run_name] / entry["file"])
    single, ranks = folders["single"], folders["ranks"]
    run([sys.executable, str(RUNNABLE / "run_cells.py"), str(single / entry["file"])],
        environment(tmp_path / "rec-single", single, NBDDP_TEST_RECORD_AS="single"), tmp_path / "single.log")
    run_here(ranks / entry["file"], environment(tmp_path / "rec-ranks", ranks), tmp_path / "runs", tmp_path / "ranks.log")
    one, two = records(tmp_path / "rec-single")["single"], records(tmp_path / "rec-ranks")
    r0, r1 = two["0"], two["1"]

    # one process: every training epoch reads the whole training set once (what the ranks must share)
    epochs = training_passes(one, size)
    assert epochs and all(sorted(p) == list(range(size)) for p in epochs), [len(p) for p in epochs]
    # two ranks: as many epochs, each sample read once per epoch by one rank or the other
    a, b = training_passes(r0, size), training_passes(r1, size)
    assert len(a) == len(b) == len(epochs)
    for x, y in zip(a, b):
        assert sorted(x + y) == list(range(size)), (sorted(x), sorted(y))
    # evaluation loaders stay whole: each pass rank 0 makes over a validation or test set reads all of it
    for whole in entry.get("whole", []):
        passes = [p["indices"] for p in r0["passes"] if p["size"] == whole and not p["steps"]]
        assert passes and all(sorted(p) == list(range(whole)) for p in passes), (whole, [len(p) for p in passes])
    # the replicas end in sync: each optimizer's weights hash the same on both ranks
    stepped = [(o["steps"], o["hash"]) for o in r0["optimizers"] if o["steps"]]
    assert stepped and stepped == [(o["steps"], o["hash"]) for o in r1["optimizers"] if o["steps"]]
    # the notebook's files are written once, by rank 0, and all of them
    assert not files(r1), files(r1)
    assert files(r0) == files(one)
    # the loss falls in each training, in one process and on the ranks
    for rec in (one, r0):
        falls = loss_falls(rec)
        assert falls and all(last < first for first, last in falls), falls
    print(f"\n{name}: 1 process {len(epochs)} epochs x {size} samples, steps "
          f"{[o['steps'] for o in one['optimizers'] if o['steps']]}, loss {fmt(loss_falls(one))}, files "
          f"{sorted(files(one))}; 2 ranks {len(a[0])}+{len(b[0])} samples per epoch, steps {[s for s, _ in stepped]}, "
          f"in sync, loss (rank 0) {fmt(loss_falls(r0))}, files by rank 0 {len(files(r0))}, by rank 1 0")


def fmt(falls):
    return ", ".join(f"{a:.3f}->{b:.3f}" for a, b in falls)
