"""GPU proof: a public Unsloth Kaggle notebook, pointed at a local model and data, trains on N GPUs both ways a
user starts it: ``nbddp run --nproc N`` from a terminal, and ``%%ddp_train --nproc N`` in an IPython shell.

The notebook is unslothai/notebooks' ``nb/Kaggle-Llama3.1_(8B)-Alpaca.ipynb``, read from
``tests/corpus/public/unsloth_nb.tar.xz`` (commit in its ``MANIFEST.json``) and copied with these edits, each
edited line ending with ``# nbddp-proof: <why>``:

- ``model_name``: the local model folder (no Hub here); the notebook's ``load_in_4bit = True`` is kept (QLoRA);
- ``load_dataset("unsloth/alpaca-cleaned", …)``: ``load_dataset("json", data_files=<local rows>, …)``;
- ``max_steps = 60``: ``--steps``;
- the ``%%ddp_train`` way only: the cell that saves the adapter (``model.save_pretrained("llama_lora")``)
  starts with ``%%ddp_train --nproc N …``, so the job is every cell above it and that cell, the notebook
  file telling the magic its cells (``__session__``, as Jupyter's kernel sets it).

Model: the Qwen2.5-0.5B shape with random weights and a byte-level BPE tokenizer of Qwen2's class
(``benchmarks/varlen_workload.py``'s ``prepare_checkpoint``, the folder Unsloth loads in the variable-length
benchmark), written once to ``$NBDDP_CACHE/unsloth-proof-model``. Data: ``--rows`` Alpaca-format rows
(``instruction``, ``input``, ``output``) of the tokenizer's one-token words, the formatted row lengths (in
its tokens) drawn from Alpaca's measured percentiles (``benchmarks/results/alpaca_lengths.json``), 37.7 % with
an input as measured there; each output repeats its instruction, so there is something to learn. Before any
run, the folder's tokenizer, loaded as the notebook loads it, must read the rows at the lengths they were
written for (a tokenizer that read every row as the bare EOS once gave loss 0 with nothing to say so).

A recorder on ``PYTHONPATH`` (``tests/gpu/rank_record/sitecustomize.py``) writes what each rank read, its
micro-batch losses and the files it wrote. Each way passes when: the exit status is 0 (the magic: the cell
ran and ``_ddp.ok``); rank 0 reports ``nbddp: N process(es), backend nccl``; the loss starts as a random-weight
model's does (above ``RANDOM_START``) and falls (the mean of the last quarter of rank 0's micro-batch losses
below the first quarter's); ``llama_lora/adapter_model.safetensors``
is there and was written once, by one rank; and the ranks' training samples are disjoint, each rank's count
within one micro-batch of 1/N of them (its share of samples and of tokens is reported). Prints PASS/FAIL per
way, writes a markdown result to ``--out``; exit status 0 only when every way asked for passed, 2 (SKIP in
``run_all.sh``) when Unsloth is not installed or fewer GPUs than ``--nproc`` are seen.

    python tests/gpu/prove_unsloth.py --nproc 2 [--steps 30] [--rows 2000] [--ways run,magic] [--out FILE.md]

On the device machine (carry ``.gpu``; one GPU to smoke it with ``--nproc 1``, two for the proof):

    tar -xJf .gpu/site.tar.xz -C /tmp && export PYTHONPATH=$PWD/src:/tmp/site312 HF_HUB_OFFLINE=1 &&
    python3 tests/gpu/prove_unsloth.py --nproc 2 --out $OUT/unsloth.md
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import alpaca_lengths  # noqa: E402
import varlen_workload  # noqa: E402

ARCHIVE = ROOT / "tests" / "corpus" / "public" / "unsloth_nb.tar.xz"
NOTEBOOK = "nb/Kaggle-Llama3.1_(8B)-Alpaca.ipynb"
RECORDER = Path(__file__).resolve().parent / "rank_record"
MARK = "# nbddp-proof:"
ADAPTER = "llama_lora/adapter_model.safetensors"
SHARE_WITH_INPUT = 0.377  # benchmarks/results/alpaca_lengths.json
#: Below this, rank 0's first micro-batch losses did not come from a random-weight model reading its rows: a
#: token's loss starts at about ln(151 936) = 11.9, and the Trainer divides each micro-batch's loss by about
#: the notebook's 4 accumulation steps (seen on one H100: 2.9 recorded while the Trainer logged 12.1).
RANDOM_START = 1.5


def public_notebook():
    """The notebook as published (outputs dropped, as the corpus keeps it)."""
    import nbformat

    with tarfile.open(ARCHIVE) as tar:
        return nbformat.reads(tar.extractfile(NOTEBOOK).read().decode(), as_version=4)


def edit(source: str, old: str, new: str, why: str) -> str:
    """Replace the one line holding ``old`` by ``new`` (its indentation kept), marked with why."""
    lines = source.splitlines()
    hits = [i for i, line in enumerate(lines) if old in line]
    if len(hits) != 1:
        raise ValueError(f"expected one line with {old!r}, found {len(hits)}")
    line = lines[hits[0]]
    indent = line[: len(line) - len(line.lstrip())]
    lines[hits[0]] = f"{indent}{new}  {MARK} {why}"
    return "\n".join(lines)


def notebook_copy(path: Path, model: Path, data: Path, steps: int, magic: str | None = None) -> Path:
    """The public notebook pointed at the local model and data; with ``magic`` (the ``%%ddp_train`` options)
    the adapter-saving cell starts with ``%%ddp_train``."""
    import nbformat

    nb = public_notebook()
    code = [c for c in nb.cells if c.cell_type == "code"]

    def cell_with(text: str):
        return next(c for c in code if text in c.source)

    load = cell_with('model_name = "unsloth/Llama-3.1-8B"')
    load.source = edit(load.source, 'model_name = "unsloth/Llama-3.1-8B"', f'model_name = "{model}",',
                       "a local model folder (random weights), no Hub")
    data_cell = cell_with('load_dataset("unsloth/alpaca-cleaned"')
    data_cell.source = edit(data_cell.source, 'load_dataset("unsloth/alpaca-cleaned"',
                            f'dataset = load_dataset("json", data_files = "{data}", split = "train")',
                            "local Alpaca-format rows, no Hub")
    trainer = cell_with("max_steps = 60")
    trainer.source = edit(trainer.source, "max_steps = 60", f"max_steps = {steps},", "fewer steps for the proof")
    for cell in code:
        if ".generate(" in cell.source:
            # nbddp-proof: Unsloth's generate() fails in prefill on this random-weight model (position_ids of 0
            # elements); the proof is of training, and rank 0 runs these cells after it
            cell.metadata.setdefault("tags", []).append("nbddp-skip")
    if magic is not None:
        save = cell_with('model.save_pretrained("llama_lora")')
        save.source = f"%%ddp_train {magic}\n{save.source}"
    nbformat.write(nb, str(path))
    return path


def row_text(record: dict, eos: str) -> str:
    """A row as the notebook's ``formatting_prompts_func`` makes it."""
    return alpaca_lengths.formatted(record) + eos


