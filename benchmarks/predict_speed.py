"""Prediction speed: time to the written submission.csv, ``nbddp run --nproc 2`` against the notebook in one process.

    python benchmarks/predict_speed.py [--repeats 3] [--only generation|classifier]   # 2 GPUs (defaults sized for H200s)
    python benchmarks/predict_speed.py --smoke                                         # CPU, 2 gloo ranks: the harness
    python benchmarks/predict_speed.py --report [--smoke]      # rebuild .json/.md from the runs file, running nothing

On the device machine, whose Python has torch and transformers but not nbddp's own dependencies, add
``--wheels .gpu/wheels`` (``benchmarks/results/README.md`` says how that folder is made and carried).

Two notebooks that predict and train nowhere are written into a temporary folder, nothing downloaded:

- ``generation``: a GPT-2 shape with random weights (``AutoModelForCausalLM.from_config(GPT2Config(…))``) answers
  ``--prompts`` prompts one at a time with greedy ``generate(max_new_tokens=…, do_sample=False)`` in a loop,
  then writes the answers' token ids to ``submission.csv``;
- ``classifier``: a small CNN labels ``--rows`` random-but-seeded images (image i is the same in every process)
  from a test ``DataLoader``, then writes each row's label and score to ``submission.csv``.

For each notebook and each of ``--repeats`` passes, side by side and alternating which goes first: the notebook
in one process (its code cells joined, run by ``python`` — the same interpreter start as nbddp's launcher, and
no kernel, which would only add its own start to the baseline) and ``nbddp run NB --nproc 2``, each in a fresh
folder. Timed from the process's start to ``submission.csv``'s last write (its mtime), and to the process's exit;
the two ``submission.csv`` files must be byte-equal. Every run is appended to
``results/predict_speed_<tag>_runs.jsonl`` as it ends (a call cut short keeps what it measured; several calls
with the same sizes add up); ``predict_speed_<tag>.json`` and ``.md`` hold the ratios per notebook (one-process
seconds ÷ nbddp seconds: median and spread over the pairs), the machine (GPU names from ``nvidia-smi``, or
"CPU"), and the load average before and after each call.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
# nbddp's CLI beside this Python (a venv), else its module (the GPU image runs nbddp from src on PYTHONPATH)
_CLI = Path(sys.executable).with_name("nbddp")
NBDDP = [str(_CLI)] if _CLI.exists() else [sys.executable, "-m", "nbddp.cli"]
BASELINE = ("one process: `python` of the notebook's code cells joined (the same interpreter start as nbddp's "
            "launcher; no kernel, whose start would only slow the baseline)")
TARGET = {"generation": 1.8}  # the target on 2 GPUs

#: Sizes per mode: GPU and CPU smoke. On one H200 (predict_speed_gpu1_*: 64 and 8 prompts) a prompt of 64 new tokens
#: took 0.45 s, and the processes' starts 15 s (one process) and 20 s (nbddp): 512 prompts make the one process
#: about 254 s against nbddp's 20 + 512 × 0.45 / 2 ≈ 135 s on two GPUs (1.88×); fewer than ~350 cannot reach 1.8×.
SIZES = {
    "gpu": {"prompts": 512, "new_tokens": 64, "n_layer": 12, "n_embd": 768, "n_head": 12,
            "rows": 200000, "image_size": 160, "channels": 64, "batch": 64, "workers": 4},
    "smoke": {"prompts": 24, "new_tokens": 8, "n_layer": 2, "n_embd": 64, "n_head": 4,
              "rows": 512, "image_size": 32, "channels": 8, "batch": 32, "workers": 0},
}

GENERATION = ['''\
# Generation-heavy prediction: a GPT-2 shape with random weights (no download) answers {prompts} prompts greedily,
# one prompt at a time, and writes submission.csv. It trains nothing.
import pandas as pd
import torch
from transformers import AutoModelForCausalLM, GPT2Config

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
config = GPT2Config(n_layer={n_layer}, n_embd={n_embd}, n_head={n_head})
model = AutoModelForCausalLM.from_config(config).to(device).eval()
# prompts of 8 to 39 tokens, the same in every process (token ids stand for a tokenizer's text)
prompts = [[(7 * i + 13 * j) % config.vocab_size for j in range(8 + i % 32)] for i in range({prompts})]''', '''\
answers = []
with torch.no_grad():
    for ids in prompts:
        input_ids = torch.tensor([ids], device=device)
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens={new_tokens},
                             do_sample=False, pad_token_id=config.eos_token_id)
        answers.append(" ".join(map(str, out[0, len(ids):].tolist())))''', '''\
pd.DataFrame({{"id": range(len(answers)), "answer": answers}}).to_csv("submission.csv", index=False)
print(f"{{len(answers)}} answers written")''']

CLASSIFIER = ['''\
# Classifier prediction: a small CNN with seeded random weights labels {rows} images of a test DataLoader and
# writes submission.csv. The images are random but seeded per row, as if read from a test folder. It trains nothing.
import pandas as pd
import torch
from torch.utils.data import DataLoader, Dataset

device = "cuda" if torch.cuda.is_available() else "cpu"


class TestImages(Dataset):
    def __init__(self, n, size):
        self.n, self.size = n, size

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        image = torch.rand(3, self.size, self.size, generator=torch.Generator().manual_seed(i))
        return image, i


torch.manual_seed(0)
c = {channels}
model = torch.nn.Sequential(
    torch.nn.Conv2d(3, c, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
    torch.nn.Conv2d(c, 2 * c, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
    torch.nn.Conv2d(2 * c, 4 * c, 3, padding=1), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
    torch.nn.Flatten(), torch.nn.Linear(4 * c, 10)).to(device).eval()
test_loader = DataLoader(TestImages({rows}, {image_size}), batch_size={batch}, num_workers={workers})''', '''\
ids, labels, scores = [], [], []
with torch.no_grad():
    for images, idx in test_loader:
        probs = model(images.to(device)).softmax(-1)
        ids.extend(idx.tolist())
        labels.extend(probs.argmax(-1).tolist())
        scores.extend(probs.max(-1).values.tolist())''', '''\
pd.DataFrame({{"id": ids, "label": labels, "score": [f"{{s:.4f}}" for s in scores]}}).to_csv("submission.csv", index=False)
print(f"{{len(labels)}} rows labelled")''']

NOTEBOOKS = {"generation": GENERATION, "classifier": CLASSIFIER}
#: What a person splitting the rows by hand adds after the first cell, in each of the processes they start (one per
#: GPU, ``CUDA_VISIBLE_DEVICES`` set to it): the control for what two processes on one host can do at all.
BY_HAND = {"generation": "prompts = prompts[{first}:{end}]"}
SIZE_KEYS = {"generation": ("prompts", "new_tokens", "n_layer", "n_embd", "n_head"),
             "classifier": ("rows", "image_size", "channels", "batch", "workers")}


def use_wheels(folder: Path) -> None:
    """Unpack the wheels of ``folder`` whose distribution this Python lacks into a site folder, on the path of this
    process and of every one it starts (after nbddp's src). A wheel is a zip file: none of these needs a build, and
    the device machine reaches no registry."""
    site = Path(tempfile.gettempdir()) / "predict-speed-site"
    for wheel in sorted(folder.glob("*.whl")):
        try:
            importlib.metadata.distribution(wheel.name.split("-")[0])
        except importlib.metadata.PackageNotFoundError:
            with zipfile.ZipFile(wheel) as unpacked:
                unpacked.extractall(site)
    sys.path.insert(0, str(site))
    src, _, rest = ENV["PYTHONPATH"].partition(os.pathsep)
    ENV["PYTHONPATH"] = os.pathsep.join([src, str(site), rest])


def write_notebook(folder: Path, name: str, sizes: dict) -> Path:
    import nbformat

    cells = [nbformat.v4.new_code_cell(textwrap.dedent(c).format(**sizes)) for c in NOTEBOOKS[name]]
    path = folder / f"{name}.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=cells), str(path))
    return path


def one_process_script(notebook: Path, block: str | None = None) -> str:
    """The notebook's code cells joined (with ``block``, the line a person splitting by hand adds after the first),
    the timeline marked where the rows begin and end (after the first cell, after the second)."""
    import nbformat

    cells = [c.source for c in nbformat.read(str(notebook), as_version=4).cells if c.cell_type == "code"]
    marked = [cells[0], *([block] if block else []), _MARK.format("rows start"), cells[1], _MARK.format("rows end"),
              *cells[2:]]
    return "\n\n".join(marked) + "\n"


#: The benchmark's timeline (``benchmarks/timeline``): every process of a run marks its start, its exit, and (a
#: rank) its ``setup()``, (the launcher) its launch; the one-process scripts mark their rows.
TIMELINE = ROOT / "benchmarks" / "timeline"
_MARK = "import sitecustomize as _bench\n_bench.mark({!r})"


def timeline_env(folder: Path, env: dict) -> dict:
    return {**env, "PYTHONPATH": os.pathsep.join([str(TIMELINE), env.get("PYTHONPATH", "")]),
            "NBDDP_BENCH_TIMELINE": str(folder / "timeline.jsonl")}


def timeline(folders: list[Path], started: float) -> dict:
    """Seconds from ``started`` to each process's marks, by role (``launcher``, ``agent``, ``rank0``…, ``other``;
    a role two processes share, the by-hand ones, numbered by their start): ``created`` and ``site`` (the
    interpreter started; Python reached ``site``), ``setup start``/``end``, ``launch start``, ``rows start``/``end``
    (the one-process scripts), ``exit``."""
    records = [json.loads(line) for folder in folders if (folder / "timeline.jsonl").exists()
               for line in (folder / "timeline.jsonl").read_text().splitlines()]
    pids: dict[str, list[int]] = {}
    for r in sorted(records, key=lambda r: r["t"]):
        if r["pid"] not in pids.setdefault(r["role"], []):
            pids[r["role"]].append(r["pid"])
    out: dict[str, dict] = {}
    for r in records:
        same = pids[r["role"]]
        role = r["role"] if len(same) == 1 else f"{r['role']}{same.index(r['pid'])}"
        t = r.get("t_created") if r["what"] == "created" else r["t"]
        if t is not None:
            out.setdefault(role, {}).setdefault(r["what"], round(t - started, 2))
    return out


def timed(side: str, notebook: Path, work: Path, nproc: int, timeout: int) -> dict:
    """One run in a fresh folder: seconds to submission.csv's last write and to the process's exit; its bytes."""
    folder = Path(tempfile.mkdtemp(prefix=f"{side}-", dir=work))
    if side == "nbddp":
        shutil.copy(notebook, folder / notebook.name)
        argv = [*NBDDP, "run", notebook.name, "--nproc", str(nproc), "--runs-dir", str(folder / "runs")]
    else:
        (folder / "notebook.py").write_text(one_process_script(notebook))
        argv = [sys.executable, "notebook.py"]
    started = time.time()
    done = subprocess.run(argv, cwd=folder, env=timeline_env(folder, ENV), capture_output=True, text=True,
                          timeout=timeout)
    ended = time.time()
    submission = folder / "submission.csv"
    if done.returncode or not submission.exists():
        raise SystemExit(f"{side} {notebook.name} failed (exit {done.returncode}):\n{(done.stdout + done.stderr)[-4000:]}")
    return {"to_submission_s": round(submission.stat().st_mtime - started, 3), "wall_s": round(ended - started, 3),
            "bytes": submission.read_bytes(), "tail": done.stdout.strip().splitlines()[-1:],
            "timeline": timeline([folder], started),
            "ranks": rank_times(folder / "runs", started, submission.stat().st_mtime) if side == "nbddp" else []}


def by_hand(notebook: Path, work: Path, nproc: int, timeout: int, total: int) -> dict:
    """The rows split by hand: ``nproc`` plain processes started together, process i on GPU i alone
    (``CUDA_VISIBLE_DEVICES=i``) over its contiguous block, as nbddp's ranks take them. Seconds to the last of
    their files (each writes its own) and to the last exit."""
    started, procs = time.time(), []
    for i in range(nproc):
        folder = Path(tempfile.mkdtemp(prefix=f"by-hand-{i}-", dir=work))
        first, end = total * i // nproc, total * (i + 1) // nproc
        (folder / "notebook.py").write_text(
            one_process_script(notebook, BY_HAND[notebook.stem].format(first=first, end=end)))
        env = timeline_env(folder, {**ENV, "CUDA_VISIBLE_DEVICES": str(i)})
        procs.append((folder, subprocess.Popen([sys.executable, "notebook.py"], cwd=folder, env=env,
                                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)))
    ends = []
    for folder, proc in procs:
        _, err = proc.communicate(timeout=timeout)
        ends.append(time.time())
        if proc.returncode or not (folder / "submission.csv").exists():
            raise SystemExit(f"by hand {notebook.name} failed (exit {proc.returncode}):\n{err[-4000:]}")
    written = max((folder / "submission.csv").stat().st_mtime for folder, _ in procs)
    return {"to_submission_s": round(written - started, 3), "wall_s": round(max(ends) - started, 3),
            "timeline": timeline([folder for folder, _ in procs], started)}


def rank_times(runs: Path, started: float, written: float) -> list[dict]:
    """Where each rank's seconds went, from the run's share records (``shares/rank<r>.jsonl`` and
    ``-times.jsonl``, the first prediction loop): from the launch to its first row (``start_s``: converting,
    torchrun, the imports, the model built), its rows (``rows_s``), waiting in the gather (``gather_s``), and
    from the gather to the written file (``write_s``)."""
    out = []
    for share in sorted(runs.glob("*/shares/rank*.jsonl")):
        if share.stem.endswith("-times"):
            continue
        lines = [json.loads(line) for line in share.read_text().splitlines()]
        first_loop = [line for line in lines if line.get("loop") == lines[0].get("loop")]  # its block or chunks
        began = first_loop[0]
        times_file = share.with_name(f"{share.stem}-times.jsonl")
        if "began" not in began or not times_file.exists():
            continue
        times = json.loads(times_file.read_text().splitlines()[0])
        out.append({"rank": began["rank"], "rows": sum(line["end"] - line["first"] for line in first_loop),
                    "chunks": len(first_loop),
                    "start_s": round(began["began"] - started, 2), "rows_s": times["rows_s"],
                    "gather_s": times["gather_s"], "write_s": round(written - times["gathered"], 2)})
    return sorted(out, key=lambda r: r["rank"])


def machine() -> dict:
    """GPU names from nvidia-smi (else "CPU"), the CPU count, the libraries' versions."""
    try:
        names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                               text=True, timeout=30).stdout.split("\n")
        gpus = [n.strip() for n in names if n.strip()]
    except (OSError, subprocess.SubprocessError):
        gpus = []
    import torch
    import transformers

    return {"gpus": gpus or ["CPU"], "cpus": os.cpu_count(), "torch": torch.__version__,
            "transformers": transformers.__version__, "python": sys.version.split()[0]}


