"""Public notebooks whose training is a command they launch run as their kernel would under ``nbddp run``.

``tests/corpus/runnable/launched/`` holds copies of such notebooks (``MANIFEST.json`` names each original in
``tests/corpus/public/``), made runnable offline as the runnable corpus is (``make_launched.py``: the lines
that need the Hub or a GPU replaced, each marked ``# nbddp-offline:``; the scripts and recipes their shell
lines run, from the same commit, edited the same way by ``tiny_launched.py``). Each is run as written in one
Python process (``run_cells.py``: the baseline, its command run once by the shell) and by ``nbddp run --nproc
2`` with a small ``NBDDP_TIMEOUT``; the test recorder (``tests/gpu/rank_record/sitecustomize.py``) says what
each process read, stepped and wrote. In launched mode (``nbddp.launched``) the notebook's cells run once, in
one process, and its command on every rank: the launched training's two ranks each see ``WORLD_SIZE`` 2,
exactly once, and share the data the one process trained on; the command runs longer than ``NBDDP_TIMEOUT``
and no barrier tears it down; the prep and post cells run once and every file is written once, less those the
launched script itself writes from every rank (``every_rank_writes`` in the manifest; none for run_sft.py, whose
tokenizer save after training inside ``train_function`` the converter leaves to rank 0).

Before launched mode (``--every-rank``, still there for training nbddp does not see), every cell ran on
both ranks: rank 0 ran the command while rank 1 waited in a barrier, torn down at ``NBDDP_TIMEOUT``.
"""

from __future__ import annotations

import difflib
import json
import os
import shutil
import sys
import time
from pathlib import Path

import nbformat
import pytest

from conftest import DEFAULT_PORT_GROUP
from test_runnable_corpus import ATOMIC, PER_PROCESS, ROOT, RUNNABLE, STEP, environment, run

sys.path.insert(0, str(RUNNABLE))
import make_launched  # noqa: E402
import make_runnable  # noqa: E402
import tiny  # noqa: E402
import tiny_launched  # noqa: E402

LAUNCHED = RUNNABLE / "launched"
PUBLIC = ROOT / "tests" / "corpus" / "public"
MANIFEST = {e["file"].removesuffix(".ipynb"): e for e in json.loads((LAUNCHED / "MANIFEST.json").read_text())}
#: Seconds a collective may wait, in the two-rank runs: the launched command runs longer than that.
TIMEOUT_S = 15


def test_the_copies_are_what_make_launched_writes_and_every_edit_is_marked(tmp_path):
    written = make_launched.write_all(tmp_path)
    assert sorted(p.name for p in written) == sorted(f"{n}.ipynb" for n in MANIFEST)
    assert (tmp_path / "MANIFEST.json").read_bytes() == (LAUNCHED / "MANIFEST.json").read_bytes()
    for path in written:
        assert path.read_bytes() == (LAUNCHED / path.name).read_bytes(), "run tests/corpus/runnable/make_launched.py"
        original = nbformat.read(PUBLIC / MANIFEST[path.stem]["original"], as_version=4)
        copy = nbformat.read(path, as_version=4)
        assert len(copy.cells) == len(original.cells)
        for old, new in zip(original.cells, copy.cells):
            assert marked_only(old.source, new.source)


def test_the_scripts_and_recipes_the_shell_lines_run_are_the_published_ones_with_marked_edits(tmp_path):
    for builder in ("run_sft", "merge_adapter_weights"):
        tiny.BUILDERS[builder](tmp_path / "tiny" / builder)
    for written, published in tiny_launched.PUBLISHED.items():
        new, old = (tmp_path / written).read_text(), (PUBLIC / published).read_text()
        assert marked_only(old, new) and len(new.splitlines()) == len(old.splitlines()), written
    assert (tmp_path / "scripts/merge_adapter_weights.py").read_text() == (PUBLIC / "philschmid/merge_adapter_weights.py").read_text()


def marked_only(old: str, new: str) -> bool:
    """Every line ``new`` has that ``old`` lacks carries the ``# nbddp-offline:`` mark."""
    added = [ln for ln in difflib.ndiff(old.splitlines(), new.splitlines()) if ln.startswith("+ ")]
    return all(make_runnable.MARK in ln for ln in added)


# ------------------------------------------------------------------------------------------- the runs


def processes(folder: Path) -> list[dict]:
    """Each recorded process: its label (``single``, ``0``, ``1``, ``launched``) and record."""
    out = []
    for path in sorted(folder.glob("*.json")):
        data = json.loads(path.read_text())
        data["label"] = path.name.split("-")[0]
        out.append(data)
    return out


def trainers(procs: list[dict]) -> list[dict]:
    return [p for p in procs if any(o["steps"] for o in p["optimizers"])]


