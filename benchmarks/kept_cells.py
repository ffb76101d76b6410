"""A kept job against a fresh job, driven through a real kernel (CPU, 2 gloo ranks, the demo model).

    python benchmarks/kept_cells.py [--prints 10] [--out benchmarks/results] [--others DIR]
    python benchmarks/kept_cells.py --gpu MODEL_DIR      # real Unsloth, a 4-bit model from disk (lead's GPU runs)

Times, each the wall time of one execute request until the kernel is idle again:
- start: ``%%ddp_train --keep`` of cells that load the model and build the Trainer, without training
  (what ``%dist_init`` plus loading costs in the other tools), paid once;
- print: a ``%%ddp`` cell printing the world size (median of ``--prints``);
- kept training: ``%%ddp`` ``trainer.train()`` (30 steps), twice, on the kept ranks;
- fresh job: ``%%ddp_train`` of the same cells and ``trainer.train()``, as a notebook trains without --keep.
With ``--others DIR`` the same call drives the two tools issue 29 compares against, on the same job, in a
kernel each: jupyter-distributed 0.1.1 (its SPMD kernel started directly, no JupyterLab) and nbdistributed
0.1.0 (``%dist_init``, ``%%distributed``). Install them apart from the project's environment (their own
dependencies, Jupyter's and torch, are already in it)::

    pip install --no-deps --target DIR jupyter-distributed==0.1.1 nbdistributed==0.1.0

Their cells are the notebook's own code, less ``%%ddp_setup``, with ``bf16=False`` (TRL's default asks for a
GPU; nbddp's shim turns it off by itself). Writes ``kept_cells.json`` and ``kept_cells.md``. The machine is
shared: say its load with the numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SETUP_CPU = '''%%ddp_setup
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import SFTConfig, SFTTrainer
from nbddp import demo

tokenizer = AutoTokenizer.from_pretrained(demo.tiny_model())
model = AutoModelForCausalLM.from_pretrained(demo.tiny_model(), dtype=torch.float32)
model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, task_type="CAUSAL_LM",
                                         target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
args = SFTConfig(output_dir="outputs", per_device_train_batch_size=16, max_steps=30, learning_rate=5e-3,
                 warmup_steps=3, logging_steps=3, max_length=32, save_strategy="no", report_to="none", seed=3407)
trainer = SFTTrainer(model=model, args=args, train_dataset=demo.arithmetic_dataset(1024), processing_class=tokenizer)
'''

#: Real Unsloth, a 4-bit model read from a local folder (no download): the lead's GPU run.
SETUP_GPU = '''%%ddp_setup
from unsloth import FastLanguageModel
import torch
from trl import SFTConfig, SFTTrainer
from nbddp import demo

model, tokenizer = FastLanguageModel.from_pretrained({model!r}, max_seq_length=512, load_in_4bit=True)
model = FastLanguageModel.get_peft_model(model, r=16, lora_alpha=16, lora_dropout=0,
                                         target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                                         use_gradient_checkpointing="unsloth", random_state=3407)
dataset = demo.arithmetic_dataset(1024)
args = SFTConfig(output_dir="outputs", per_device_train_batch_size=4, max_steps=30, learning_rate=2e-4,
                 warmup_steps=3, logging_steps=3, max_length=512, save_strategy="no", report_to="none", seed=3407)
trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
'''


class Kernel:
    """One kernel, cells executed one at a time and timed until it is idle again."""

    def __init__(self, cwd: Path, *, argv: list[str] | None = None, path: tuple[str, ...] = (), env: dict | None = None):
        from jupyter_client import KernelManager

        python_path = [*path, str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]
        env = {**os.environ, **(env or {}), "PYTHONPATH": os.pathsep.join(python_path),
               "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
        self.km = KernelManager(kernel_name="python3")
        if argv:  # another kernel (jupyter-distributed's), as its server extension starts it
            self.km.kernel_spec.argv = argv
        self.km.start_kernel(cwd=str(cwd), env=env)
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=120)

    def run(self, code: str) -> tuple[float, str]:
        """Seconds until idle, and the cell's text output (errors included)."""
        out: list[str] = []
        started = time.perf_counter()
        self.kc.execute_interactive(code, timeout=1800, output_hook=lambda msg: out.append(_text(msg)))
        return time.perf_counter() - started, "".join(out)

    def close(self) -> None:
        """Shut the kernel down, then end whatever it started that is still running (nbdistributed's
        ``%dist_shutdown`` leaves its workers up): by pid, the processes under this kernel, nothing by name."""
        import psutil

        family: list = []
        with contextlib.suppress(psutil.Error):
            family = psutil.Process(self.km.provisioner.process.pid).children(recursive=True)
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=False)
        for p in family:
            with contextlib.suppress(psutil.Error):
                p.terminate()
        psutil.wait_procs(family, timeout=10)


