"""Property: whatever options and notebook a person gives ``nbddp convert`` and ``nbddp run``, the answer is a
clear message (or a script), never nbddp's traceback nor an internal error, and a refusal leaves nothing
behind. Random option values and mutated notebooks (truncated, binary, NUL bytes, huge cells, JSON values of
the wrong type, odd nbformat versions) go through ``nbddp.cli.main`` in this process; a ``run`` that passes
every check would launch torchrun, so the launch is replaced by torchrun's own check of its command line
(``config_from_args``: what it would refuse with a traceback must have been refused before) and a marker
(``WouldLaunch``): what is tested is everything up to the launch. Derandomized and bounded, so it is the same
quick test on every machine."""

from __future__ import annotations

import contextlib
import io
import json
import os
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import nbddp.launch
from nbddp import cli

BASE = {
    "cells": [
        {"cell_type": "markdown", "metadata": {}, "source": "# a notebook"},
        {"cell_type": "code", "execution_count": 1, "metadata": {}, "outputs": [],
         "source": "import torch\nfrom transformers import AutoModelForCausalLM, TrainingArguments, Trainer\n"},
        {"cell_type": "code", "execution_count": 2, "metadata": {}, "outputs": [],
         "source": "model = AutoModelForCausalLM.from_pretrained('tiny')\n"
                   "args = TrainingArguments(output_dir='out', per_device_train_batch_size=2)\n"},
        {"cell_type": "code", "execution_count": 3, "metadata": {}, "outputs": [],
         "source": "trainer = Trainer(model=model, args=args)\ntrainer.train()\nmodel.save_pretrained('out/final')\n"},
    ],
    "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
    "nbformat": 4,
    "nbformat_minor": 5,
}
for n, cell in enumerate(BASE["cells"]):
    cell["id"] = f"c{n}"

SETTINGS = settings(derandomize=True, max_examples=60, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                                       max_size=3), max_leaves=6)


#: A whole file's JSON with no notebook's shape: a top-level list or value, ``cells`` of the wrong kind, cells that
#: are no objects.
SHAPES = st.one_of(
    st.sampled_from([[BASE], BASE["cells"], "notebook", 4, None, True, {}]),
    st.builds(lambda cells: {**BASE, "cells": cells}, st.one_of(json_values, st.lists(json_values, max_size=3))),
)
#: A cell magic's first line, quoting as a person mistypes it (an unclosed quote: IPython refuses the cell).
MAGIC_LINES = st.builds("{}{}".format, st.sampled_from(["writefile", "writefile -a", "bash", "script", "capture"]),
                        st.sampled_from(["", " 'train.py", ' "train.py', " train.py'", " 'a b.py'", " \\", " -a",
                                         " 'x' 'y", " train.py"]))