def warm_up() -> None:
    """Import what both sides import once, untimed: the first process on a fresh machine pays cold file caches."""
    subprocess.run([sys.executable, "-c", "import torch, transformers, pandas, nbddp.cli, nbddp.runtime.predict\n"
                    "torch.zeros(1).cuda() if torch.cuda.is_available() else None"], env=ENV, check=True)


def measure(names: list[str], sizes: dict, repeats: int, nproc: int, timeout: int, runs_file: Path, call: dict,
            by_hand_too: bool = False) -> None:
    """Each notebook, each pass: one process and nbddp, the first of the two alternating from pass to pass, counting
    the passes earlier calls of the same sizes left in ``runs_file`` (one pass per call still alternates)."""
    work = Path(tempfile.mkdtemp(prefix="nbddp-predict-speed-"))
    notebooks = {name: write_notebook(work, name, sizes) for name in names}
    earlier = {name: len(same_sizes(read_lines(runs_file), sizes, nproc, name)) for name in names}
    warm_up()
    for k in range(repeats):
        for name, notebook in notebooks.items():
            n = earlier[name] + k
            order = ("single", "nbddp") if n % 2 == 0 else ("nbddp", "single")
            run = {side: timed(side, notebook, work, nproc, timeout) for side in order}
            if by_hand_too and name in BY_HAND:
                run["by_hand"] = by_hand(notebook, work, nproc, timeout, sizes["prompts"])
            row = {"notebook": name, "pass": n, "first": order[0], "sizes": {s: sizes[s] for s in SIZE_KEYS[name]},
                   "nproc": nproc, "call": call["started"], "ranks": ranks_started(),
                   "equal": run["single"]["bytes"] == run["nbddp"]["bytes"],
                   "rows_written": run["single"]["bytes"].count(b"\n") - 1,
                   **{f"{side}_{what}": run[side][what] for side in ("single", "nbddp") for what in
                      ("to_submission_s", "wall_s")}, "nbddp_ranks": run["nbddp"]["ranks"],
                   **({f"by_hand_{w}": run["by_hand"][w] for w in ("to_submission_s", "wall_s", "timeline")}
                      if "by_hand" in run else {}),
                   "timeline": {side: run[side]["timeline"] for side in ("single", "nbddp")}}
            print(f"{name:10s} pass {n}: one process {row['single_to_submission_s']:7.2f} s, nbddp "
                  f"{row['nbddp_to_submission_s']:7.2f} s to submission.csv (× "
                  f"{row['single_to_submission_s'] / row['nbddp_to_submission_s']:.2f}); byte-equal: {row['equal']}",
                  flush=True)
            if "by_hand" in run:
                print(f"    by hand ({nproc} plain processes, one GPU each): {row['by_hand_to_submission_s']:7.2f} s "
                      f"(× {row['single_to_submission_s'] / row['by_hand_to_submission_s']:.2f})", flush=True)
            for r in row["nbddp_ranks"]:
                print(f"    nbddp rank {r['rank']}: {r['rows']} rows in {r['chunks']} pieces; start {r['start_s']} s, "
                      f"rows {r['rows_s']} s, gather {r['gather_s']} s, to the file {r['write_s']} s", flush=True)
            for side, marks in [*row["timeline"].items(), *([("by_hand", row["by_hand_timeline"])]
                                                           if "by_hand_timeline" in row else [])]:
                print(f"    timeline {side}: {json.dumps(marks)}", flush=True)
            with open(runs_file, "a") as fh:  # every pair as it ends
                fh.write(json.dumps(row) + "\n")
    shutil.rmtree(work, ignore_errors=True)