def _text(msg) -> str:
    content = msg["content"]
    if msg["msg_type"] == "stream":
        return content["text"]
    if msg["msg_type"] == "error":
        return "\n".join(content["traceback"])
    if msg["msg_type"] in ("display_data", "update_display_data", "execute_result"):
        return content.get("data", {}).get("text/plain", "") + "\n"
    return ""


def measure(setup: str, prints: int, nproc: str) -> dict:
    folder = Path(tempfile.mkdtemp(prefix="nbddp-kept-bench-"))
    k = Kernel(folder)
    try:
        k.run("%load_ext nbddp")
        k.run(setup)
        start, out = k.run(f"%%ddp_train --keep --nproc {nproc}\nprint('ready')")
        assert "stay up" in out, out
        print_times = []
        for _ in range(prints):
            seconds, out = k.run("%%ddp\nprint(torch.distributed.get_world_size())")
            assert out.strip().endswith(nproc if nproc != "auto" else out.strip()[-1]), out
            print_times.append(seconds)
        kept, runtimes = [], []
        for _ in range(2):
            seconds, out = k.run("%%ddp\ntrainer.train()")
            assert "Error" not in out, out
            kept.append(seconds)
            runtimes.append(float(k.run("print(_ddp.metrics['train_runtime'])")[1]))
        k.run("%ddp_stop")
        fresh, out = k.run(f"%%ddp_train --nproc {nproc}\ntrainer.train()")
        assert "finished in" in out, out
    finally:
        k.close()
    return {"start_s": start, "print_median_s": statistics.median(print_times), "print_s": print_times,
            "kept_train_s": kept, "kept_train_runtime_s": runtimes, "fresh_train_s": fresh, "fresh_over_kept": fresh / statistics.median(kept)}


#: The same job as plain code, for tools that run a notebook's code as it is on every rank.
PLAIN_SETUP = SETUP_CPU.split("\n", 1)[1].replace('report_to="none",', 'report_to="none", bf16=False,')
PLAIN_PRINT = "import torch\nprint(torch.distributed.get_world_size())"
PLAIN_TRAIN = "out = trainer.train()\nprint('train_runtime', out.metrics['train_runtime'])"


def _runtime(out: str) -> float | None:
    found = re.findall(r"train_runtime'?,? *:? *([0-9.]+)", out)
    return float(found[0]) if found else None


def measure_plain(name: str, kernel: Kernel, start: str | float, wrap, prints: int) -> dict:
    """One of the other tools on the same job: start its processes (a cell, or the seconds its kernel took),
    load the model and build the Trainer, print the world size ``prints`` times, train 30 steps twice; each
    cell's output checked."""
    result: dict = {"tool": name}
    try:
        result["start_s"] = start if isinstance(start, float) else kernel.run(start)[0]
        result["load_s"], out = kernel.run(wrap(PLAIN_SETUP))
        assert "Error" not in out and "error" not in out.lower().replace("stderr", ""), out[-2000:]
        print_times = []
        for _ in range(prints):
            seconds, out = kernel.run(wrap(PLAIN_PRINT))
            assert "2" in out, out[-2000:]
            print_times.append(seconds)
        result["print_s"], result["print_median_s"] = print_times, statistics.median(print_times)
        result["train_s"], result["train_runtime_s"] = [], []
        for _ in range(2):
            seconds, out = kernel.run(wrap(PLAIN_TRAIN))
            runtime = _runtime(out)
            assert runtime is not None, out[-2000:]
            result["train_s"].append(seconds)
            result["train_runtime_s"].append(runtime)
        out = kernel.run(wrap("import torch\nprint('torch threads', torch.get_num_threads())"))[1]
        result["torch_threads"] = sorted(set(re.findall(r"torch threads (\d+)", out)))
    except Exception as exc:  # said in the results as it happened, with the numbers taken before it
        result["error"] = f"{type(exc).__name__}: {str(exc)[-600:]}"
    finally:
        kernel.close()
    return result


