"""What of the Unsloth GPU proof (tests/gpu/prove_unsloth.py) a CPU can check: its help, the public notebook's
copy and its marked edits, that nbddp converts the copy, the magic's cells, the local rows and the verdict."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "gpu"))
import prove_unsloth as proof  # noqa: E402

from nbddp.kernel_cells import cells_above  # noqa: E402
from nbddp.selection import split_cell_magic  # noqa: E402

ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p)}


@pytest.mark.e2e
def test_help_names_nproc_and_the_device_command():
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "gpu" / "prove_unsloth.py"), "--help"],
                          capture_output=True, text=True, env=ENV, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "--nproc" in proc.stdout and "tar -xJf .gpu/site.tar.xz -C /tmp" in proc.stdout


def changed_lines(copy) -> list[str]:
    public = "\n".join(c.source for c in proof.public_notebook().cells).splitlines()
    return [ln for ln in "\n".join(c.source for c in copy.cells).splitlines() if ln not in public]


def test_the_copy_points_at_local_files_and_marks_every_edit(tmp_path):
    path = proof.notebook_copy(tmp_path / "nb.ipynb", Path("/models/m"), Path("/data/rows.json"), steps=7)
    changed = changed_lines(nbformat.read(path, as_version=4))
    assert len(changed) == 3 and all(proof.MARK in ln for ln in changed)
    assert any('model_name = "/models/m",' in ln for ln in changed)
    assert any('load_dataset("json", data_files = "/data/rows.json", split = "train")' in ln for ln in changed)
    assert any("max_steps = 7," in ln for ln in changed)


@pytest.mark.e2e
def test_nbddp_converts_the_copy(tmp_path):
    path = proof.notebook_copy(tmp_path / "nb.ipynb", Path("/models/m"), Path("/data/rows.json"), steps=7)
    proc = subprocess.run([sys.executable, "-m", "nbddp.cli", "convert", str(path), "-o", str(tmp_path / "nb.py")],
                          capture_output=True, text=True, env=ENV, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    script = (tmp_path / "nb.py").read_text()
    compile(script, "nb.py", "exec")
    assert '"/models/m"' in script and "trainer.train()" in script and 'save_pretrained("llama_lora")' in script


def test_the_magic_copy_trains_every_cell_above_the_save(tmp_path):
    path = proof.notebook_copy(tmp_path / "nb.ipynb", Path("/models/m"), Path("/data/rows.json"), steps=7,
                               magic="--nproc 2 --skip-installs")
    nb = nbformat.read(path, as_version=4)
    magic_cells = [c for c in nb.cells if c.source.startswith("%%ddp_train")]
    assert len(magic_cells) == 1 and 'model.save_pretrained("llama_lora")' in magic_cells[0].source
    name, args, body = split_cell_magic(magic_cells[0].source)
    selection = cells_above(path, args, body)
    sources = [c.source for c in selection.cells]
    assert any("trainer_stats = trainer.train()" in s for s in sources)
    assert any("FastLanguageModel.from_pretrained" in s for s in sources)
    assert 'model.save_pretrained("llama_lora")' in sources[-1]


@pytest.fixture(scope="module")
def tokenizer():
    return proof.varlen_workload.tokenizer(151936)


def model_folder(path: Path, tokenizer) -> Path:
    """What of ``prepare_checkpoint``'s folder decides how a tokenizer loads: its config and tokenizer files."""
    from transformers import Qwen2Config

    tokenizer.save_pretrained(path)
    Qwen2Config(vocab_size=151936, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=1,
                num_key_value_heads=1, bos_token_id=1, eos_token_id=2, pad_token_id=0).save_pretrained(path)
    return path


def test_rows_follow_the_measured_alpaca_lengths(tmp_path, tokenizer):
    lengths = proof.write_rows(tmp_path / "rows.json", 3000, tokenizer)
    rows = json.loads((tmp_path / "rows.json").read_text())
    table = proof.varlen_workload.token_percentiles()
    assert len(rows) == 3000 and statistics.median(lengths) == pytest.approx(table[50], rel=0.06)
    assert sum(bool(r["input"]) for r in rows) / len(rows) == pytest.approx(proof.SHARE_WITH_INPUT, abs=0.03)
    assert all(r["output"].split()[0] == r["instruction"].split()[0] for r in rows)  # something to learn


def test_the_model_folder_tokenizer_reads_the_rows_as_the_notebook_loads_it(tmp_path, tokenizer):
    """Loaded back as Unsloth loads it (``AutoTokenizer``: ``Qwen2Tokenizer`` for a Qwen2 folder), the tokenizer
    gives each row the length it was written for, one token a word (a word-level tokenizer came back reading
    every row as the bare EOS)."""
    from transformers import AutoTokenizer

    folder = model_folder(tmp_path / "model", tokenizer)
    lengths = proof.write_rows(tmp_path / "rows.json", 200, tokenizer)
    assert proof.rows_reach_the_model(folder, tmp_path / "rows.json", lengths) is None
    loaded = AutoTokenizer.from_pretrained(str(folder))
    words = proof.varlen_workload.words(proof.varlen_workload.WORDS)
    assert all(len(loaded(" " + w)["input_ids"]) == 1 for w in words[::97])
    assert (loaded.eos_token_id, loaded.pad_token_id) == (2, 0)  # as the model's config says


