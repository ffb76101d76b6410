"""How long converting a 50-code-cell notebook takes (target: a median of at most 50 ms).

The notebook is made of the fixture corpus's cells (Unsloth, Trainer, TRL, plain PyTorch, magics) until it
has 50 code cells, so every rule has work somewhere and most cells have nothing for most rules. Besides the
median of the whole conversion, the run times the stages of a few conversions (read with nbformat, clean,
facts and checks with ``ast``, the libcst rewrite) and compares, side by side, conversion with the rules'
checks against running the rules over every statement with libcst (``precheck=False``), and counts the
characters libcst reads (stand-ins included) against those of the cells. It also times ``import nbddp.job``
in a fresh interpreter. Writes ``benchmarks/results/convert_speed.json``.

    python benchmarks/convert_speed.py [--repeats 60] [--against REV [--rounds 10]] [--out FILE]

``--against REV`` also converts the same notebook with the code at a git revision (or in a folder holding
its ``nbddp`` package), in fresh interpreters taking turns with ones running the working tree's code, and
reports the ratio of their medians: on a shared machine whose speed drifts, the ratio is the steadier figure.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from nbddp import __version__  # noqa: E402
from nbddp.cells import read_notebook  # noqa: E402
from nbddp.convert import convert_cells, convert_notebook  # noqa: E402
from nbddp.convert.clean import clean_cell  # noqa: E402
from nbddp.convert.code import CellCode  # noqa: E402
from nbddp.convert.engine.plan import plan_cell  # noqa: E402
from nbddp.convert.facts import gather_facts  # noqa: E402
from nbddp.convert.rules import RULES  # noqa: E402

CORPUS = ROOT / "tests" / "corpus"
ORDER = ("unsloth_kaggle_sft", "hf_trainer_text_classification", "pytorch_image_cnn", "kaggle_magics",
         "trl_sft_qlora", "unsloth_grpo", "pytorch_tabular_mlp", "sft_then_dpo", "inference_tail")
TARGET_MS = 50.0


def fifty_cell_notebook(path: Path, cells: int = 50) -> Path:
    """A notebook of ``cells`` code cells taken in order from corpus notebooks, with their markdown."""
    out, code = [], 0
    while code < cells:
        for name in ORDER:
            for cell in nbformat.read(str(CORPUS / f"{name}.ipynb"), as_version=4).cells:
                if code == cells:
                    break
                out.append(cell)
                code += cell.cell_type == "code"
    nb = nbformat.v4.new_notebook(cells=out)
    nbformat.write(nb, str(path))
    return path


def timed(fn, repeats: int) -> tuple[list[float], list[float]]:
    """CPU and wall milliseconds of ``repeats`` calls (after one warm-up call: imports, caches).

    CPU time (``time.process_time``) is the figure compared with the target: on a shared machine the wall
    time also counts the time other processes held the cores.
    """
    fn()
    cpu, wall = [], []
    for _ in range(repeats):
        c, w = time.process_time(), time.perf_counter()
        fn()
        cpu.append((time.process_time() - c) * 1000)
        wall.append((time.perf_counter() - w) * 1000)
    return cpu, wall


def stages(path: Path) -> dict[str, float]:
    """One conversion, stage by stage, in milliseconds (what the script's assembly adds is not timed)."""
    from nbddp.convert.engine.rewrite import rewrite

    clock = time.process_time
    t0 = clock()
    cells = read_notebook(path)
    t1 = clock()
    cleaned = [clean_cell(c) for c in cells]
    t2 = clock()
    codes = [CellCode.read(c.code, c.tree, i) for i, c in enumerate(cleaned)]
    facts = gather_facts(codes)
    t3 = clock()
    plans = [plan_cell(code, facts, RULES) for code in codes]
    t4 = clock()
    for code, plan in zip(codes, plans):
        if plan is not None:
            rewrite(code, plan, facts)
    t5 = clock()
    ms = lambda a, b: round((b - a) * 1000, 2)  # noqa: E731
    return {"read": ms(t0, t1), "clean": ms(t1, t2), "facts": ms(t2, t3), "checks": ms(t3, t4),
            "libcst_rewrite": ms(t4, t5)}


def libcst_share(path: Path) -> dict[str, int]:
    """How much of the notebook libcst reads: top-level statements in its chunks, and characters (stand-ins
    included) against the characters of the cleaned cells."""
    import libcst as cst

    codes = [CellCode.read(c.code, c.tree, i) for i, c in enumerate(clean_cell(c) for c in read_notebook(path))]
    facts = gather_facts(codes)
    plans = [plan_cell(code, facts, RULES) for code in codes]
    read, real = [], cst.parse_module
    cst.parse_module = lambda code, *a, **k: read.append(len(code)) or real(code, *a, **k)
    try:
        from nbddp.convert.engine.rewrite import rewrite

        for code, plan in zip(codes, plans):
            if plan is not None:
                rewrite(code, plan, facts)
    finally:
        cst.parse_module = real
    return {
        "statements": sum(len(code.statements) for code in codes),
        "statements_in_libcst_chunks": sum(len(chunk) for plan in plans if plan for chunk in plan.chunks),
        "cells_parsed_with_libcst": sum(1 for plan in plans if plan),
        "characters": sum(len(code.code) for code in codes),
        "characters_read_by_libcst": sum(read),
    }


def cpu_model() -> str:
    try:
        return next(ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                    if ln.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "cpu"


def _child(src: Path, notebook: Path, repeats: int) -> list[float]:
    """In a fresh interpreter: convert ``notebook`` with the nbddp under ``src``; print the CPU ms as JSON."""
    code = (
        "import gc, json, sys, time\n"
        f"sys.path.insert(0, {str(src)!r})\n"
        "from nbddp.convert import convert_notebook\n"
        f"convert_notebook({str(notebook)!r})\n"
        "out = []\n"
        f"for _ in range({repeats}):\n"
        "    c = time.process_time()\n"
        f"    convert_notebook({str(notebook)!r})\n"
        "    out.append((time.process_time() - c) * 1000)\n"
        "print(json.dumps(out))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def against(rev: str, notebook: Path, rounds: int, repeats: int) -> dict:
    """The code at ``rev`` and the working tree's, side by side: fresh interpreters taking turns.

    ``rev`` is a git revision, or a folder holding that code's ``nbddp`` package (where there is no git
    history, as on a lent machine). Each round runs one interpreter of each (in alternating order),
    ``repeats`` conversions each, so a drift in the shared machine's speed reaches both alike. The ratio of
    the medians is the figure.
    """
    times: dict[str, list[float]] = {"before": [], "now": []}

    def turns(old_src: Path) -> None:
        for r in range(rounds):
            order = [("before", old_src), ("now", ROOT / "src")]
            for name, src in order if r % 2 == 0 else order[::-1]:
                times[name] += _child(src, notebook, repeats)

    if (Path(rev) / "nbddp").is_dir():
        turns(Path(rev))
    else:
        with tempfile.TemporaryDirectory() as tmp:
            old = Path(tmp) / "old"
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(old), rev], check=True,
                           capture_output=True)
            try:
                turns(old / "src")
            finally:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old)], check=True,
                               capture_output=True)
    before, now = statistics.median(times["before"]), statistics.median(times["now"])
    return {"rev": rev, "rounds": rounds, "repeats_per_round": repeats, "before_median_ms": round(before, 2),
            "now_median_ms": round(now, 2), "before_min_ms": round(min(times["before"]), 2),
            "now_min_ms": round(min(times["now"]), 2), "now_over_before": round(now / before, 3)}