def measure_others(others: Path, prints: int) -> list[dict]:
    path = (str(others.resolve()),)
    folder = Path(tempfile.mkdtemp(prefix="nbddp-kept-bench-others-"))
    results = []
    try:
        started = time.perf_counter()  # its ranks start with the kernel (its kernel_info starts them)
        jd = Kernel(folder, path=path, argv=[sys.executable, "-m", "jupyter_distributed.kernel", "-f", "{connection_file}"],
                    env={"JUPYTER_DISTRIBUTED_WORLD_SIZE": "2"})
        results.append(measure_plain("jupyter-distributed 0.1.1", jd, time.perf_counter() - started,
                                     lambda code: code, prints))
    except Exception as exc:
        results.append({"tool": "jupyter-distributed 0.1.1", "error": f"{type(exc).__name__}: {exc}"})
    try:
        nbd = Kernel(folder, path=path)
        nbd.run("%load_ext nbdistributed")
        results.append(measure_plain("nbdistributed 0.1.0", nbd, "%dist_init -n 2",
                                     lambda code: "%%distributed\n" + code, prints))
    except Exception as exc:
        results.append({"tool": "nbdistributed 0.1.0", "error": f"{type(exc).__name__}: {exc}"})
    return results


def _machine() -> dict:
    load = os.getloadavg()
    return {"python": sys.version.split()[0], "platform": platform.platform(), "cpus": os.cpu_count(),
            "load_1_5_15": [round(x, 2) for x in load]}


def write(results: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "kept_cells.json").write_text(json.dumps(results, indent=2) + "\n")
    r, m = results["nbddp"], results["machine"]
    others = results.get("others")
    lines = [
        "# A kept job against a fresh job and the other tools (benchmarks/kept_cells.py)",
        "",
        f"{results['what']}. Machine: {m['cpus']} CPUs, load average (1, 5, 15 min) {m.get('load_before', '?')} "
        f"before and {m['load_1_5_15']} after the call — shared with other jobs, so compare the ratios more than "
        "the seconds.",
        "",
    ]
    if isinstance(others, list):
        lines += _side_by_side(r, others)
    else:
        lines += _nbddp_table(r) + ["", others or ""]
    lines += [
        "",
        "nbddp's start is a whole job: torchrun, torch, transformers, TRL and PEFT imported in each rank, the model "
        "loaded and the dataset tokenized; the other tools' start is their processes alone, loading is the next "
        "cell. A training cell's time over the Trainer's `train_runtime` is the Trainer's set-up per `train()` "
        "(accelerate's `free_memory` runs a full `gc.collect()` first), the cell's conversion and the kernel's "
        "panel (the loss curve drawn on the same CPUs as the ranks).",
    ]
    for note in results.get("notes", ()):  # added by hand to the .json (a profile, a baseline), then --rewrite
        lines += ["", note]
    (out / "kept_cells.md").write_text("\n".join(lines) + "\n")


def _pair(values, fmt="{:.2f}") -> str:
    return ", ".join(fmt.format(v) for v in values) if values else "—"