def read_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []


def same_sizes(runs: list[dict], sizes: dict, nproc: int, name: str | None = None) -> list[dict]:
    """The runs of these sizes and rank count (of notebook ``name`` where given): other sizes are another benchmark."""
    return [r for r in runs if r["sizes"] == {s: sizes[s] for s in SIZE_KEYS[r["notebook"]]} and r["nproc"] == nproc
            and name in (None, r["notebook"])]


def handed_out(run: dict) -> bool:
    """Whether nbddp's ranks took the rows as they freed up (a loop over rows since the hand-out; a DataLoader's
    loop, and every run before it, in contiguous blocks)."""
    return any(r.get("chunks", 1) > 1 for r in run.get("nbddp_ranks", []))


def entry_name(run: dict) -> str:
    ways = ["rows handed out"] if handed_out(run) else []
    ways += ["ranks forked"] if run.get("ranks") == "forked" else []
    return run["notebook"] + (f" ({', '.join(ways)})" if ways else "")


def ranks_started() -> str:
    """How nbddp's agent starts the ranks on this machine: forked from its own imports of torch, or each a fresh
    interpreter (every GPU run before forked ranks came to GPU machines, whose runs carry no such field)."""
    if str(ROOT / "src") not in sys.path:
        sys.path.insert(0, str(ROOT / "src"))  # this tree's nbddp, as the runs' ``ENV`` has it
    from nbddp.agent import forked_ranks

    return "forked" if forked_ranks.enabled(ENV) else "fresh"