def import_time_s() -> float:
    """Seconds ``import nbddp.job`` takes in a fresh interpreter (``-X importtime``, cumulative)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, "-X", "importtime", "-c", "import nbddp.job"], capture_output=True,
                         text=True, env=env, check=True).stderr
    last = [ln for ln in out.splitlines() if re.search(r"\|\s*nbddp\.job$", ln)][-1]
    return round(int(last.split("|")[1]) / 1e6, 3)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=60)
    ap.add_argument("--against", metavar="REV", help="also time the code at this git revision (or in this folder "
                    "holding its nbddp package), side by side")
    ap.add_argument("--rounds", type=int, default=10, help="with --against: interpreters of each, taking turns")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "convert_speed.json")
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        path = fifty_cell_notebook(Path(tmp) / "fifty.ipynb")
        code_cells = len(read_notebook(path))
        with_check, with_check_wall = timed(lambda: convert_notebook(path), args.repeats)
        every_statement = lambda: convert_cells(read_notebook(path), origin=path.name, precheck=False)  # noqa: E731
        without_check, _ = timed(every_statement, args.repeats)
        per_stage = [stages(path) for _ in range(9)]
        share = libcst_share(path)
        side_by_side = against(args.against, path, args.rounds, args.repeats) if args.against else None
    imports = sorted(import_time_s() for _ in range(5))
    median = statistics.median(with_check)
    load = os.getloadavg()[0]
    result = {
        "benchmark": "convert_speed",
        "nbddp": __version__,
        "python": platform.python_version(),
        "machine": f"{platform.machine()}, {cpu_model()}",
        "code_cells": code_cells,
        "repeats": args.repeats,
        "clock": "CPU time of this process (time.process_time)",
        "median_ms": round(median, 2),
        "p90_ms": round(sorted(with_check)[int(0.9 * (len(with_check) - 1))], 2),
        "min_ms": round(min(with_check), 2),
        "target_ms": TARGET_MS,
        "meets_target": median <= TARGET_MS,
        "wall_median_ms": round(statistics.median(with_check_wall), 2),
        "load_average_1min": round(load, 2),
        "cpus": os.cpu_count(),
        "every_statement_with_libcst_median_ms": round(statistics.median(without_check), 2),
        "precheck_speedup": round(statistics.median(without_check) / median, 2),
        "stages_ms_median": {k: statistics.median(s[k] for s in per_stage) for k in per_stage[0]},
        "libcst": share,
        "import_nbddp_job_s_median": imports[len(imports) // 2],
    }
    if side_by_side:
        result["against"] = side_by_side
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