def _nbddp_table(r: dict) -> list[str]:
    return [
        "| what | seconds |",
        "|---|---|",
        f"| start: `%%ddp_train --keep` loading the model, no training (once) | {r['start_s']:.2f} |",
        f"| `%%ddp` cell printing the world size (median of {len(r['print_s'])}) | {r['print_median_s']:.3f} |",
        f"| `%%ddp` `trainer.train()`, 30 steps, on the kept ranks (1st, 2nd) | {_pair(r['kept_train_s'])} |",
        f"| the Trainer's own `train_runtime` in those cells | {_pair(r['kept_train_runtime_s'])} |",
        f"| fresh `%%ddp_train` of the same cells, 30 steps | {r['fresh_train_s']:.2f} |",
        f"| fresh job / kept training cell | {r['fresh_over_kept']:.1f}× |",
    ]


def _side_by_side(r: dict, others: list[dict]) -> list[str]:
    head = "| seconds | nbddp | " + " | ".join(o["tool"] for o in others) + " |"
    rows = [head, "|---" * (2 + len(others)) + "|"]

    def row(label, ours, key, fmt="{:.2f}"):
        cells = [_pair(o[key], fmt) if isinstance(o.get(key), list) else
                 (fmt.format(o[key]) if o.get(key) is not None else "—") for o in others]
        rows.append(f"| {label} | {ours} | " + " | ".join(cells) + " |")

    row("start: the processes (once)", "—", "start_s")
    row("loading the model and building the Trainer (once)", "—", "load_s")
    rows.append(f"| nbddp: `%%ddp_train --keep` of the loading cells, both of the above (once) | {r['start_s']:.2f} | "
                + " | ".join("—" for _ in others) + " |")
    row(f"a cell printing the world size (median of {len(r['print_s'])})", f"{r['print_median_s']:.3f}",
        "print_median_s", "{:.3f}")
    row("`trainer.train()`, 30 steps, on the kept model (1st, 2nd)", _pair(r["kept_train_s"]), "train_s")
    row("the Trainer's own `train_runtime` in those cells", _pair(r["kept_train_runtime_s"]), "train_runtime_s")
    rows.append(f"| a fresh `%%ddp_train` of the same cells, 30 steps | {r['fresh_train_s']:.2f} | "
                + " | ".join("—" for _ in others) + " |")
    rows += ["", f"Fresh job / nbddp's kept training cell: {r['fresh_over_kept']:.1f}×."]
    threads = [f"{o['tool']} {', '.join(o['torch_threads'])}" for o in others if o.get("torch_threads")]
    if threads:
        rows += ["", "torch threads per rank: nbddp 1 (torchrun's `OMP_NUM_THREADS=1` with 2 processes), "
                 + "; ".join(threads) + "."]
    for o in others:
        if o.get("error"):
            rows += ["", f"{o['tool']} stopped: {o['error'].splitlines()[0]}"]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prints", type=int, default=10)
    parser.add_argument("--gpu", metavar="MODEL_DIR", help="real Unsloth with this local 4-bit model (one rank per GPU)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--rewrite", action="store_true", help="rewrite the .md from the saved .json, no run")
    parser.add_argument("--others", type=Path, metavar="DIR",
                        help="a pip --target folder holding jupyter-distributed 0.1.1 and nbdistributed 0.1.0: drive them too")
    args = parser.parse_args()
    if args.rewrite:
        write(json.loads((args.out / "kept_cells.json").read_text()), args.out)
        return
    load_before = [round(x, 2) for x in os.getloadavg()]
    if args.gpu:
        what = f"Real Unsloth, 4-bit model from {args.gpu}, one rank per GPU"
        result = measure(SETUP_GPU.format(model=str(Path(args.gpu).resolve())), args.prints, "auto")
        name = args.out / "gpu"
    else:
        what = "CPU, 2 gloo ranks, the demo tiny Llama with LoRA (notebooks/magics.ipynb's job)"
        result = measure(SETUP_CPU, args.prints, "2")
        name = args.out
    others = measure_others(args.others, args.prints) if args.others else (
        "jupyter-distributed and nbdistributed were not driven in this call (run with --others DIR).")
    results = {"what": what, "machine": {**_machine(), "load_before": load_before}, "nbddp": result, "others": others}
    write(results, name)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
