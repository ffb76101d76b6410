"""GPU proof: Kaggle's own ways of using two GPUs train on both GPUs under nbddp, as the notebook did in one process.

Two notebooks, both the public aicloud MNIST notebook of ``tests/corpus/`` (its runnable copy, with the data read
from ``tiny/``), with its device lines as published:

  data_parallel   ``device = torch.device(f'cuda:0')`` and ``if torch.cuda.device_count() > 1:
                  clf = nn.DataParallel(clf)``: the notebook as published, the common Kaggle two-T4 idiom;
  fstring_device  ``gpu = 0`` / ``device = torch.device(f"cuda:{gpu}")`` and no DataParallel: the device in an
                  f-string of a variable (a one-GPU Kaggle kernel; this copy's cell 14 is ``pass``).

Each is run three ways: as written in one process (``run_cells.py``, the kernel's baseline: DataParallel over
every GPU), ``nbddp run NB --nproc 2``, and in a real kernel (nbclient) the cells run as a user runs them with
the last, which trains, under ``%%ddp_train --nproc 2``. The test recorder
(``tests/gpu/rank_record``) writes what each process read, its losses and the card (UUID) each loss was on.
A run passes when its two ranks used two different cards, shared each epoch's 400 samples (each once), ended
with the same weights, wrote the notebook's files once (rank 0) and its loss fell; the losses are printed beside
the one process's. Where the notebook calls DataParallel, its loader's batch is the kernel's step, shared out
over the ranks: they take as many steps as the one process (checked) and the loss follows its curve; without
DataParallel each rank takes the notebook's batch, half the steps (checked). Exit 0 when every run passed; 2 (SKIP) with
fewer than 2 GPUs. ``--cpu`` runs the harness on two gloo processes with the copy's CPU lines (no card to tell).

    python tests/gpu/prove_kaggle_idioms.py [--cpu] [--only data_parallel|fstring_device] [--ways run,kernel]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import nbformat

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_runnable_corpus import files  # noqa: E402  (the notebook's outputs, atomic writes under their names)

ROOT = Path(__file__).resolve().parents[2]
RUNNABLE = ROOT / "tests" / "corpus" / "runnable"
RECORDER = ROOT / "tests" / "gpu" / "rank_record"
NOTEBOOK = "data_parallel_mnist_tensorboard.ipynb"
SIZE, EPOCHS = 400, 3
#: name → the device cell (11) and the DataParallel cell (14) as each GPU notebook has them
GPU_CELLS = {
    "data_parallel": ("clf = CNNClassifier()\ndevice = torch.device(f'cuda:0')",
                      'if torch.cuda.device_count() > 1:\n    print("Let\'s use", torch.cuda.device_count(), "GPUs!")\n'
                      "    clf = nn.DataParallel(clf)"),
    "fstring_device": ('clf = CNNClassifier()\ngpu = 0\ndevice = torch.device(f"cuda:{gpu}")', "pass"),
}


def notebook(name: str, folder: Path, cpu: bool) -> Path:
    """The runnable copy with ``name``'s device cells (kept as the copy has them with ``--cpu``), in ``folder``
    beside the tiny data."""
    sys.path.insert(0, str(RUNNABLE))
    import tiny

    tiny.build(["mnist_npz", "offline_tensorboard", "offline_mlflow"], folder)
    nb = nbformat.read(RUNNABLE / NOTEBOOK, as_version=4)
    if not cpu:
        nb.cells[11].source, nb.cells[14].source = GPU_CELLS[name]
    path = folder / f"{name}.ipynb"
    nbformat.write(nb, path)
    return path


def environment(record: Path, folder: Path, **more) -> dict:
    env = dict(os.environ, NBDDP_TEST_RECORD=str(record), NBDDP_TEST_RECORD_ROOT=str(folder), MPLBACKEND="agg",
               PYTHONPATH=os.pathsep.join(p for p in (str(RECORDER), str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p))
    env.update(more)
    return env


def records(folder: Path) -> dict[str, dict]:
    """Each label's record (``single``, ``0``, ``1``)."""
    return {p.name.split("-")[0]: json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))}


def by_process(path: Path, record: Path) -> str:
    done = subprocess.run([sys.executable, str(RUNNABLE / "run_cells.py"), str(path)], capture_output=True, text=True,
                          env=environment(record, path.parent, NBDDP_TEST_RECORD_AS="single"), timeout=300)
    return "" if done.returncode == 0 else f"one process failed: {(done.stdout + done.stderr)[-1500:]}"


def by_cli(path: Path, record: Path) -> str:
    done = subprocess.run([sys.executable, "-m", "nbddp.cli", "run", path.name, "--nproc", "2", "--skip-installs",
                           "--runs-dir", "../runs"], cwd=path.parent, capture_output=True, text=True,
                          env=environment(record, path.parent), timeout=300)
    print((done.stdout + done.stderr)[-1200:])
    return "" if done.returncode == 0 else f"nbddp run exit code {done.returncode}"