def write_rows(path: Path, rows: int, tokenizer, seed: int = 0) -> list[int]:
    """Alpaca-format rows of ``varlen_workload.words`` (one token each) whose formatted lengths in
    ``tokenizer``'s tokens follow Alpaca's measured percentiles; returns each row's length as it tokenizes."""
    rng = random.Random(seed)
    table = varlen_workload.token_percentiles()
    vocabulary = varlen_workload.words(varlen_workload.WORDS)
    fixed = len(tokenizer(row_text({"instruction": "", "input": "", "output": ""}, tokenizer.eos_token))["input_ids"])
    records = []
    for _ in range(rows):
        words = max(3, round(varlen_workload.draw_length(table, rng.random())) - fixed)
        pick = lambda n: rng.choices(vocabulary, k=n)  # noqa: E731
        n_instruction = max(1, words // 5)
        n_input = words // 4 if rng.random() < SHARE_WITH_INPUT else 0
        instruction, given = pick(n_instruction), pick(n_input)
        n_output = max(1, words - n_instruction - n_input)
        output = [instruction[i % n_instruction] for i in range(n_output)]
        records.append({"instruction": " ".join(instruction), "input": " ".join(given), "output": " ".join(output)})
    path.write_text(json.dumps(records))
    texts = [row_text(r, tokenizer.eos_token) for r in records]
    return [len(ids) for ids in tokenizer(texts)["input_ids"]]


def rows_reach_the_model(model: Path, data: Path, lengths: list[int]) -> str | None:
    """Why the notebook's rows would not reach the model as tokens (None: they do): the folder's tokenizer,
    loaded as the notebook's loader loads it (``AutoTokenizer``), must give every row the length it was
    written for, each word one token."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model))
    records = json.loads(data.read_text())[:50]
    got = [len(tokenizer(row_text(r, tokenizer.eos_token))["input_ids"]) for r in records]
    if got != lengths[: len(got)]:
        return (f"{type(tokenizer).__name__} from {model} reads the rows as {got[:5]}… tokens, written as "
                f"{lengths[:5]}…: the model would not see the rows")
    return None


def environment(record: Path, work: Path) -> dict:
    path = os.pathsep.join(p for p in (str(RECORDER), str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "NBDDP_PROOF_RECORD": str(record), "NBDDP_PROOF_ROOT": str(work),
            "PYTHONUNBUFFERED": "1"}


def by_cli(work: Path, notebook: Path, nproc: int, timeout: int) -> tuple[int, str]:
    argv = [sys.executable, "-m", "nbddp.cli", "run", notebook.name, "--nproc", str(nproc), "--skip-installs",
            "--runs-dir", str(work / "runs")]
    proc = subprocess.run(argv, cwd=work, env=environment(work / "record", work), capture_output=True, text=True,
                          timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr


#: The ``%%ddp_train`` way: an IPython shell in the notebook's folder, told its notebook as Jupyter's kernel
#: is (``__session__``), runs the magic cell; exit 0 when the cell ran and the job's result says ok.
SHELL = """
import sys, nbformat
from IPython.core.interactiveshell import InteractiveShell
path = sys.argv[1]
cell = next(c for c in nbformat.read(path, 4).cells if c.source.startswith("%%ddp_train"))
shell = InteractiveShell.instance()
shell.user_ns["__session__"] = path
shell.run_cell("%load_ext nbddp", store_history=True)
result = shell.run_cell(cell.source, store_history=True)
ddp = shell.user_ns.get("_ddp")
print("MAGIC", {"success": result.success, "ok": getattr(ddp, "ok", None)}, flush=True)
sys.exit(0 if result.success and ddp is not None and ddp.ok else 1)
"""


def by_magic(work: Path, notebook: Path, timeout: int) -> tuple[int, str]:
    proc = subprocess.run([sys.executable, "-c", SHELL, str(notebook)], cwd=work,
                          env=environment(work / "record", work), capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr


def run_logs(runs: Path) -> str:
    """Every text file the job's run directories hold (each rank's log among them): what rank 0 said,
    whichever way its output was shown."""
    texts = []
    for path in sorted(runs.rglob("*")):
        if path.is_file() and path.stat().st_size < 8 * 2**20:
            texts.append(path.read_text(errors="replace"))
    return "\n".join(texts)


def rank_records(folder: Path) -> dict[int, dict]:
    """Every rank's record, the files of one rank (its processes) merged."""
    merged: dict[int, dict] = {}
    for path in sorted(folder.glob("rank*.json")):
        rank = int(re.match(r"rank(\d+)-", path.name).group(1))
        into = merged.setdefault(rank, {"passes": [], "losses": [], "writes": [], "devices": []})
        for key, value in json.loads(path.read_text()).items():
            into[key] += value
    return merged


