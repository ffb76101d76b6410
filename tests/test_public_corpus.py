"""Real public notebooks, as published, convert into scripts that keep the converter's promises.

``tests/corpus/public/`` holds fine-tuning and training notebooks from several public repositories (each
listed with repository, path and commit in ``MANIFEST.json``; ``collect.py`` says how they were taken) and
the whole ``nb/`` folder of the Unsloth collection, compact, in ``unsloth_nb.tar.xz``. Every one must convert
into a script that compiles without IPython, loads every model on its rank's device, and, where the notebook
trains, finds the training and keeps the work after it on rank 0; the only refusals allowed name the Python
version a cell needs, or a cell that does not parse as published.

The invariants are read with the test's own patterns, as in ``test_corpus.py``. Notebooks the converter
does not yet handle are listed in ``XFAIL`` with the open issue item they wait on: strict, so a fix that
makes one pass shows up and its entry must go.
"""

from __future__ import annotations

import ast
import functools
import io
import json
import re
import tarfile
import tokenize
import warnings
from pathlib import Path

import pytest

from nbddp.convert import convert_notebook
from nbddp.errors import CellError, NotebookError

from test_corpus import ACTION, MODEL_LOADER, TRAINING

PUBLIC = Path(__file__).resolve().parent / "corpus" / "public"
MANIFEST = json.loads((PUBLIC / "MANIFEST.json").read_text())
UNSLOTH_TAR = PUBLIC / "unsloth_nb.tar.xz"

NOTEBOOKS = [e["file"] for e in MANIFEST if e["file"].endswith(".ipynb")]
with tarfile.open(UNSLOTH_TAR) as _tar:
    UNSLOTH = sorted(m.name for m in _tar.getmembers() if m.isfile())

#: Cells that do not parse on any Python as published: refusing them at that cell and line is right.
PUBLISHED_BROKEN = {
    "trl/sft_qwen_vl.ipynb": "cell 32, line 5: not valid Python",  # a missing comma in a call
}

#: Training nbddp does not distribute, refused before launch at its cell and line with what to do instead
#: (issue 28; ``tests/test_frameworks.py`` checks each message).
REFUSED = {
    "hf_notebooks/text_classification-tf.ipynb": "cell 60, line 17: TensorFlow/Keras training",
    "hf_notebooks/text_classification_flax.ipynb": "cell 55, line 10: JAX training",
    "transformers_tutorials/Fine_tune_CANINE_on_IMDb_(movie_review_binary_classification).ipynb":
        "cell 21, line 8: PyTorch Lightning",
    "opacus/building_image_classifier.ipynb": "cell 28, line 5: Opacus",
    # a Kaggle TPU notebook (issue 39): refused before anything runs, at its first torch_xla call
    "pytorch_xla/distributed-pytorch-xla-basics-with-pjrt.ipynb": "cell 10, line 5: TPU notebooks are out of scope",
    # the course's full-batch loops (``model_0(X_train)`` every epoch, no batches): every rank would train on every
    # row, stopped before launch (issue 39; the runtime's first-batches check stopped them after launch before)
    "pytorch_dl/01_pytorch_workflow.ipynb": "cell 40, line 11: this loop trains on all of X_train",
    "pytorch_dl/02_pytorch_classification.ipynb": "cell 52, line 11: this loop trains on all of X_train",
}