@st.composite
def notebooks(draw) -> bytes:
    """A notebook's bytes: the base one, mutated one way."""
    nb = json.loads(json.dumps(BASE))
    kind = draw(st.sampled_from(["as is", "truncated", "binary", "nul", "huge", "bad type", "nbformat", "source",
                                 "shape", "cell type and metadata", "magic line"]))
    if kind == "binary":
        return draw(st.binary(max_size=200))
    if kind == "shape":  # the file's JSON is no notebook's shape: nbformat's reader fails on these with a Python error
        return json.dumps(draw(SHAPES)).encode()
    if kind == "nul":
        cell = nb["cells"][draw(st.integers(1, 3))]
        at = draw(st.integers(0, len(cell["source"])))
        cell["source"] = cell["source"][:at] + "\x00" + cell["source"][at:]
    elif kind == "huge":
        if draw(st.booleans()):  # many lines, or one long one
            nb["cells"][2]["source"] += "\n".join(["x = 1", "print('a' * 10)"] * draw(st.integers(200, 600)))
        else:
            nb["cells"][2]["source"] += "s = '" + "y" * draw(st.integers(10**5, 10**6)) + "'\n"
    elif kind == "bad type":
        target = draw(st.sampled_from(["cells", "metadata", "cell", "source", "cell_type", "outputs", "id"]))
        value = draw(json_values)
        if target in ("cells", "metadata"):
            nb[target] = value
        elif target == "cell":
            nb["cells"][draw(st.integers(0, 3))] = value
        else:
            nb["cells"][draw(st.integers(0, 3))][target] = value
    elif kind == "cell type and metadata":  # nbformat's validator fails on a cell type it cannot add "_cell" to
        nb["cells"][draw(st.integers(0, 3))]["cell_type"] = draw(json_values.filter(lambda v: not isinstance(v, str)))
        nb["metadata"][draw(st.sampled_from(["kernelspec", "language_info"]))] = draw(json_values)
    elif kind == "magic line":
        nb["cells"][draw(st.integers(1, 3))]["source"] = f"%%{draw(MAGIC_LINES)}\nprint('body')\n"
    elif kind == "nbformat":
        nb["nbformat"] = draw(st.sampled_from([0, 1, 2, 3, 5, 99, -1, "4", None, 4.0, [4]]))
        nb["nbformat_minor"] = draw(st.sampled_from([0, 4, 5, 99, -1, "5", None]))
    elif kind == "source":
        nb["cells"][draw(st.integers(1, 3))]["source"] = draw(st.text(max_size=80))
    data = json.dumps(nb).encode()
    if kind == "truncated":
        return data[: draw(st.integers(0, len(data) - 1))]
    return data


#: Paths an option may name, relative to the example's folder (``{}``): a folder, nothing, a place nothing can be
#: written, under a file, with a NUL byte, deep and new, a FIFO (made by the convert test).
PATHS = st.sampled_from(["", " ", ".", "{}", "{}/sub", "/proc/x.py", "/proc/nope/deeper", "{}/nb.ipynb/x.py",
                         "{}/new/deep/train.py", "a\x00b.py", "{}/" + "n" * 300, "~/x", "train.py", "{}/pipe"])
NUMBERS = st.sampled_from(["0", "-1", "1", "2", "64", "100000", "nan", "inf", "-inf", "1e309", "2.5", "x", "", " 3",
                           "auto", "0x10"])


@st.composite
def run_options(draw, folder: str) -> list[str]:
    argv = []
    for flag in draw(st.lists(st.sampled_from(["--nproc", "--timeout", "--collective-timeout", "--nnodes",
                                               "--node-rank", "--rdzv-endpoint", "--runs-dir", "--strategy", "--env",
                                               "--shim", "--no-shim", "--skip-bad-cells", "--resume"]),
                              max_size=4)):
        if flag in ("--skip-bad-cells", "--resume"):
            argv.append(flag)
        elif flag == "--runs-dir":
            argv += [flag, draw(PATHS).format(folder)]
        elif flag == "--rdzv-endpoint":
            argv += [flag, draw(st.sampled_from(["host:29500", "host:99999", ":1", "host", "a b:1", "", "h:0"]))]
        elif flag == "--strategy":
            argv += [flag, draw(st.sampled_from(["auto", "ddp", "fsdp", "split", "deepspeed", "zero", ""]))]
        elif flag == "--env":
            argv += [flag, draw(st.sampled_from(["A=1", "=1", "A", "", "A==", " =x"]))]
        elif flag in ("--shim", "--no-shim"):
            argv += [flag, draw(st.sampled_from(["grad_ckpt", "nope", ""]))]
        else:
            argv += [flag, draw(NUMBERS)]
    if draw(st.booleans()):
        argv += ["--", draw(st.sampled_from(["--master-port=0", "--master-port=x", "--master-port=70000",
                                             "--nnodes=0", "--max-restarts=1"]))]
    return argv


class WouldLaunch(BaseException):
    """Raised where torchrun would start: a BaseException, so that nbddp's guard lets it through."""


