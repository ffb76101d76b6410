"""Kaggle export: metadata checked by the kaggle package's own push code, secrets, and a real self-launch."""

import contextlib
import json
import os
import subprocess
import sys
import types

import nbformat
import pytest

from conftest import QUICKSTART, ROOT, write_notebook
from nbddp.cells import cells_from_sources
from nbddp.errors import NbddpError, SecretError
from nbddp.export import export_kaggle
from nbddp.export.kaggle import kernel_metadata
from nbddp.export.secrets import find_secrets


def nbddp_cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "nbddp.cli", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"})


def kaggle_push(folder, capsys):
    """Run ``KaggleApi.kernels_push`` on the folder, every check of it, with only the upload replaced.

    Returns the ``ApiSaveKernelRequest`` it would have sent and what it printed.
    """
    pytest.importorskip("kaggle", reason="the kaggle package (its metadata checks) is not installed")
    from kaggle.api import kaggle_api_extended as kaggle_api
    sent = []
    client = types.SimpleNamespace(
        kernels=types.SimpleNamespace(kernels_api_client=types.SimpleNamespace(save_kernel=sent.append))
    )
    api = kaggle_api.KaggleApi()
    api.build_kaggle_client = lambda: contextlib.nullcontext(client)
    capsys.readouterr()
    api.kernels_push(str(folder))
    (request,) = sent
    return request, capsys.readouterr().out


def test_kaggle_push_accepts_the_export(tmp_path, capsys):
    out = tmp_path / "kernel"
    result = export_kaggle(QUICKSTART, out, kernel_id="someone/nbddp-quickstart-ddp", datasets=["someone/sums"])
    request, printed = kaggle_push(out, capsys)
    assert "does not resolve" not in printed  # the title slugs to the id, by kaggle's own slugify
    assert request.slug == "someone/nbddp-quickstart-ddp" and request.new_title == "Nbddp Quickstart Ddp"
    assert (request.language, request.kernel_type) == ("python", "script")
    assert request.enable_gpu and request.machine_shape == "NvidiaTeslaT4" and request.is_private
    assert request.dataset_data_sources == ["someone/sums"]
    assert request.text == result.script.read_text()
    assert json.loads(result.metadata_file.read_text())["code_file"] == "nbddp-quickstart-ddp.py"


def test_public_cpu_kernel_with_a_title(tmp_path, capsys):
    out = tmp_path / "kernel"
    export_kaggle(QUICKSTART, out, kernel_id="someone/my-sft-run", title="My SFT run!", accelerator="none",
                  private=False)
    request, printed = kaggle_push(out, capsys)
    assert request.new_title == "My SFT run!" and "does not resolve" not in printed
    assert not request.enable_gpu and not request.machine_shape and request.is_private is False


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(kernel_id="no-slash"), "USER/SLUG"),
        (dict(kernel_id="me/Upper_Case"), "USER/SLUG"),
        (dict(kernel_id="me/run-one", title="Another name"), "slug 'another-name', not 'run-one'"),
        (dict(kernel_id="me/abc"), "at least five"),
        (dict(kernel_id="me/run-one", accelerator="A100"), "not one of"),
        (dict(kernel_id="me/run-one", datasets=["just-a-name"]), "OWNER/DATASET-SLUG"),
    ],
)
def test_metadata_kaggle_would_refuse_is_refused_here(kwargs, words):
    with pytest.raises(NbddpError, match=words):
        kernel_metadata(code_file="x.py", **kwargs)


TOKENS = {
    "Hugging Face token": 'login(token="hf_' + "aB3dE5fG7hJ9kL1mN3pQ5rS7tU9vW1xY3z" + '")',
    "Weights & Biases API key": 'wandb.login(key="' + "0123456789abcdef" * 2 + "01234567" + '")',
    "OpenAI-style API key": 'client = OpenAI(api_key="sk-proj-' + "Ab1Cd2Ef3Gh4Ij5Kl6Mn7Op8" + '")',
    "Kaggle API key": 'os.environ["KAGGLE_KEY"] = "' + "0123456789abcdef" * 2 + '"',
    "GitHub token": "!git clone https://ghp_" + "A1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q7r8" + "@github.com/me/repo",
    "credential": '%env MY_SERVICE_TOKEN=' + "Zx9Yw8Vu7Ts6Rq5Po4",
}