#: Unsloth's inference notebooks: chat demos, each prompt one ``model.generate`` call, no loop over prompts to split:
#: refused at their first such call with the loop that would split (before: "no training call found"). Checked with
#: the public corpus's refusals.
ONE_CALL = "nbddp cannot split this prediction over the GPUs: this generate(…) call predicts its whole batch at once"
REFUSED.update({
    "nb/AMD-GPT_OSS_BNB_(20B)-Inference.ipynb": "cell 11, line 14: {}".format(ONE_CALL),
    "nb/AMD-GPT_OSS_MXFP4_(20B)-Inference.ipynb": "cell 11, line 14: {}".format(ONE_CALL),
    "nb/AMD-Llama3.1_(8B)-Inference.ipynb": "cell 12, line 8: {}".format(ONE_CALL),
    "nb/AMD-Qwen2.5_Coder_(1.5B)-Tool_Calling.ipynb": "cell 29, line 1: {}".format(ONE_CALL),
    "nb/GPT_OSS_BNB_(20B)-Inference.ipynb": "cell 11, line 14: {}".format(ONE_CALL),
    "nb/GPT_OSS_MXFP4_(20B)-Inference.ipynb": "cell 10, line 14: {}".format(ONE_CALL),
    "nb/Kaggle-GPT_OSS_BNB_(20B)-Inference.ipynb": "cell 11, line 14: {}".format(ONE_CALL),
    "nb/Kaggle-GPT_OSS_MXFP4_(20B)-Inference.ipynb": "cell 10, line 14: {}".format(ONE_CALL),
    "nb/Kaggle-Llama3.1_(8B)-Inference.ipynb": "cell 11, line 8: {}".format(ONE_CALL),
    "nb/Kaggle-Qwen2.5_Coder_(1.5B)-Tool_Calling.ipynb": "cell 28, line 1: {}".format(ONE_CALL),
    "nb/Llama3.1_(8B)-Inference.ipynb": "cell 11, line 8: {}".format(ONE_CALL),
    "nb/Qwen2.5_Coder_(1.5B)-Tool_Calling.ipynb": "cell 28, line 1: {}".format(ONE_CALL),
})

#: A refusal that names the Python version a cell needs (issue 18, item 10).
NEEDS_PYTHON = re.compile(r"Python 3\.\d+")

#: Training that the test recognises besides ``test_corpus.TRAINING``: a helper module's loop or step (pytorch_dl's
#: ``going_modular.engine``), a launcher.
MORE_TRAINING = re.compile(r"\bengine\.train\(|\btrain_step\(|\bnotebook_launcher\(")

#: Calls every rank must make, which nbddp leaves on every rank on purpose ("needs every rank").
COLLECTIVE = re.compile(r"\.(evaluate|predict)\(")

#: Notebook → the open issue item it waits on. Strict xfails: remove an entry when its fix lands.
XFAIL: dict[str, str] = {}

#: Unsloth notebook (``nb/…`` in the archive) → the open issue item it waits on; strict, as above. Empty now:
#: the Colab form cells (issue 18 item 1), the notebooks Jupyter opens that nbformat's schema rejects (item 2)
#: and the cells that parse from Python 3.12 only (item 10, refused naming the version) all pass.
UNSLOTH_XFAIL: dict[str, str] = {}


@pytest.fixture(scope="module")
def unsloth_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("unsloth")
    with tarfile.open(UNSLOTH_TAR) as tar:
        tar.extractall(folder, filter="data")
    return folder


@functools.cache
def outcome(path: Path):
    """The converted script, or the error the converter refused the notebook with."""
    try:
        return convert_notebook(path)
    except (CellError, NotebookError) as exc:
        return exc


def with_xfail(names, known):
    return [pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=known[n])) if n in known else n
            for n in names]


# ------------------------------------------------------------------------------------------ the invariants
# The patterns are test_corpus.py's; the script is read with ``ast`` here (libcst would take six times as long
# as the conversion itself, over five hundred notebooks).


class Script:
    """A converted script as the checks read it: its text, its ast, its top-level statements' code."""

    def __init__(self, text: str):
        self.text = text
        self.lines = text.splitlines()
        with warnings.catch_warnings():  # published cells hold invalid escapes ("\\,"): not the script's fault
            warnings.simplefilter("ignore", (DeprecationWarning, SyntaxWarning))
            compile(text, "script.py", "exec")
            self.tree = ast.parse(text)
        self.code = "\n".join(ln for ln in self.lines if not ln.lstrip().startswith("#"))

    def segment(self, node: ast.AST) -> str:
        return ast.get_source_segment(self.text, node) or ""

    def top_level(self) -> list[tuple[ast.stmt, str]]:
        """The top-level statements with their code, outside nbddp's setup and cleanup."""
        out = []
        for stmt in self.tree.body:
            code = "\n".join(self.lines[stmt.lineno - 1 : stmt.end_lineno]).strip()
            if "_nbddp.setup()" not in code and "_nbddp.cleanup()" not in code:
                out.append((stmt, code))
        return out

    def calls(self) -> list[ast.Call]:
        """Every call, except those inside ``if False:`` (the installs nbddp pulled out)."""
        found = []

        class Visitor(ast.NodeVisitor):
            def visit_If(self, node):
                if not (isinstance(node.test, ast.Constant) and node.test.value is False):
                    self.generic_visit(node)

            def visit_Call(self, node):
                found.append(node)
                self.generic_visit(node)

        Visitor().visit(self.tree)
        return found


def dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = dotted(node.value)
        return f"{base}.{node.attr}" if base else node.attr
    return ""


def check_script(text: str, trains: bool) -> None:
    script = Script(text)
    check_model_loaders(script)
    check_set_epoch(script)
    assert not re.search(r"""["']cuda:0["']""", script.code)
    assert "get_ipython(" not in script.code, "the script runs without IPython"
    assert "notebook_launcher(" not in script.code, "a launcher inside the ranks starts nested jobs"
    check_models_wrapped(without_strings(script.code))
    if trains:  # an inference notebook has no training to find, nor a tail after it
        check_rank_zero_tail(script)


def check_model_loaders(script: Script) -> None:
    """Every model loader loads on this rank's device; tokenizers and configs are left alone."""
    for call in script.calls():
        name = dotted(call.func)
        if name.endswith(".from_pretrained") and MODEL_LOADER.search(name.rsplit(".", 1)[0]):
            maps = [script.segment(k.value) for k in call.keywords if k.arg == "device_map"]
            assert maps == ["_nbddp.device_map()"], script.segment(call)
        elif re.search(r"(Tokenizer|Processor|Config)\w*\.from_pretrained$", name):
            assert "_nbddp" not in script.segment(call), script.segment(call)


#: An optimizer over one model's parameters, in a plain loop: ``torch.optim.AdamW(model.parameters(), …)``.
OPTIMIZER = re.compile(r"torch\.optim\.\w+\(\s*(?:params\s*=\s*)?(\w+)\.parameters\(\)")


def without_strings(code: str) -> str:
    """``code`` with every string literal emptied: a ``%%writefile`` cell's script is text the notebook writes
    (its training runs launched, each rank its own), not code of the converted notebook."""
    lines = code.splitlines(keepends=True)
    starts = [0]
    for line in lines:
        starts.append(starts[-1] + len(line))
    spans = [(starts[t.start[0] - 1] + t.start[1], starts[t.end[0] - 1] + t.end[1])
             for t in tokenize.generate_tokens(io.StringIO(code).readline) if t.type == tokenize.STRING]
    for begin, end in reversed(spans):
        code = code[:begin] + '""' + code[end:]
    return code


def check_models_wrapped(code: str) -> None:
    """Every model an optimizer updates is wrapped for DDP (by nbddp or by accelerate), or its gradients
    would not be synchronised and the replicas would drift apart."""
    for name in sorted(set(OPTIMIZER.findall(code))):
        wrapped = re.search(r"_nbddp\.ddp\(\s*%s\b" % name, code) or re.search(r"\.prepare\([^)]*\b%s\b" % name, code)
        assert wrapped, f"{name} trains without DDP"


def check_set_epoch(script: Script) -> None:
    """``set_epoch`` is added only for loaders that have a DistributedSampler (``--explain`` says so)."""
    sharded: dict[str, bool] = {}
    for node in ast.walk(script.tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) \
                and dotted(node.value.func).split(".")[-1] == "DataLoader":
            has = "_nbddp.distributed_sampler(" in script.segment(node.value)
            for target in node.targets:
                if isinstance(target, ast.Name):
                    sharded[target.id] = sharded.get(target.id, False) or has
    for call in script.calls():
        if dotted(call.func) == "_nbddp.set_epoch" and call.args and isinstance(call.args[0], ast.Name):
            name = call.args[0].id
            assert sharded.get(name, True), f"set_epoch({name}) for a loader without a DistributedSampler"