def answer(argv: list[str], cwd: str) -> tuple[object, str]:
    """``nbddp ARGV`` in this process, in ``cwd`` (relative paths stay in the example's folder): (exit code, or
    "launch"; what it printed)."""
    out, err = io.StringIO(), io.StringIO()
    back, runs = os.getcwd(), os.environ.get("NBDDP_RUNS")
    os.environ["NBDDP_RUNS"] = os.path.join(cwd, "nbddp_runs")  # a launch's run directory, in the example's folder
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = cli.main(argv)
    except SystemExit as exc:  # argparse: usage and one error line
        code = exc.code
    except WouldLaunch:
        code = "launch"
    finally:
        os.chdir(back)
        os.environ.pop("NBDDP_RUNS") if runs is None else os.environ.update(NBDDP_RUNS=runs)
    return code, err.getvalue() + out.getvalue()


#: Python's own words for a type error: in a message, nbddp passed on a failure instead of saying what is wrong.
PYTHON_WORDS = ("object has no attribute", "unsupported operand", "can only concatenate", "not subscriptable",
                "dictionary update sequence")


def assert_clear(code, said: str, folder: Path, before: set[str]) -> None:
    assert "Traceback" not in said and "internal error" not in said, said[-3000:]
    assert not any(words in said for words in PYTHON_WORDS), said[-3000:]
    assert code in (0, 2, "launch"), (code, said[-3000:])
    if code == 2:
        errors = [ln for ln in said.splitlines() if ln.startswith("nbddp: error: ") or ": error: " in ln]
        assert errors, said[-3000:]
        assert set(os.listdir(folder)) == before, said  # a refusal leaves nothing behind


def torchrun_accepts(plan, *args, **kwargs):
    """In place of ``launch``: torchrun's own parser and checks on the command line nbddp would start
    (``python -m nbddp.agent TORCHRUN_ARGS… SCRIPT``), then ``WouldLaunch``."""
    from torch.distributed.run import config_from_args, get_args_parser

    environ = dict(os.environ)  # config_from_args sets OMP_NUM_THREADS for the ranks
    try:
        config_from_args(get_args_parser().parse_args(list(plan.argv[3:])))
    except SystemExit as exc:
        raise AssertionError(f"torchrun would refuse {plan.argv[3:]} (exit {exc.code})") from None
    finally:
        os.environ.clear()
        os.environ.update(environ)
    raise WouldLaunch()


@pytest.fixture(autouse=True)
def no_launch(monkeypatch):
    monkeypatch.setattr(nbddp.launch, "launch", torchrun_accepts)


@settings(SETTINGS, max_examples=200)  # converting is quick: more of the notebook's shapes
@given(data=st.data(), notebook=notebooks())
def test_convert_answers_any_notebook_and_output_path_clearly(data, notebook):
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "nb.ipynb").write_bytes(notebook)
        os.mkfifo(folder / "pipe")  # -o naming a FIFO: refused, never replaced by a file (nor written, blocking)
        argv = ["convert", str(folder / "nb.ipynb")]
        if data.draw(st.booleans()):
            argv += ["-o", data.draw(PATHS).format(tmp)]
        argv += data.draw(st.lists(st.sampled_from(["--explain", "--diff", "--skip-bad-cells"]), max_size=2,
                                   unique=True))
        before = set(os.listdir(folder))
        code, said = answer(argv, tmp)
        assert code != "launch"
        assert_clear(code, said, folder, before)


@SETTINGS
@given(data=st.data(), notebook=st.one_of(st.just(json.dumps(BASE).encode()), notebooks()))
def test_run_answers_any_notebook_and_options_clearly_before_launch(data, notebook):
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "nb.ipynb").write_bytes(notebook)
        argv = ["run", str(folder / "nb.ipynb"), *data.draw(run_options(tmp))]
        before = set(os.listdir(folder))
        code, said = answer(argv, tmp)
        assert_clear(code, said, folder, before)