def outputs(proc: dict) -> set[str]:
    """The files a process wrote under the notebook's folder, named alike in both runs (as
    ``test_runnable_corpus.files``): not the stand-ins' folder, not what a Trainer writes per process."""
    return {ATOMIC.sub(r"\1\2", STEP.sub("checkpoint-N", w)) for w in proc["writes"]
            if not w.startswith("tiny/") and not any(t in w for t in PER_PROCESS)}


def writers(procs: list[dict], prefix: str) -> list[dict]:
    return [p for p in procs if any(w.startswith(prefix) for w in outputs(p))]


def prepared(tmp_path: Path, entry: dict, *runs: str) -> dict[str, Path]:
    assets = tiny.build(entry["tiny"], tmp_path / "assets")
    folders = {}
    for name in runs:
        folders[name] = shutil.copytree(assets, tmp_path / name)
        shutil.copy(LAUNCHED / entry["file"], folders[name] / entry["file"])
    return folders


def launched_environment(record: Path, folder: Path, **more) -> dict:
    """``test_runnable_corpus.environment``, with this interpreter's folder first on PATH: the notebook's
    ``!python`` runs the Python a kernel of this environment would run."""
    env = environment(record, folder, **more)
    return env | {"PATH": os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])}


def nbddp_run(tmp_path: Path, folder: Path, entry: dict, label: str, *more: str,
              timeout: int = TIMEOUT_S) -> tuple[int, str, float]:
    import subprocess

    env = launched_environment(tmp_path / f"rec-{label}", folder, NBDDP_TIMEOUT=str(timeout))
    log = tmp_path / f"{label}.log"
    started = time.monotonic()
    with open(log, "w") as fh:
        done = subprocess.run([sys.executable, "-m", "nbddp.cli", "run", str(folder / entry["file"]), "--nproc", "2",
                               "--runs-dir", str(tmp_path / f"runs-{label}"), "--timeout", "450", *more],
                              env=env, stdout=fh, stderr=subprocess.STDOUT, timeout=500)
    return done.returncode, log.read_text(), time.monotonic() - started


def launched_by(procs: list[dict], command: str) -> list[dict]:
    """The training processes running ``command``'s script: as written, or as nbddp converted it (``python
    train.py`` of a training script runs ``converted-train.py`` on every rank)."""
    converted = "converted-" + Path(command).name
    return sorted((p for p in trainers(procs) if p["argv"] and (p["argv"][0].endswith(command)
                                                                   or Path(p["argv"][0]).name == converted)),
                  key=lambda p: p["label"])


def trained_on(proc: dict, size: int) -> list[int]:
    return [i for q in proc["passes"] if q["steps"] and q["size"] == size for i in q["indices"]]


def weights(proc: dict) -> list:
    return [(o["steps"], o["hash"]) for o in proc["optimizers"] if o["steps"]]


def _default_port(name: str) -> list:
    """A notebook that binds torchrun's default port 29500 itself (a script's fixed ``MASTER_PORT``, or a
    plain ``!torchrun`` in the one-process run) shares a worker with the other tests of that port: run at the
    same time, one would find it taken (``DEFAULT_PORT_GROUP``)."""
    text = (LAUNCHED / f"{name}.ipynb").read_text()
    return [pytest.mark.xdist_group(DEFAULT_PORT_GROUP)] if "29500" in text or MANIFEST[name].get("kernel_nproc") else []


@pytest.mark.e2e
@pytest.mark.timeout(900)  # one process, then two ranks launched from one, each importing transformers and TRL
@pytest.mark.parametrize("name", [pytest.param(n, marks=_default_port(n)) for n in sorted(MANIFEST)])
def test_launched_notebook_runs_once_and_its_command_on_every_rank(tmp_path, name):
    entry = MANIFEST[name]
    timeout = entry.get("timeout", TIMEOUT_S)
    kernel_nproc = entry.get("kernel_nproc", 1)  # the processes the command starts in a kernel, as written
    commands = entry["command"] if isinstance(entry["command"], list) else [entry["command"]]
    folders = prepared(tmp_path, entry, "single", "ranks")
    run([sys.executable, str(RUNNABLE / "run_cells.py"), str(folders["single"] / entry["file"])],
        launched_environment(tmp_path / "rec-single", folders["single"], NBDDP_TEST_RECORD_AS="single"),
        tmp_path / "single.log")
    code, out, _ = nbddp_run(tmp_path, folders["ranks"], entry, "ranks", timeout=timeout)
    assert code == 0, out[-4000:]
    one, two = processes(tmp_path / "rec-single"), processes(tmp_path / "rec-ranks")
    assert len(trainers(two)) == 2 * len(commands) and len(trainers(one)) == kernel_nproc * len(commands)
    for command in commands:
        check_command(entry, command, kernel_nproc, timeout, out, one, two)
    # the prep cells ran once: their files written by one process, the notebook's, which saw no other rank
    for prep in entry["prep"]:
        (writer,) = writers(two, prep)
        assert (writer["label"], writer["world"], writer["inner"]) == ("0", "1", False)
        assert len(writers(one, prep)) == 1
    if "post" in entry:  # the post cell's command ran once, and wrote what it wrote in one process
        (post,) = writers(two, entry["post"])
        (post_one,) = writers(one, entry["post"])
        assert post["label"] == "launched" and outputs(post) == outputs(post_one) and outputs(post)