def summarise(runs: list[dict]) -> dict:
    """Per notebook (and, for the same notebook, per way its rows were split): the medians of each side, the ratio
    of each pair (median, min, max), byte equality."""
    out = {}
    for name in dict.fromkeys(entry_name(r) for r in sorted(runs, key=lambda r: list(NOTEBOOKS).index(r["notebook"]))):
        rows = [r for r in runs if entry_name(r) == name]
        entry = {"pairs": len(rows), "all_byte_equal": all(r["equal"] for r in rows), "sizes": rows[-1]["sizes"],
                 "rows_written": rows[-1]["rows_written"]}
        for what in ("to_submission_s", "wall_s"):
            ratios = [r[f"single_{what}"] / r[f"nbddp_{what}"] for r in rows]
            entry[what] = {"single": [r[f"single_{what}"] for r in rows], "nbddp": [r[f"nbddp_{what}"] for r in rows],
                           "single_median": statistics.median(r[f"single_{what}"] for r in rows),
                           "nbddp_median": statistics.median(r[f"nbddp_{what}"] for r in rows),
                           "ratio_median": round(statistics.median(ratios), 3),
                           "ratio_min": round(min(ratios), 3), "ratio_max": round(max(ratios), 3)}
        hand = [r for r in rows if "by_hand_to_submission_s" in r]
        if hand:
            entry["by_hand"] = {"pairs": len(hand), "seconds": [r["by_hand_to_submission_s"] for r in hand],
                                "ratio_median": round(statistics.median(
                                    r["single_to_submission_s"] / r["by_hand_to_submission_s"] for r in hand), 3),
                                "nbddp_ratio_median_same_passes": round(statistics.median(
                                    r["single_to_submission_s"] / r["nbddp_to_submission_s"] for r in hand), 3)}
        out[name] = entry
    return out