@pytest.mark.parametrize("kind", TOKENS)
def test_each_kind_of_token_is_found_at_its_cell_and_line(kind):
    cells = cells_from_sources(["import os", f"x = 1\n{TOKENS[kind]}\ny = 2"])
    (finding,) = find_secrets(cells)
    assert (finding.cell, finding.line, finding.kind) == (2, 2, kind)
    assert "…" in finding.masked


def test_ordinary_code_is_not_a_secret():
    cells = cells_from_sources([
        'tokenizer = AutoTokenizer.from_pretrained("unsloth/Llama-3.2-1B-Instruct")\n'
        'tokenizer.pad_token = "<|finetune_right_pad_id|>"\n'
        'hf_token = UserSecretsClient().get_secret("HF_TOKEN")\n'
        'eos_token = "</s>"\n'
        'model.push_to_hub("me/llama-3.2-1b-sums-lora", token=hf_token)\n'
        'run_name = "sft-lora-r16-lr2e-4-steps60"\n'
    ])
    assert find_secrets(cells) == []


@pytest.mark.e2e
def test_export_stops_at_a_secret_and_shows_the_kaggle_way(tmp_path):
    nb = write_notebook(tmp_path / "nb.ipynb", ["import os", TOKENS["Hugging Face token"]], markdown_first=True)
    with pytest.raises(SecretError) as info:
        export_kaggle(nb, tmp_path / "out", kernel_id="me/run-one")
    assert (info.value.cell, info.value.line) == (3, 1)
    assert not (tmp_path / "out").exists()  # nothing written
    proc = nbddp_cli("export", nb, "--kaggle", tmp_path / "out", "--id", "me/run-one")
    assert proc.returncode == 2
    assert "cell 3, line 1: a Hugging Face token" in proc.stderr
    assert 'UserSecretsClient().get_secret("HF_TOKEN")' in proc.stderr and "--allow-secrets" in proc.stderr
    assert "aB3dE5fG7hJ9" not in proc.stderr  # the message itself does not repeat the token
    proc = nbddp_cli("export", nb, "--kaggle", tmp_path / "out", "--id", "me/run-one", "--allow-secrets",
                     "--every-rank",  # the notebook has no training call: it only holds a secret
                     "--public", "--accelerator", "NvidiaTeslaP100", "--dataset", "me/sums", "--dataset", "me/more")
    assert proc.returncode == 0, proc.stderr
    assert "kaggle kernels push -p" in proc.stderr and (tmp_path / "out" / "run-one.py").exists()
    meta = json.loads((tmp_path / "out" / "kernel-metadata.json").read_text())
    assert meta["is_private"] is False and meta["machine_shape"] == "NvidiaTeslaP100"
    assert meta["dataset_sources"] == ["me/sums", "me/more"]


def test_cells_tagged_nbddp_skip_are_not_exported(tmp_path):
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("a = 1"),
        nbformat.v4.new_code_cell("launch_everything()", metadata={"tags": ["nbddp-skip"]}),
    ])
    nbformat.write(nb, str(tmp_path / "nb.ipynb"))
    result = export_kaggle(tmp_path / "nb.ipynb", tmp_path / "out", kernel_id="me/run-one",
                           every_rank=True)  # no training call: exported only as asked, as nbddp run runs it
    text = result.script.read_text()
    assert "a = 1" in text and "launch_everything" not in text