def check_rank_zero_tail(script: Script) -> None:
    """After the last training statement, saving/printing/generating runs on rank 0 only."""
    stmts = script.top_level()
    defs = {s.name: code for s, code in stmts if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef))}
    trainers = {name for name, code in defs.items() if TRAINING.search(code) or MORE_TRAINING.search(code)}
    while True:  # a function that calls a training function trains too
        calling = re.compile(r"\b(%s)\(" % "|".join(map(re.escape, trainers))) if trainers else None
        more = {name for name, code in defs.items() if calling and calling.search(code)} - trainers
        if not more:
            break
        trainers |= more
    definition = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)

    def trains(stmt, code):
        if isinstance(stmt, definition):
            return False
        return bool(TRAINING.search(code) or MORE_TRAINING.search(code) or (calling and calling.search(code)))

    last = max((i for i, (s, code) in enumerate(stmts) if trains(s, code)), default=None)
    assert last is not None, "a training statement"
    for stmt, code in stmts[last + 1 :]:
        if isinstance(stmt, definition) or COLLECTIVE.search(code):
            continue  # defining is not doing; collectives stay on every rank on purpose
        if ACTION.search(code):
            assert code.startswith("if _nbddp.on_rank0():"), code


def code_of(path: Path) -> str:
    """The notebook's code, less the ``%%writefile`` cells: their text is a script's, which a shell line runs
    (a training loop there is the launched command's, issue 28)."""
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    sources = ("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    return "\n".join(s for s in sources if not s.lstrip().startswith("%%writefile"))


def check(path: Path, key: str) -> None:
    """The notebook converts and keeps the promises, or is refused only for a cause the notebook holds."""
    result = outcome(path)
    source = code_of(path)
    if key in PUBLISHED_BROKEN or key in REFUSED:
        expected = PUBLISHED_BROKEN.get(key) or REFUSED[key]
        assert isinstance(result, CellError) and str(result).startswith(expected), result
        return
    if isinstance(result, Exception):
        assert isinstance(result, CellError) and NEEDS_PYTHON.search(str(result)), f"refused: {result}"
        return
    trains = bool(TRAINING.search(source) or MORE_TRAINING.search(source))
    if trains:
        assert not [w for w in result.warnings if "no training call found" in w], result.warnings
    check_script(result.text, trains)


# ------------------------------------------------------------------------------------------------ tests


def test_the_corpus_is_what_the_manifest_lists():
    assert len(NOTEBOOKS) >= 60 and len({e["repository"] for e in MANIFEST}) >= 5
    assert sorted(NOTEBOOKS) == sorted(str(p.relative_to(PUBLIC)) for p in PUBLIC.glob("*/*.ipynb"))
    for entry in MANIFEST:
        assert re.fullmatch(r"[0-9a-f]{40}", entry["commit"]) and entry["repository"] and entry["path"]
    unsloth = next(e for e in MANIFEST if e["file"] == "unsloth_nb.tar.xz")
    assert unsloth["notebooks"] == len(UNSLOTH) >= 400
    assert all(n.startswith("nb/") and n.endswith(".ipynb") for n in UNSLOTH)
    assert set(XFAIL) <= set(NOTEBOOKS) and set(PUBLISHED_BROKEN) | set(REFUSED) <= set(NOTEBOOKS) | set(UNSLOTH)
    assert set(UNSLOTH_XFAIL) <= set(UNSLOTH)


@pytest.mark.parametrize("key", with_xfail(NOTEBOOKS, XFAIL))
def test_public_notebook_converts_and_keeps_the_promises(key):
    check(PUBLIC / key, key)


@pytest.mark.parametrize("name", with_xfail(UNSLOTH, UNSLOTH_XFAIL))
def test_unsloth_notebook_converts_and_keeps_the_promises(unsloth_dir, name):
    check(unsloth_dir / name, name)