def by_kernel(path: Path, record: Path) -> str:
    """The notebook's cells run in a real kernel as a user runs them (those the copy skips left out), the last,
    which trains, under ``%%ddp_train``: nbddp trains what the kernel ran."""
    import nbclient

    code = [c.source for c in nbformat.read(path, as_version=4).cells
            if c.cell_type == "code" and "nbddp-skip" not in c.metadata.get("tags", [])]
    cells = ["%load_ext nbddp", *code[:-1], "%%ddp_train --nproc 2 --skip-installs --runs-dir ../runs\n" + code[-1],
             "print('ok:', _ddp.ok)"]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    saved = dict(os.environ)
    os.environ.update(environment(record, path.parent))  # the kernel, and so its ranks, start with these settings
    try:
        nbclient.NotebookClient(nb, timeout=300, kernel_name="python3", allow_errors=True,
                                resources={"metadata": {"path": str(path.parent)}}).execute()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    text = "".join(o.get("text", "") for c in nb.cells for o in c.outputs)
    errors = [f"{o.ename}: {o.evalue}" for c in nb.cells for o in c.outputs if o.output_type == "error"]
    print(text[-1200:], *errors, sep="\n")
    return "; ".join(errors) or ("" if "ok: True" in text else "_ddp.ok is not True")


def epoch_losses(rec: dict) -> list[float]:
    """The mean training loss of each epoch (the steps split evenly over the epochs)."""
    values = [v for _, v in rec["losses"]]
    n = max(1, len(values) // EPOCHS)
    return [round(sum(values[i:i + n]) / len(values[i:i + n]), 4) for i in range(0, n * EPOCHS, n)]


def judge(one: dict, two: dict[str, dict], cpu: bool, data_parallel: bool) -> list[str]:
    """What the two ranks' records must show against the one process's (``data_parallel``: the notebook calls
    DataParallel, so a step is the kernel's whole batch shared out and the ranks take as many steps as it)."""
    problems = []
    r0, r1 = two.get("0"), two.get("1")
    if not (r0 and r1):
        return [f"records of ranks 0 and 1 (found {sorted(two)})"]
    train = [[p["indices"] for p in r["passes"] if p["size"] == SIZE and p["steps"]] for r in (r0, r1)]
    if not (len(train[0]) == len(train[1]) == EPOCHS):
        problems.append(f"{EPOCHS} training epochs on each rank (found {len(train[0])}, {len(train[1])})")
    problems += [f"epoch {e}: the ranks read {len(a)}+{len(b)}, not each of {SIZE} once"
                 for e, (a, b) in enumerate(zip(*train)) if sorted(a + b) != list(range(SIZE))]
    stepped = [[(o["steps"], o["hash"]) for o in r["optimizers"] if o["steps"]] for r in (r0, r1)]
    if not stepped[0] or stepped[0] != stepped[1]:
        problems.append(f"the same weights on both ranks (steps and hashes {stepped})")
    kernel_steps = [o["steps"] for o in one["optimizers"] if o["steps"]]
    want = kernel_steps if data_parallel else [k // 2 for k in kernel_steps]
    if [s for s, _ in stepped[0]] != want:
        problems.append(f"{want} steps on each rank, the kernel's {kernel_steps} "
                        f"{'(its batch shared out)' if data_parallel else 'over two ranks (a batch each)'}")
    cards = [r["devices"] for r in (r0, r1)]
    if not cpu and not (all(len(c) == 1 and c[0].startswith("cuda") for c in cards) and cards[0] != cards[1]):
        problems.append(f"each rank on its own GPU (devices {cards})")
    written = [sorted(files(r)) for r in (one, r0, r1)]
    if written[2] or written[1] != written[0]:
        problems.append(f"the files once, by rank 0 (one process {written[0]}, rank 0 {written[1]}, rank 1 {written[2]})")
    losses = epoch_losses(r0)
    if not losses[-1] < losses[0]:
        problems.append(f"a falling loss (rank 0 per epoch {losses})")
    print(f"  one process: devices {one['devices']}, steps {[o['steps'] for o in one['optimizers']]}, "
          f"loss per epoch {epoch_losses(one)}")
    print(f"  two ranks:   devices {cards}, samples per epoch {[len(a) for a in train[0]]}+{[len(b) for b in train[1]]}, "
          f"steps {[s for s, _ in stepped[0]]}, loss per epoch (rank 0) {losses}, in sync {stepped[0] == stepped[1]}")
    return problems


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="no GPUs: two gloo processes, the copy's CPU lines")
    ap.add_argument("--only", action="append", choices=sorted(GPU_CELLS))
    ap.add_argument("--ways", default="run,kernel")
    args = ap.parse_args()
    import torch

    if not args.cpu and torch.cuda.device_count() < 2:
        print("SKIP: fewer than 2 GPUs")
        return 2
    if args.cpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    results: dict[str, list[str]] = {}
    for name in args.only or sorted(GPU_CELLS):
        with tempfile.TemporaryDirectory(prefix=f"nbddp-{name}-") as tmp:
            work = Path(tmp)
            single = notebook(name, work / "single", args.cpu)
            failed = by_process(single, work / "rec-single")
            if failed:
                results[f"{name}: one process"] = [failed]
                continue
            one = records(work / "rec-single")["single"]
            for way, start in (("run", by_cli), ("kernel", by_kernel)):
                if way not in args.ways:
                    continue
                print(f"== {name} via {way}")
                path = notebook(name, work / way, args.cpu)
                failed = start(path, work / f"rec-{way}")
                check = f"{name} via {'nbddp run' if way == 'run' else '%ddp_train in a kernel'}"
                data_parallel = args.cpu or name == "data_parallel"  # the CPU copy calls DataParallel in both
                results[check] = [failed] if failed else judge(one, records(work / f"rec-{way}"), args.cpu, data_parallel)
    for check, problems in results.items():
        print(f"{'PASS' if not problems else 'FAIL'} {check}" + (f": {problems}" if problems else ""))
    return 0 if all(not p for p in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
