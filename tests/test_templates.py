"""The papermill templates: generated consistently, parameters papermill can list, and real runs
(papermill's engine and a python3 kernel → nbddp → torchrun → 2 gloo ranks)."""

import importlib.util
import shutil
import subprocess
import sys

import nbformat
import pytest

from conftest import ROOT
from nbddp.convert import convert_notebook
from nbddp.errors import NbddpError, NotebookError
from nbddp.template import run_template

papermill = pytest.importorskip("papermill", reason="the templates are papermill notebooks")

TEMPLATES = ROOT / "templates"
NAMES = ("sft_lora", "qlora_4bit", "torch_classifier")
REQUIRED = ("model_name", "max_seq_length", "lora_r", "learning_rate", "max_steps", "nproc", "data_path",
            "output_dir", "precision")


@pytest.mark.e2e
def test_committed_templates_are_what_build_py_writes():
    proc = subprocess.run([sys.executable, str(TEMPLATES / "build.py"), "--check"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("name", NAMES)
def test_parameters_are_typed_and_explained_for_papermill(name):
    nb = nbformat.read(str(TEMPLATES / f"{name}.ipynb"), as_version=4)
    nbformat.validate(nb)
    assert len([c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]) == 1
    params = papermill.inspect_notebook(str(TEMPLATES / f"{name}.ipynb"))
    for p in REQUIRED:
        assert p in params, f"{p} missing from {name}"
        assert params[p]["inferred_type_name"] in ("str", "int", "float", "bool") and params[p]["help"]
    assert params["model_name"]["default"] == '""' and params["nproc"]["default"] == "0"


@pytest.mark.parametrize("name", NAMES)
def test_nbddp_run_leaves_the_launch_cell_out(name):
    script = convert_notebook(TEMPLATES / f"{name}.ipynb")
    assert "run_template" not in script.text
    assert "max_steps: int = " in script.text  # the parameters cell is code like any other


def test_run_template_says_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(NotebookError, match="--cwd"):
        run_template("sft_lora.ipynb", {})
    shutil.copy(TEMPLATES / "sft_lora.ipynb", tmp_path)
    with pytest.raises(NbddpError, match="parameters not set in this kernel: .*max_steps"):
        run_template("sft_lora.ipynb", {"model_name": ""})


SMALL = dict(max_steps=4, batch_size=8, max_seq_length=24)


def run_with_papermill(name, tmp_path, monkeypatch, **parameters):
    """Execute a copy of the template the way a user would: papermill, the python3 kernel, its folder as cwd."""
    monkeypatch.setenv("PYTHONPATH", str(ROOT / "src"))  # the kernel (and so the ranks) import this nbddp
    src = shutil.copy(TEMPLATES / f"{name}.ipynb", tmp_path)
    out = tmp_path / f"{name}.out.ipynb"
    papermill.execute_notebook(str(src), str(out), parameters=parameters, kernel_name="python3",
                               cwd=str(tmp_path), progress_bar=False)
    nb = nbformat.read(str(out), as_version=4)
    for cell in nb.cells:  # the kernel itself did not train: papermill skipped those cells
        if "skip-execution" in cell.metadata.get("tags", []):
            assert cell.outputs == [] and cell.execution_count is None
    launch = nb.cells[-1]
    streamed = "".join(o.get("text", "") for o in launch.outputs)
    (run_dir,) = (tmp_path / "nbddp_runs").iterdir()
    rank1 = next(run_dir.glob("logs/*/attempt_0/1/stdout.log")).read_text()
    return streamed, rank1


@pytest.mark.e2e
@pytest.mark.parametrize("name", ["sft_lora", "qlora_4bit"])
def test_trainer_templates_train_with_ddp_on_two_ranks(name, tmp_path, monkeypatch):
    if name == "qlora_4bit" and importlib.util.find_spec("bitsandbytes") is None:
        pytest.skip("bitsandbytes is not installed: the template's 4-bit layers need it (pip install bitsandbytes)")
    streamed, rank1 = run_with_papermill(name, tmp_path, monkeypatch, **SMALL)
    assert "nbddp: 2 process(es), backend gloo" in streamed
    # The Trainer itself ran as one DDP job of two processes (its world size), to the last step.
    assert "4 steps on 2 processes" in streamed and "nbddp: finished in" in streamed
    assert "trainable params" in rank1 and "adapter saved" not in rank1  # rank 1 trained; rank 0 alone saved
    if name == "qlora_4bit":
        assert "transformers loader, 28 linear layers in 4 bits" in streamed  # 2 layers x 7 projections, NF4
    assert (tmp_path / "outputs" / name / "adapter_model.safetensors").exists()


@pytest.mark.e2e
def test_plain_pytorch_template_trains_on_two_ranks(tmp_path, monkeypatch):
    streamed, rank1 = run_with_papermill("torch_classifier", tmp_path, monkeypatch, max_steps=6, batch_size=16)
    assert "nbddp: 2 process(es), backend gloo" in streamed
    assert "rank 0/2: 6 steps, 96 examples" in streamed and "step 6/6" in streamed
    # rank 1 took its own half of the rows (2048 / (16 × 2)) in the same DDP job; its closing print, after the
    # training loop, is rank 0's alone in the converted script
    assert "64 batches per process and epoch" in rank1 and "Traceback" not in rank1
    assert (tmp_path / "outputs" / "torch_classifier" / "adapter_model.safetensors").exists()
