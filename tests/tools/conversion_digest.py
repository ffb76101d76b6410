"""A digest of every conversion of the corpus, for a reshaping of the code that must change none.

Converts each notebook nbddp is tested on — the fixtures (``tests/corpus/*.ipynb``), the runnable corpus, the
public corpus and the Unsloth collection (``tests/corpus/public``), the templates and ``notebooks/`` — and prints
one line per notebook: a sha256 over everything the conversion hands on (the script's text, its source map,
installs, changes, warnings and the places the FSDP refusals read), what the launcher reads from it before launch
(the model's shape, the output folders, ``auto``'s strategy on two 80 GiB GPUs), or the refusal's message.

    python tests/tools/conversion_digest.py > before.txt
    ... reshape ...
    python tests/tools/conversion_digest.py | diff before.txt -

``--split`` prints two digests a notebook: the conversion's, then what the launcher reads from it.
"""

from __future__ import annotations

import hashlib
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT / "tests" / "corpus"
PUBLIC = CORPUS / "public"
GiB = 2**30


def notebooks() -> list[tuple[str, Path]]:
    """(label, path) of every notebook on disk, sorted."""
    found = sorted(CORPUS.glob("*.ipynb")) + sorted((CORPUS / "runnable").glob("*.ipynb"))
    found += sorted(PUBLIC.rglob("*.ipynb")) + sorted((ROOT / "templates").glob("*.ipynb"))
    found += sorted((ROOT / "notebooks").glob("*.ipynb"))
    return [(str(p.relative_to(ROOT)), p) for p in found]


def launcher_reads(script, cwd: Path) -> list[str]:
    """What the launcher reads from a script before launch, spelled stably."""
    from nbddp import choose_strategy as strategy, outputs

    shape = getattr(script, "shape", None) or strategy.read_shape(script.text)
    folders = [(str(f.path.relative_to(cwd)) if f.path.is_relative_to(cwd) else str(f.path), f.cell, f.line, f.what)
               for f in outputs.output_folders(script, cwd)]
    # what the launcher hands ``decide``: the shape the converter read, where the Script carries one
    decision = strategy.decide(getattr(script, "shape", None) or script.text, cwd, "auto", gpu_free=(80 * GiB, 80 * GiB))
    return [repr(shape), repr(folders), decision.summary()]


def digest(path: Path, cwd: Path) -> str:
    from nbddp.convert import convert_notebook
    from nbddp.errors import NbddpError

    try:
        script = convert_notebook(path)
    except NbddpError as exc:
        return "refused " + hashlib.sha256(f"{type(exc).__name__}: {exc}".encode()).hexdigest()[:16]
    parts = [script.text, script.source_map.to_json(), repr(script.installs), repr(script.changes),
             repr(script.warnings), repr(script.whole_model_saves), repr(script.rank0_forwards)]
    launcher = launcher_reads(script, cwd)
    if SPLIT:  # the conversion and what the launcher reads from it, apart: which of the two changed
        return f"{_sha(parts)} {_sha(launcher)}"
    return _sha(parts + launcher)


def _sha(parts: list[str]) -> str:
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()[:16]


#: ``--split``: two digests a notebook, its conversion's and the launcher's reading of it
SPLIT = "--split" in sys.argv


def main() -> None:
    cwd = Path(tempfile.mkdtemp(prefix="nbddp-digest-"))
    for label, path in notebooks():
        print(f"{digest(path, cwd)}  {label}")
    with tarfile.open(PUBLIC / "unsloth_nb.tar.xz") as tar:
        for member in sorted((m for m in tar.getmembers() if m.isfile() and m.name.endswith(".ipynb")),
                             key=lambda m: m.name):
            target = cwd / "unsloth" / member.name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(tar.extractfile(member).read())
            print(f"{digest(target, cwd)}  unsloth:{member.name}")


if __name__ == "__main__":
    sys.exit(main())
