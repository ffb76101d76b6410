"""What every notebook of ``tests/corpus/`` comes to under two source trees of nbddp, and where they differ.

For each notebook (all ``*.ipynb`` under the current tree's ``tests/corpus/``) and each tree, runs
``nbddp convert --explain NB -o SCRIPT`` and ``nbddp run --dry-run --nproc 2 NB`` with ``PYTHONPATH`` set to
that tree's ``src`` and the notebook's folder as working directory (nothing is launched). Records the exit
status, the refusal (``nbddp: error: …``), an internal error or a raw traceback, the warnings, the change
tags of ``--explain`` (``…  [rule]``, counted) and the dry run's mode. Then, in one process per tree, reads each
notebook's install lines as ``nbddp run`` does before launch (``Install.argv``: the dry run does not), and
records the refusal that gives. Writes every row as JSON and prints each
notebook whose two sides differ, with the ``--explain`` lines only one side has. Judging each difference
(correct / refused / silently wrong …) is left to a reader of the notebook: see benchmarks/results/corpus_outcomes.md.

    python benchmarks/corpus_outcomes.py BEFORE_SRC AFTER_SRC [--jobs 2] [--out DIR] [--reuse-before ROWS]

BEFORE_SRC / AFTER_SRC: the ``src`` folders of the two trees (e.g. a ``git worktree add --detach`` of the
earlier commit). The converted scripts are left under ``DIR/{before,after}/`` to read.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "tests" / "corpus"
TAG = re.compile(r"  \[([a-z_0-9]+)\]$")  # --explain ends each change line with its rule: "…  [ddp_wrap]"


def nbddp(src: str, nb: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=src)
    return subprocess.run([sys.executable, "-m", "nbddp.cli", *args, str(nb)], capture_output=True, text=True,
                          env=env, timeout=600, cwd=nb.parent)


def refusal(stderr: str) -> str:
    return next((line for line in stderr.splitlines() if line.startswith("nbddp: error:")), "")


def crashed(stderr: str) -> bool:
    """nbddp's own failure: a raw traceback, or the guard's 'internal error' paragraph."""
    return "Traceback (most recent call last)" in stderr or "internal error while" in stderr


def outcome(side: str, src: str, nb: str, out: Path) -> dict:
    path = CORPUS / nb
    script = out / side / (nb.replace("/", "__") + ".py")
    conv = nbddp(src, path, "convert", "--explain", "-o", str(script))
    dry = nbddp(src, path, "run", "--dry-run", "--nproc", "2")
    changes = [line for line in conv.stdout.splitlines() if TAG.search(line)]
    mode = next((line.split(":", 1)[1].strip() for line in dry.stdout.splitlines() if line.strip().startswith("mode:")), "")
    return {"nb": nb, "side": side,
            "convert_rc": conv.returncode, "convert_refusal": refusal(conv.stderr),
            "dry_rc": dry.returncode, "dry_refusal": refusal(dry.stderr), "mode": mode,
            "crash": crashed(conv.stderr) or crashed(dry.stderr),
            "warnings": sorted({line for line in (conv.stderr + dry.stderr).splitlines() if line.startswith("nbddp: warning:")}),
            "tags": dict(sorted(collections.Counter(TAG.search(line).group(1) for line in changes).items())),
            "changes": changes, "convert_stderr": conv.stderr[-3000:], "dry_stderr": dry.stderr[-3000:]}


#: Run with a tree's PYTHONPATH: each notebook's install line that ``nbddp run`` refuses to read before launch.
INSTALLS = """
import json, os, sys
from pathlib import Path
from nbddp.convert import convert_notebook
from nbddp.errors import NbddpError
found = {}
for nb in sys.argv[1:]:
    os.chdir(Path(nb).parent)
    try:
        script = convert_notebook(nb)
    except Exception:
        continue  # refused (or crashed) already: the CLI pass records it
    for install in script.installs:
        try:
            install.argv()
        except NbddpError as exc:
            found[nb] = "nbddp: error: " + str(exc).splitlines()[0]
            break
print(json.dumps(found))
"""


def install_refusals(src: str, nbs: list[str]) -> dict[str, str]:
    done = subprocess.run([sys.executable, "-c", INSTALLS, *(str(CORPUS / nb) for nb in nbs)], capture_output=True,
                          text=True, env=dict(os.environ, PYTHONPATH=src), timeout=1800, check=True)
    return {str(Path(nb).relative_to(CORPUS)): why for nb, why in json.loads(done.stdout.splitlines()[-1]).items()}


COMPARED = ("convert_rc", "convert_refusal", "dry_rc", "dry_refusal", "install_refusal", "mode", "crash", "warnings", "tags")


def report(rows: list[dict]) -> None:
    by: dict[str, dict] = {}
    for r in rows:
        by.setdefault(r["nb"], {})[r["side"]] = r
    differ = 0
    for nb, d in by.items():
        b, a = d["before"], d["after"]
        if all(b[k] == a[k] for k in COMPARED):
            continue
        differ += 1
        print("==", nb)
        for k in COMPARED:
            if b[k] != a[k] and k != "warnings":
                print(f"  {k}:\n    before: {str(b[k])[:400]}\n    after:  {str(a[k])[:400]}")
        for sign, only in (("-", set(b["warnings"]) - set(a["warnings"])), ("+", set(a["warnings"]) - set(b["warnings"]))):
            for w in sorted(only):
                print(f"  {sign}w {w[:400]}")
        if b["tags"] != a["tags"]:
            for sign, only in (("-", set(b["changes"]) - set(a["changes"])), ("+", set(a["changes"]) - set(b["changes"]))):
                for line in sorted(only)[:15]:
                    print(f"  {sign}c {line[:300]}")
    print(f"differ: {differ} of {len(by)}")
    for side in ("before", "after"):
        mine = [r for r in rows if r["side"] == side]
        print(f"{side}: crashes {sum(r['crash'] for r in mine)}, convert refusals {sum(bool(r['convert_refusal']) for r in mine)}, "
              f"dry-run refusals {sum(bool(r['dry_refusal']) for r in mine)}, "
              f"install lines refused {sum(bool(r['install_refusal']) for r in mine)}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("before_src")
    p.add_argument("after_src")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path("/tmp/corpus_outcomes"))
    p.add_argument("--reuse-before", type=Path, help="an earlier rows.json of the same BEFORE_SRC: only AFTER_SRC is run")
    args = p.parse_args()
    sides = {"before": args.before_src, "after": args.after_src}
    for side in sides:
        (args.out / side).mkdir(parents=True, exist_ok=True)
    nbs = sorted(str(p.relative_to(CORPUS)) for p in CORPUS.rglob("*.ipynb"))
    kept = [r for r in json.loads(args.reuse_before.read_text()) if r["side"] == "before"] if args.reuse_before else []
    jobs = [(s, src, nb) for nb in nbs for s, src in sides.items() if not (kept and s == "before")]
    with ThreadPoolExecutor(args.jobs) as pool:
        rows = kept + list(pool.map(lambda job: outcome(*job, args.out), jobs))
    for side, src in sides.items():
        refused = install_refusals(src, nbs)
        for r in rows:
            if r["side"] == side:
                r["install_refusal"] = refused.get(r["nb"], "")
    (args.out / "rows.json").write_text(json.dumps(rows, indent=1))
    report(rows)


if __name__ == "__main__":
    main()