#: nbddp's saves write a hidden temporary file beside the target and rename it: ``dir/.name.XXXXXXXX``.
ATOMIC = re.compile(r"(^|/)\.([^/]+)\.\w{8}$")


def wrote_adapter(rec: dict) -> bool:
    return any(ATOMIC.sub(r"\1\2", w) == ADAPTER for w in rec["writes"])


def training_indices(rec: dict, rows: int) -> list[int]:
    return [i for p in rec["passes"] if p["size"] == rows for i in p["indices"]]


def verdict(code: int, text: str, records: dict[int, dict], nproc: int, rows: int, lengths: list[int],
            adapter_there: bool, micro_batch: int = 2, backend: str = "nccl",
            first_loss_above: float = 0.0) -> tuple[list[str], dict]:
    """What went wrong in one way's run (empty: it passed), and the figures for the report. A random-weight
    model's first losses are near ln(vocabulary): ``first_loss_above`` catches rows that never reach it."""
    wrong = [f"exit status {code}"] if code else []
    if f"nbddp: {nproc} process(es), backend {backend}" not in text:
        wrong.append(f"rank 0 did not report {nproc} process(es) on {backend}")
    if sorted(records) != list(range(nproc)):
        wrong.append(f"records of ranks {sorted(records)}, expected 0..{nproc - 1}")
    losses = records.get(0, {}).get("losses", [])
    quarter = max(1, len(losses) // 4)
    first, last = (statistics.fmean(losses[:quarter]), statistics.fmean(losses[-quarter:])) if losses else (0, 0)
    if len(losses) < 4 or not last < first:
        wrong.append(f"loss did not fall: {len(losses)} micro-batch losses, first quarter {first:.3f}, "
                     f"last quarter {last:.3f}")
    if losses and first <= first_loss_above:
        wrong.append(f"loss starts at {first:.3f}, not above {first_loss_above:.1f}: the rows did not reach the "
                     "random-weight model as tokens")
    writers = [r for r, rec in sorted(records.items()) if wrote_adapter(rec)]
    if not adapter_there or len(writers) != 1:
        wrong.append(f"{ADAPTER} there: {adapter_there}; written by rank(s) {writers or 'none'}")
    seen = {r: training_indices(rec, rows) for r, rec in records.items()}
    counts = {r: len(v) for r, v in seen.items()}
    everyone = [i for v in seen.values() for i in v]
    if len(set(everyone)) != len(everyone):
        wrong.append("a sample was read by more than one rank (or twice by one)")
    if counts and (min(counts.values()) == 0 or max(counts.values()) - min(counts.values()) > micro_batch):
        wrong.append(f"samples per rank not even: {counts}")
    total, tokens = sum(counts.values()) or 1, {r: sum(lengths[i] for i in v) for r, v in seen.items()}
    figures = {"losses": len(losses), "loss_first_quarter": round(first, 4), "loss_last_quarter": round(last, 4),
               "samples": counts, "sample_share": {r: round(c / total, 4) for r, c in counts.items()},
               "token_share": {r: round(t / (sum(tokens.values()) or 1), 4) for r, t in tokens.items()},
               "adapter_writers": writers}
    return wrong, figures


def report(results: list[dict], nproc: int, steps: int, rows: int, device: str) -> str:
    lines = [f"# Unsloth's Kaggle Llama 3.1 Alpaca notebook on {nproc} GPU(s), through nbddp", "",
             f"`python tests/gpu/prove_unsloth.py --nproc {nproc} --steps {steps} --rows {rows}` on {device}. "
             "The public notebook (unslothai/notebooks `nb/Kaggle-Llama3.1_(8B)-Alpaca.ipynb`) with its model, "
             "data and step count pointed at a local random-weight Qwen2.5-0.5B shape (4-bit, as the notebook "
             "loads it) and local Alpaca-length rows; every edit marked `# nbddp-proof:`.", "",
             "| way | outcome | micro-batch loss, first → last quarter (rank 0) | samples per rank | sample share | "
             "token share | adapter written by |", "|---|---|---|---|---|---|---|"]
    for r in results:
        f = r["figures"]
        outcome = "PASS" if not r["wrong"] else "FAIL: " + "; ".join(r["wrong"])
        lines.append(f"| {r['way']} | {outcome} | {f['loss_first_quarter']} → {f['loss_last_quarter']} "
                     f"({f['losses']} losses) | {f['samples']} | {f['sample_share']} | {f['token_share']} | "
                     f"{f['adapter_writers']} |")
    return "\n".join(lines) + "\n"


def missing_requirements(nproc: int) -> str | None:
    """Why this machine cannot run the proof (None: it can)."""
    if importlib.util.find_spec("unsloth") is None:
        return "Unsloth is not installed (on the device machine: tar -xJf .gpu/site.tar.xz -C /tmp)"
    import torch

    if torch.cuda.device_count() < nproc:
        return f"--nproc {nproc} needs {nproc} GPU(s); torch sees {torch.cuda.device_count()}"
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=2, help="processes, one per GPU (1 to smoke it on one GPU)")
    ap.add_argument("--steps", type=int, default=30, help="the notebook's max_steps")
    ap.add_argument("--rows", type=int, default=2000, help="local Alpaca-format rows")
    ap.add_argument("--ways", default="run,magic", help="comma-separated: run (nbddp run), magic (%%%%ddp_train)")
    ap.add_argument("--timeout", type=int, default=1500, help="seconds for each way")
    ap.add_argument("--out", type=Path, help="write the markdown result here")
    ap.add_argument("--work", type=Path, help="folder for the runs (default: a new temporary one)")
    args = ap.parse_args()
    if skipped := missing_requirements(args.nproc):
        print(f"SKIP: {skipped}")
        return 2
    cache = Path(os.environ.get("NBDDP_CACHE") or Path.home() / ".cache" / "nbddp")
    model = Path(varlen_workload.prepare_checkpoint(str(cache / "unsloth-proof-model")))
    work = args.work or Path(tempfile.mkdtemp(prefix="nbddp-unsloth-"))
    work.mkdir(parents=True, exist_ok=True)
    data = work / "alpaca_rows.json"
    lengths = write_rows(data, args.rows, varlen_workload.tokenizer(varlen_workload.QWEN2_05B["vocab_size"]))
    if unreadable := rows_reach_the_model(model, data, lengths):
        print(f"FAIL before any run: {unreadable}")
        return 1
    results = []
    for way in args.ways.split(","):
        folder = work / way
        shutil.rmtree(folder, ignore_errors=True)  # a reused --work holds an earlier run's records
        folder.mkdir()
        if way == "run":
            notebook = notebook_copy(folder / "unsloth_alpaca.ipynb", model, data, args.steps)
            code, text = by_cli(folder, notebook, args.nproc, args.timeout)
        elif way == "magic":
            magic = f"--nproc {args.nproc} --skip-installs --runs-dir {folder / 'runs'}"
            notebook = notebook_copy(folder / "unsloth_alpaca.ipynb", model, data, args.steps, magic=magic)
            code, text = by_magic(folder, notebook, args.timeout)
        else:
            raise SystemExit(f"unknown way {way!r} (run, magic)")
        (folder / "output.log").write_text(text)
        print(text[-3000:])
        logs = text + "\n" + run_logs(folder / "runs")
        wrong, figures = verdict(code, logs, rank_records(folder / "record"), args.nproc, args.rows, lengths,
                                 (folder / ADAPTER).exists(), first_loss_above=RANDOM_START)
        print(f"{'PASS' if not wrong else 'FAIL'} {way} on {args.nproc} GPU(s): {json.dumps(figures)}"
              + "".join(f"\n  {w}" for w in wrong), flush=True)
        results.append({"way": "nbddp run" if way == "run" else "%%ddp_train in an IPython shell",
                        "wrong": wrong, "figures": figures})
    text = report(results, args.nproc, args.steps, args.rows, varlen_workload.gpu_name())
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    print(f"logs in {work}")
    return 0 if all(not r["wrong"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
