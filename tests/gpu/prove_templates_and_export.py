"""GPU proof for the templates and the Kaggle export, on a machine with two or more GPUs (e.g. Kaggle's T4 x2).

What CPU tests cannot show: NCCL between real GPUs, bitsandbytes' 4-bit layers on CUDA, and a self-launching
exported script taking every GPU. Two checks, each printed as PASS or FAIL; the exit code is 0 only when
every check asked for passed.

  template  papermill executes templates/qlora_4bit.ipynb (kernel python3) → nbddp → torchrun, one rank per
            GPU: backend nccl, Linear4bit layers, the Trainer's world size = the GPU count, adapter saved.
  export    the same template exported as a Kaggle Script (nbddp export), run as Kaggle runs it
            (`python <slug>.py`): it launches itself on every GPU with the same results.
            Where nbddp's notebook side is not installed, pass a script exported elsewhere with --exported.

    python tests/gpu/prove_templates_and_export.py                       # both checks
    python tests/gpu/prove_templates_and_export.py --checks export --exported kernel/qlora-4bit.py
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "templates" / "qlora_4bit.ipynb"


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def expect(output: str, work: Path, ngpu: int, steps: int) -> list[str]:
    """What a good run shows; the list of what was missing."""
    wanted = [
        f"nbddp: {ngpu} process(es), backend nccl",
        "linear layers in 4 bits",
        f"{steps} steps on {ngpu} processes",
        "adapter saved to outputs/qlora_4bit",
    ]
    missing = [w for w in wanted if w not in output]
    if " 0 linear layers in 4 bits" in output:
        missing.append("a Linear4bit layer (0 found)")
    if not (work / "outputs" / "qlora_4bit" / "adapter_model.safetensors").exists():
        missing.append("outputs/qlora_4bit/adapter_model.safetensors")
    return missing


def check_template(work: Path, ngpu: int, steps: int) -> list[str]:
    import nbformat
    import papermill

    shutil.copy(TEMPLATE, work)
    out = work / "out.ipynb"
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p)
    papermill.execute_notebook(str(work / TEMPLATE.name), str(out), parameters={"max_steps": steps},
                               kernel_name="python3", cwd=str(work), progress_bar=False)
    nb = nbformat.read(str(out), as_version=4)
    text = "".join(o.get("text", "") for o in nb.cells[-1].outputs)
    print(text[-3000:])
    return expect(text, work, ngpu, steps)


def check_export(work: Path, ngpu: int, steps: int, exported: Path | None) -> list[str]:
    if exported is None:
        sys.path.insert(0, str(ROOT / "src"))
        import nbformat
        from nbddp.export import export_kaggle

        nb = nbformat.read(str(TEMPLATE), as_version=4)
        params = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
        params.source = params.source.replace("max_steps: int = 60", f"max_steps: int = {steps}")
        nbformat.write(nb, str(work / TEMPLATE.name))
        exported = export_kaggle(work / TEMPLATE.name, work / "kernel", kernel_id="nbddp/qlora-4bit-proof").script
    env = {k: v for k, v in os.environ.items() if k != "NBDDP_NPROC"}  # every GPU; the script imports its own nbddp
    proc = subprocess.run([sys.executable, str(exported)], cwd=work, env=env, capture_output=True, text=True,
                          timeout=1200)
    print((proc.stdout + proc.stderr)[-3000:])
    missing = expect(proc.stdout, work, ngpu, steps)
    return ([f"exit code 0 (got {proc.returncode})"] if proc.returncode else []) + missing


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checks", default="template,export", help="comma-separated: template, export")
    p.add_argument("--steps", type=int, default=20, help="training steps per check")
    p.add_argument("--exported", type=Path, help="an exported script to run instead of exporting here "
                                                 "(made with max_steps set to --steps)")
    args = p.parse_args()
    ngpu = gpu_count()
    if ngpu < 2:
        print(f"FAIL: this proof needs two or more GPUs; torch sees {ngpu}")
        return 1
    failed = 0
    for name in args.checks.split(","):
        work = Path(tempfile.mkdtemp(prefix=f"nbddp-gpu-{name}-"))
        try:
            if name == "template":
                missing = check_template(work, ngpu, args.steps)
            elif name == "export":
                missing = check_export(work, ngpu, args.steps, args.exported and args.exported.resolve())
            else:
                missing = [f"a known check (not {name!r})"]
        except Exception as exc:  # a check that crashed failed; say how and go on to the next
            missing = [f"no exception ({type(exc).__name__}: {exc})"]
        status = "PASS" if not missing else "FAIL"
        failed += bool(missing)
        print(f"{status}: {name} on {ngpu} GPUs" + "".join(f"\n  missing: {m}" for m in missing), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