def test_rows_a_tokenizer_cannot_read_stop_the_proof_before_it_runs(tmp_path, tokenizer):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    word_level = Tokenizer(models.WordLevel(vocab={"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}, unk_token="<unk>"))
    word_level.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    other = PreTrainedTokenizerFast(tokenizer_object=word_level, eos_token="</s>", pad_token="<pad>")
    folder = model_folder(tmp_path / "model", other)
    lengths = proof.write_rows(tmp_path / "rows.json", 20, tokenizer)
    why = proof.rows_reach_the_model(folder, tmp_path / "rows.json", lengths)
    assert why is not None and "would not see the rows" in why


def record(indices, losses=(3.0, 2.5, 2.0, 1.5), writes=()):
    return {"passes": [{"size": 100, "indices": list(indices)}], "losses": list(losses), "writes": list(writes)}


GOOD = "nbddp: 2 process(es), backend nccl, rank 0 on cuda:0"


def test_verdict_passes_a_good_run_and_reports_the_shares():
    records = {0: record(range(0, 8), writes=["llama_lora/.adapter_model.safetensors.2cubrkm7"]),
               1: record(range(8, 16), writes=["llama_lora/adapter_config.json"])}
    wrong, figures = proof.verdict(0, GOOD, records, 2, 100, [10] * 100, adapter_there=True)
    assert wrong == []
    assert figures["sample_share"] == {0: 0.5, 1: 0.5} and figures["adapter_writers"] == [0]


@pytest.mark.parametrize("case, expected", [
    ("overlap", "more than one rank"),
    ("two_savers", "written by rank(s) [0, 1]"),
    ("flat_loss", "loss did not fall"),
    ("uneven", "not even"),
    ("gloo", "nccl"),
    ("no_tokens", "did not reach"),
])
def test_verdict_names_what_went_wrong(case, expected):
    records = {0: record(range(0, 8), writes=[proof.ADAPTER]), 1: record(range(8, 16))}
    text = GOOD
    if case == "overlap":
        records[1] = record(range(4, 12))
    elif case == "two_savers":
        records[1]["writes"] = [proof.ADAPTER]
    elif case == "flat_loss":
        records[0]["losses"] = [2.0, 2.0, 2.1, 2.1]
    elif case == "uneven":
        records[1] = record(range(8, 12))
    elif case == "no_tokens":
        records[0]["losses"] = [0.05, 0.0, 0.0, 0.0]  # falls, from where no random-weight model starts
    else:
        text = GOOD.replace("nccl", "gloo")
    wrong, _ = proof.verdict(0, text, records, 2, 100, [10] * 100, adapter_there=True, first_loss_above=1.0)
    assert any(expected in w for w in wrong), wrong


PLAIN_CELLS = [
    "import os, torch\nfrom torch.utils.data import DataLoader, TensorDataset\nfrom safetensors.torch import save_file",
    "torch.manual_seed(0)\nx = torch.randn(64, 4)\ndata = TensorDataset(x, x.sum(1, keepdim=True))\n"
    "loader = DataLoader(data, batch_size=2, shuffle=True)\nmodel = torch.nn.Linear(4, 1)\n"
    "opt = torch.optim.SGD(model.parameters(), lr=0.05)",
    "for xb, yb in loader:\n    loss = ((model(xb) - yb) ** 2).mean()\n    opt.zero_grad()\n    loss.backward()\n"
    "    opt.step()",
]
SAVE = ('os.makedirs("llama_lora", exist_ok=True)\n'
        'save_file(dict(model.state_dict()), "llama_lora/adapter_model.safetensors")')


@pytest.mark.e2e
@pytest.mark.parametrize("way", ["run", "magic"])
def test_both_ways_and_the_recorder_on_two_gloo_ranks(tmp_path, way):
    """The proof's plumbing on a plain loop the CPU trains: the CLI and the IPython shell's %%ddp_train,
    the rank recorder, the run logs and the verdict."""
    save = SAVE if way == "run" else f"%%ddp_train --nproc 2 --skip-installs --runs-dir {tmp_path / 'runs'}\n{SAVE}"
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in [*PLAIN_CELLS, save]])
    path = tmp_path / "plain.ipynb"
    nbformat.write(nb, str(path))
    code, text = proof.by_cli(tmp_path, path, 2, 600) if way == "run" else proof.by_magic(tmp_path, path, 600)
    records = proof.rank_records(tmp_path / "record")
    wrong, figures = proof.verdict(code, text + proof.run_logs(tmp_path / "runs"), records, 2, 64, [1] * 64,
                                   (tmp_path / proof.ADAPTER).exists(), backend="gloo")
    assert wrong == [], (wrong, text[-3000:])
    assert figures["samples"] == {0: 32, 1: 32} and figures["adapter_writers"] == [0]