def check_command(entry: dict, command: str, kernel_nproc: int, timeout: int, out: str, one: list, two: list) -> None:
    # as written, in a kernel: the command trained ``kernel_nproc`` processes, between them on the whole data set
    alone = launched_by(one, command)
    assert len(alone) == kernel_nproc, [p["argv"] for p in trainers(one)]
    sizes = {p["size"] for a in alone for p in a["passes"] if p["steps"]}
    assert len(sizes) == 1, sizes
    (size,) = sizes
    assert sorted(set(i for a in alone for i in trained_on(a, size))) == list(range(size))
    # two ranks: the launched training's ranks 0 and 1 each saw WORLD_SIZE 2, exactly once
    ranks = launched_by(two, command)
    assert [(p["label"], p["world"], p["inner"]) for p in ranks] == [("0", "2", True), ("1", "2", True)]
    assert not [p for p in two if p["world"] == "2" and p not in trainers(two)]
    # ... and shared the data the one process trained on: each rank read a share of equal length, between them
    # every sample (the Trainer's sharding tops the last batches up from the start, so a few may come twice);
    # where the kernel ran two processes too, each rank read its kernel twin's share and ended with its weights
    a, b = (trained_on(p, size) for p in ranks)
    assert len(a) == len(b) < size and set(a + b) == set(range(size)), (sorted(a), sorted(b))
    assert weights(ranks[0]) and weights(ranks[0]) == weights(ranks[1])
    if kernel_nproc == 2:  # (the kernel's processes are recorded by pid, not rank)
        assert sorted(trained_on(p, size) for p in alone) == sorted([a, b])
        assert [weights(p) for p in alone] == [weights(ranks[0])] * 2
    # the command ran longer than NBDDP_TIMEOUT, from the notebook's one process, and no barrier tore it down
    (stand_in,) = [p for p in two if p["argv"][0].endswith("nbddp/launched.py") and command in p["argv"]]
    took = stand_in["ended"] - stand_in["began"]
    assert (stand_in["label"], stand_in["world"]) == ("0", "1") and took > timeout, took
    assert "Timed out" not in out
    # what the launched ranks wrote, each as its twin in the kernel wrote it; where the kernel ran one process,
    # the trained model written once, by the launched rank 0, and rank 1 writes only what the script itself
    # writes from every rank (the manifest says where)
    by_rank = {p["label"]: outputs(p) for p in ranks}
    if kernel_nproc == 2:
        assert sorted(map(sorted, by_rank.values())) == sorted(sorted(outputs(p)) for p in alone)
    else:
        assert by_rank["0"] == outputs(alone[0]), by_rank["0"] ^ outputs(alone[0])
        assert by_rank["0"] and all(f.startswith(entry["trained"] + "/") for f in by_rank["0"]), by_rank["0"]
        assert all(Path(f).name in entry["every_rank_writes"] for f in by_rank["1"]), by_rank["1"]
    print(f"\n{command}: kernel {kernel_nproc} process(es) on {size} samples; launched ranks {len(a)}+{len(b)} "
          f"samples, WORLD_SIZE {[p['world'] for p in ranks]}, in sync; command {took:.0f}s > NBDDP_TIMEOUT "
          f"{timeout}s; rank 1 wrote {sorted(by_rank['1'])}")


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_every_cell_on_every_rank_is_what_launched_mode_replaced(tmp_path):
    """``--every-rank`` runs the old way: the prep cell on both ranks, the command once, on rank 0, while
    rank 1 waits in a barrier until ``NBDDP_TIMEOUT`` tears the job down. One notebook shows it."""
    from nbddp.cells import read_notebook
    from nbddp.convert.launches import find_launches

    entry = MANIFEST[sorted(MANIFEST)[0]]
    folders = prepared(tmp_path, entry, "every")
    code, out, took = nbddp_run(tmp_path, folders["every"], entry, "every", "--every-rank")
    two = processes(tmp_path / "rec-every")
    (launch,) = [ln for ln in find_launches(read_notebook(LAUNCHED / entry["file"])) if entry["command"] in ln.text]
    assert code != 0, out[-4000:]
    assert f"rank 1 failed in cell {launch.cell}, line {launch.line}" in out, out[-4000:]
    assert f"Timed out waiting {TIMEOUT_S * 1000}ms" in out, out[-4000:]
    # rank 1 ran the prep cell too, writing the file rank 0 writes (rank 0, stopped, left no record)
    assert "1" in [p["label"] for p in writers(two, entry["prep"][0])]
    # and no launched rank ever started
    assert not [p for p in two if p["inner"]] and not trainers(two)
    print(f"\n{entry['file']} --every-rank: failed after {took:.0f}s, rank 1 in cell {launch.cell}'s barrier")