@pytest.mark.e2e
def test_exported_script_launches_itself_on_two_ranks(tmp_path):
    """``python script.py`` as Kaggle runs it: installs once, torchrun on itself, 2 gloo ranks train."""
    nb = nbformat.read(str(QUICKSTART), as_version=4)
    imports = next(c for c in nb.cells if "from trl import" in c.source)
    imports.source += "\nimport nbddp.runtime\nprint('runtime from', nbddp.runtime.__file__, flush=True)"
    train_args = next(c for c in nb.cells if "max_steps=60" in c.source)
    train_args.source = (
        train_args.source.replace("max_steps=60", "max_steps=12").replace("logging_steps=5", "logging_steps=3")
        # without GPUs, accelerate runs the Trainer's DDP over CPU processes only when told to
        .replace('report_to="none",', 'report_to="none",\n    use_cpu=not torch.cuda.is_available(),')
    )
    nb.cells.append(nbformat.v4.new_code_cell("print('trainer world size', training_args.world_size)"))
    nbformat.write(nb, str(tmp_path / "quickstart.ipynb"))
    result = export_kaggle(tmp_path / "quickstart.ipynb", tmp_path / "kernel", kernel_id="me/quickstart-ddp")

    work = tmp_path / "working"  # Kaggle runs the script with /kaggle/working as its working directory
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "NBDDP_NPROC")}
    proc = subprocess.run([sys.executable, str(result.script)], cwd=work, env=env, capture_output=True, text=True,
                          timeout=500)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert out.count("nbddp: installing: ") == 1  # the notebook's install ran once, before launch
    assert "nbddp: 2 process(es), backend gloo" in out
    assert "trainer world size 2" in out  # one DDP job of two processes
    assert "Adapter saved to outputs/lora_adapter" in out
    assert (work / "outputs" / "lora_adapter" / "adapter_model.safetensors").exists()
    (run,) = (work / "nbddp_logs").iterdir()
    rank0, rank1 = (next(run.glob(f"attempt_0/{r}/stdout.log")).read_text() for r in (0, 1))
    for log in (rank0, rank1):  # each rank imported the runtime carried inside the script, not an installed one
        assert ".zip/nbddp/runtime/__init__.py" in log
    assert "trainable params" in rank1 and "Adapter saved" not in rank1


def test_the_export_takes_the_run_options_from_the_run_table(tmp_path):
    """``nbddp export`` and ``%ddp_export`` take the run options of ``nbddp run`` (one table,
    ``options.RUN_OPTIONS``), and the exported kernel's launcher sets what they say for torchrun and the ranks."""
    import argparse

    from nbddp.export.options import NOT_EXPORTED, OPTIONS, export_options
    from nbddp.options import RUN_OPTIONS, SHIM_NAMES, STRATEGIES, dest
    from nbddp.runtime.apply_strategy import STRATEGIES as RANK_STRATEGIES

    assert STRATEGIES == ("auto", *RANK_STRATEGIES)  # spelled once, in the runtime
    run_rows = [o for o in RUN_OPTIONS if dest(o) not in NOT_EXPORTED]
    assert all(row in OPTIONS for row in run_rows) and len(run_rows) >= len(RUN_OPTIONS) - 2
    parser = argparse.ArgumentParser()
    for flags, keywords in OPTIONS:
        parser.add_argument(*flags, **keywords)
    out = tmp_path / "kernel"
    args = parser.parse_args(["--kaggle", str(out), "--id", "me/run-one", "--env", "MY_SETTING=7", "--shim",
                              SHIM_NAMES[0], "--collective-timeout", "60", "--resume", "--nproc", "1",
                              "--strategy", "ddp"])
    nb = write_notebook(tmp_path / "nb.ipynb", ["import torch\nmodel = torch.nn.Linear(2, 1)\n"
                                                 "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
                                                 "loss = model(torch.ones(2)).sum()\nloss.backward()\nopt.step()"])
    text = export_kaggle(nb, args.kaggle, **export_options(args)).script.read_text()
    for line in ('os.environ.setdefault("MY_SETTING", "7")', f'os.environ.setdefault("NBDDP_SHIM_{SHIM_NAMES[0].upper()}", "1")',
                 'os.environ.setdefault("NBDDP_TIMEOUT", "60")', 'os.environ.setdefault("NBDDP_RESUME", "1")',
                 'os.environ.setdefault("NBDDP_NPROC", "1")', 'os.environ.setdefault("NBDDP_STRATEGY", "ddp")'):
        assert line in text, line
    with pytest.raises(NbddpError, match="--nproc 3 asks for 3 processes, one per GPU, but torch sees 2 GPU"):
        export_kaggle(nb, tmp_path / "other", kernel_id="me/run-one", nproc=3)  # the T4 machine's two, not this one's