def report(result: dict) -> str:
    m, smoke, nproc = result["machine"], result["smoke"], result["nproc"]
    gpus = "no GPU" if m["gpus"] == ["CPU"] else ", ".join(f"{m['gpus'].count(g)} × {g}" for g in dict.fromkeys(m["gpus"]))
    lines = ["# Prediction speed: time to the written submission.csv (benchmarks/predict_speed.py)", "",
             f"Machine: {gpus}; {m['cpus']} CPUs; torch {m['torch']}, transformers {m['transformers']}, Python "
             f"{m['python']}. nbddp: `nbddp run NB --nproc {result['nproc']}` "
             f"({f'{nproc} gloo ranks on CPU' if smoke else 'one rank per GPU, NCCL'}). Baseline: {BASELINE}.", "",
             "Load average (1, 5, 15 min) before and after each call: "
             + "; ".join(f"{c['load_before']} → {c['load_after']}" for c in result["calls"]) + ".", "",
             "| notebook | sizes | pairs | one process, s (median) | nbddp, s (median) | ratio median | ratio min–max "
             "| wall ratio median | submission byte-equal |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for name, e in result["notebooks"].items():
        t, w = e["to_submission_s"], e["wall_s"]
        sizes = ", ".join(f"{k} {v}" for k, v in e["sizes"].items())
        lines.append(f"| {name} | {sizes} | {e['pairs']} | {t['single_median']:.2f} | {t['nbddp_median']:.2f} | "
                     f"**{t['ratio_median']:.2f}×** | {t['ratio_min']:.2f}–{t['ratio_max']:.2f} | "
                     f"{w['ratio_median']:.2f}× | {'yes' if e['all_byte_equal'] else '**NO**'} "
                     f"({e['rows_written']} rows) |")
    lines += ["", "Ratio: the one process's seconds ÷ nbddp's, per pair (the two ran back to back, the first of them "
              "alternating from pass to pass); seconds are from the process's start to submission.csv's last "
              "write; the wall ratio counts to each process's exit. Every run: "
              f"`{result['runs_file']}`.", ""]
    for name, e in result["notebooks"].items():
        t = e["to_submission_s"]
        lines.append(f"- {name}: one process {', '.join(f'{x:.2f}' for x in t['single'])} s; nbddp "
                     f"{', '.join(f'{x:.2f}' for x in t['nbddp'])} s.")
    for name, e in result["notebooks"].items():
        if "by_hand" in e:
            h = e["by_hand"]
            lines.append(f"- {name}, the rows split by hand over {nproc} plain processes (one GPU each, "
                         f"`CUDA_VISIBLE_DEVICES`; the control: what two processes on this host reach at all), in "
                         f"{h['pairs']} of the passes: {', '.join(f'{x:.2f}' for x in h['seconds'])} s, "
                         f"**{h['ratio_median']:.2f}×** the one process (nbddp in the same passes: "
                         f"{h['nbddp_ratio_median_same_passes']:.2f}×).")
    lines.append("")
    if smoke:
        lines += ["**What this shows**: the harness works end to end — both notebooks run in one process and under "
                  "`nbddp run --nproc 2` (2 gloo ranks), nbddp splits their prediction loops and gathers the rows in "
                  "order, and the two submission.csv files are byte-equal. **What it does not**: anything about GPU "
                  "speed. On this 2-core machine, shared with other jobs, the two ranks compete for the same cores "
                  "the one process already uses (torchrun gives each rank one thread), and the smoke sizes are so "
                  "small that the processes' starts are most of the time; the ratio measures those starts, not a "
                  "split of prediction work over two GPUs.", ""]
    elif nproc == 1:
        lines += ["With `--nproc 1` nbddp runs the notebook as one rank on one GPU: the ratio is its fixed cost "
                  "(converting, torchrun, the process group, the gather) against the plain process, not a speed-up.", ""]
    else:
        for name, goal in TARGET.items():
            for entry, e in result["notebooks"].items():
                if entry.split(" (")[0] == name:
                    got = e["to_submission_s"]["ratio_median"]
                    lines.append(f"Target for {entry}: ≥ {goal}× — {'met' if got >= goal else 'not met'} "
                                 f"({got:.3f}×, {e['pairs']} pair{'s' if e['pairs'] > 1 else ''}).")  # 1.799 is not 1.80
        lines.append("")
    return "\n".join(lines)


def write(args: argparse.Namespace, runs_file: Path, calls: list[dict], sizes: dict) -> None:
    runs = same_sizes(read_lines(runs_file), sizes, args.nproc)
    call_ids = {r["call"] for r in runs}
    machines = [c["machine"] for c in calls if c["started"] in call_ids and "machine" in c]
    result = {"smoke": args.smoke, "nproc": args.nproc, "machine": machines[-1] if machines else machine(),
              "baseline": BASELINE,
              "runs_file": runs_file.name,  # beside the report
              "calls": [c for c in calls if c["started"] in call_ids], "notebooks": summarise(runs)}
    base = args.out / f"predict_speed_{args.tag}"
    base.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    base.with_suffix(".md").write_text(report(result))
    print(report(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU sizes, 2 gloo ranks: proves the harness")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", choices=sorted(NOTEBOOKS), action="append", help="this notebook only (repeatable)")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--tag", help="results' name: predict_speed_<tag>.* (default: cpu_smoke with --smoke, else gpu)")
    parser.add_argument("--timeout", type=int, default=900, help="seconds one run may take")
    parser.add_argument("--by-hand", action="store_true",
                        help="also the rows split by hand over plain processes, one GPU each (generation)")
    parser.add_argument("--report", action="store_true", help="run nothing: rebuild .json/.md from the runs file")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--wheels", type=Path, help="a folder of wheels for what this Python lacks (the GPU image)")
    for key, value in SIZES["gpu"].items():
        parser.add_argument(f"--{key.replace('_', '-')}", type=int, help=f"default {value} (smoke {SIZES['smoke'][key]})")
    args = parser.parse_args()
    if args.wheels:
        use_wheels(args.wheels)
    args.tag = args.tag or ("cpu_smoke" if args.smoke else "gpu")
    sizes = {k: getattr(args, k) if getattr(args, k) is not None else v
             for k, v in SIZES["smoke" if args.smoke else "gpu"].items()}
    args.out.mkdir(parents=True, exist_ok=True)
    runs_file = args.out / f"predict_speed_{args.tag}_runs.jsonl"
    calls_file = args.out / f"predict_speed_{args.tag}_calls.jsonl"
    if not args.report:
        call = {"started": time.strftime("%Y-%m-%dT%H:%M:%S"), "machine": machine(),
                "load_before": [round(x, 2) for x in os.getloadavg()]}
        measure(args.only or list(NOTEBOOKS), sizes, args.repeats, args.nproc, args.timeout, runs_file, call,
                args.by_hand)
        call["load_after"] = [round(x, 2) for x in os.getloadavg()]
        with open(calls_file, "a") as fh:
            fh.write(json.dumps(call) + "\n")
    write(args, runs_file, read_lines(calls_file), sizes)


if __name__ == "__main__":
    main()
