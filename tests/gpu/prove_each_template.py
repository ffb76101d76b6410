"""GPU proof: each template trains on every GPU both ways a user starts it, with NCCL.

  run     ``nbddp run templates/<name>.ipynb`` from a terminal;
  kernel  ``%ddp_train templates/<name>.ipynb`` in a real kernel (a notebook executed by nbclient).

The templates run with their default parameters (the embedded tiny model) from a copy of ``templates/`` in a
temporary folder. A check passes when the job ends well and its run directory's records say the rest: one rank
log folder per GPU in torchrun's newest attempt (``logs/<id>/attempt_N/<rank>/``), rank 0's own stdout there
naming the backend (nccl; gloo with ``--cpu``) and holding the template's last line ("… saved to …"). The
records, not the text a terminal or a kernel shows: the view may change how it shows them (the kernel's panel
does not print rank 0's summary as text). Prints PASS/FAIL per template and way; exit code 0 only
when every one passed. On a machine without GPUs it runs the same on two gloo processes (``--cpu``).

    python tests/gpu/prove_each_template.py [--cpu] [--only NAME]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TEMPLATES = sorted(p.stem for p in (ROOT / "templates").glob("*.ipynb"))


def run_dir(runs: Path, name: str) -> Path | None:
    """The newest run directory of template ``name`` under ``runs`` (``YYYYmmdd-HHMMSS-<name>[-k]``)."""
    pattern = re.compile(rf"\d{{8}}-\d{{6}}-{re.escape(name)}(-\d+)?")
    found = [p for p in runs.glob("*") if p.is_dir() and pattern.fullmatch(p.name)] if runs.is_dir() else []
    return max(found, key=lambda p: p.stat().st_mtime, default=None)


def rank_logs(run: Path) -> dict[int, Path]:
    """Each local rank's stdout.log in torchrun's newest attempt: ``logs/<run id>/attempt_N/<rank>/stdout.log``."""
    logs = list(run.glob("logs/*/attempt_*/*/stdout.log"))
    newest = max((int(p.parts[-3].removeprefix("attempt_")) for p in logs), default=None)
    return {int(p.parts[-2]): p for p in logs if p.parts[-2].isdigit() and int(p.parts[-3].removeprefix("attempt_")) == newest}


def missing(runs: Path, name: str, ngpu: int) -> list[str]:
    """What the run's records lack: its run directory, one rank per GPU (2 on CPU), rank 0 on the backend, the
    template's last line."""
    run = run_dir(runs, name)
    if run is None:
        return [f"a run directory for {name} under {runs}"]
    ranks, want = rank_logs(run), ngpu or 2
    problems = [] if sorted(ranks) == list(range(want)) else [f"{want} rank logs (found ranks {sorted(ranks)})"]
    rank0 = ranks[0].read_text(errors="replace") if 0 in ranks else ""
    backend = "nccl" if ngpu else "gloo"
    problems += [w for w in (f"process(es), backend {backend}", "saved to") if w not in rank0]
    return problems


def by_cli(work: Path, name: str, ngpu: int) -> list[str]:
    proc = subprocess.run([sys.executable, "-m", "nbddp.cli", "run", f"{name}.ipynb", "--skip-installs",
                           "--runs-dir", str(work / "runs")], cwd=work, capture_output=True, text=True, timeout=600)
    text = proc.stdout + proc.stderr
    print(text[-1500:])
    return ([f"exit code {proc.returncode}"] if proc.returncode else []) + missing(work / "runs", name, ngpu)


def by_kernel(work: Path, names: list[str], ngpu: int) -> dict[str, list[str]]:
    import nbclient
    import nbformat

    cells = ["%load_ext nbddp"]
    for name in names:
        cells.append(f"%ddp_train {name}.ipynb --skip-installs --runs-dir runs")
        cells.append(f"print('{name} ok:', _ddp.ok)")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3", allow_errors=True,
                            resources={"metadata": {"path": str(work)}}).execute()
    outcome = {}
    for i, name in enumerate(names):
        train, ok = nb.cells[1 + 2 * i], nb.cells[2 + 2 * i]
        text = "\n".join(o.get("text", "") or str(o.get("data", {}).get("text/plain", "")) for o in train.outputs)
        errors = [o.get("ename", "") + ": " + o.get("evalue", "") for o in train.outputs if o.output_type == "error"]
        print(text[-1500:], *errors, sep="\n")
        result = "".join(o.get("text", "") for o in ok.outputs)
        outcome[name] = errors + missing(work / "runs", name, ngpu) + ([] if f"{name} ok: True" in result else ["_ddp.ok"])
    return outcome


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="no GPUs: two gloo processes")
    ap.add_argument("--only", action="append", choices=TEMPLATES, help="one template (repeatable)")
    ap.add_argument("--ways", default="run,kernel")
    args = ap.parse_args()
    import torch

    ngpu = 0 if args.cpu else torch.cuda.device_count()
    if not args.cpu and ngpu < 2:
        print("SKIP: fewer than 2 GPUs")
        return 2
    names = args.only or TEMPLATES
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p)
    if args.cpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    results: dict[str, list[str]] = {}
    with tempfile.TemporaryDirectory(prefix="nbddp-templates-") as tmp:
        work = Path(tmp)
        for name in names:
            shutil.copy(ROOT / "templates" / f"{name}.ipynb", work)
        if "run" in args.ways:
            for name in names:
                results[f"{name} via nbddp run"] = by_cli(work, name, ngpu)
        if "kernel" in args.ways:
            for name, problems in by_kernel(work, names, ngpu).items():
                results[f"{name} via %ddp_train in a kernel"] = problems
    for check, problems in results.items():
        print(f"{'PASS' if not problems else 'FAIL'} {check}" + (f": missing {problems}" if problems else ""))
    return 0 if all(not p for p in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
