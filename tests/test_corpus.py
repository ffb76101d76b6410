"""The fixture corpus: every notebook converts, compiles and keeps the converter's promises.

The invariants are checked here with the test's own simple patterns, not with the rules' code, so a rule
that stops doing its job shows up as a broken promise. The plain PyTorch notebooks also train for real on
two gloo processes.
"""

import json
import re
import shutil
import sys
from pathlib import Path

import libcst as cst
import nbformat
import pytest

from nbddp.convert import convert_notebook
from nbddp.display.view import QuietView
from nbddp.job import run_job
from nbddp.options import RunOptions
from views import Said

CORPUS = Path(__file__).resolve().parent / "corpus"
sys.path.insert(0, str(CORPUS))
import make_corpus  # noqa: E402

NOTEBOOKS = sorted(CORPUS.glob("*.ipynb"))
IDS = [p.stem for p in NOTEBOOKS]

MODEL_LOADER = re.compile(r"(Auto\w*Model\w*|\w+For[A-Z]\w*|PeftModel|Fast\w*Model)$")
TRAINING = re.compile(r"\b\w*trainer\w*\.train\(|unsloth_train\(|\.backward\(|train_one_epoch\(")
ACTION = re.compile(
    r"save_pretrained|push_to_hub|save_model|save_lora|\.generate\(|fast_generate|\bprint\(|\bdisplay\(|plt\.|"
    r"torch\.save|to_csv|json\.dump"
)
#: Text nbddp itself writes into a line, so the line differs from the notebook's.
NBDDP_TEXT = ("_nbddp", "nbddp:", "ddp_find_unused_parameters=False", "log_on_each_node=False",
              "gradient_checkpointing_kwargs", "torch.amp.", "from torch.amp")
TRAINER_CONFIG = re.compile(r"(TrainingArguments|SFTConfig|DPOConfig|GRPOConfig)$")


def test_the_corpus_is_big_enough_and_is_what_make_corpus_writes(tmp_path):
    assert len(NOTEBOOKS) >= 15
    written = make_corpus.write_all(tmp_path)
    assert sorted(p.name for p in written) == [p.name for p in NOTEBOOKS]
    for p in written:
        assert p.read_bytes() == (CORPUS / p.name).read_bytes(), f"{p.name}: run tests/corpus/make_corpus.py"


@pytest.fixture(scope="module")
def converted():
    return {p.stem: convert_notebook(p) for p in NOTEBOOKS}


def code_cells(path):
    nb = nbformat.read(str(path), as_version=4)
    return {i: c.source for i, c in enumerate(nb.cells, start=1) if c.cell_type == "code"}


def top_level(script_text):
    """The script's top-level statements with their code, outside the prelude and epilogue."""
    module = cst.parse_module(script_text)
    out = []
    for stmt in module.body:
        code = module.code_for_node(stmt.with_changes(leading_lines=[])).strip()
        if "_nbddp.setup()" in code or "_nbddp.cleanup()" in code:
            continue
        out.append((stmt, code))
    return out


def calls(node):
    found = []

    class V(cst.CSTVisitor):
        def visit_If(self, n):
            return not (isinstance(n.test, cst.Name) and n.test.value == "False")

        def visit_Call(self, n):
            found.append(n)

    node.visit(V())
    return found


def dotted(node):
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        base = dotted(node.value)
        return f"{base}.{node.attr.value}" if base else node.attr.value
    return ""


def in_if_false(lines, n):
    """Whether script line ``n`` (1-based) sits inside an ``if False:`` block."""
    indent = len(lines[n - 1]) - len(lines[n - 1].lstrip())
    for k in range(n - 2, -1, -1):
        text = lines[k]
        if text.strip() and len(text) - len(text.lstrip()) < indent:
            if text.strip() == "if False:":
                return True
            indent = len(text) - len(text.lstrip())
    return False


@pytest.mark.parametrize("name", IDS)
def test_converts_compiles_and_finds_training(converted, name):
    script = converted[name]
    compile(script.text, f"{name}.py", "exec")
    assert not script.warnings, script.warnings


@pytest.mark.parametrize("name", IDS)
def test_model_loaders_load_on_this_ranks_device(converted, name):
    module = cst.parse_module(converted[name].text)
    loaders = [c for c in calls(module) if dotted(c.func).endswith(".from_pretrained")
               and MODEL_LOADER.search(dotted(c.func.value))]
    for call in loaders:
        maps = [module.code_for_node(a.value) for a in call.args if a.keyword and a.keyword.value == "device_map"]
        assert maps == ["_nbddp.device_map()"], module.code_for_node(call)
    others = [c for c in calls(module) if dotted(c.func).endswith(".from_pretrained") and c not in loaders]
    assert all("_nbddp" not in module.code_for_node(c) for c in others)  # tokenizers untouched
    code = "\n".join(ln for ln in converted[name].text.splitlines() if not ln.lstrip().startswith("#"))
    assert not re.search(r"""["']cuda:0["']""", code)


@pytest.mark.parametrize("name", IDS)
def test_nothing_after_the_last_training_saves_or_prints_outside_rank_zero(converted, name):
    stmts = top_level(converted[name].text)
    trains = [i for i, (_, code) in enumerate(stmts) if TRAINING.search(code)]
    assert trains, "a training statement"
    for stmt, code in stmts[trains[-1] + 1 :]:
        if ACTION.search(code):
            assert code.startswith("if _nbddp.on_rank0():"), code


@pytest.mark.parametrize("name", IDS)
def test_installs_are_pulled_out(converted, name):
    script = converted[name]
    lines = script.text.splitlines()
    for n, text in enumerate(lines, start=1):
        if "pip install" in text and not text.lstrip().startswith("#") and not text.lstrip().startswith("pass  # nbddp"):
            assert in_if_false(lines, n), f"line {n}: {text}"
    notebook_installs = sum(
        1 for src in code_cells(CORPUS / f"{name}.ipynb").values() for ln in src.splitlines()
        if re.match(r"\s*[!%]pip install", ln) and not ln.startswith("    ")
    )
    assert len(script.installs) >= notebook_installs


@pytest.mark.parametrize("name", IDS)
def test_every_mapped_line_is_its_cell_line(converted, name):
    script = converted[name]
    cells = code_cells(CORPUS / f"{name}.ipynb")
    lines = script.text.splitlines()
    mapped = set()
    for n, (cell, line) in script.source_map.lines.items():
        src = cells[cell].splitlines()[line - 1]
        mapped.add((cell, line))
        out = lines[n - 1]
        if out.strip() != src.strip():
            assert any(t in out for t in NBDDP_TEXT) or src.lstrip().startswith(("%", "!")), (n, out, src)
    # and no line of code was lost: each is the source of some script line
    for cell, src in cells.items():
        if src.lstrip().startswith("%%") and not src.lstrip().startswith(("%%capture", "%%time")):
            continue
        for k, text in enumerate(src.splitlines(), start=1):
            if text.strip() and not text.strip().startswith(("#", "%%")) and not text.strip() in (")", "]", "}", "),"):
                assert (cell, k) in mapped, (cell, k, text)


@pytest.mark.parametrize("name", IDS)
def test_trainer_configs_and_data_preparation(converted, name):
    script = converted[name]
    module = cst.parse_module(script.text)
    peft = re.search(r"get_peft_model|peft_config\s*=|PeftModel", script.text)
    for call in calls(module):
        if TRAINER_CONFIG.search(dotted(call.func)):
            code = module.code_for_node(call)
            assert "log_on_each_node=" in code
            # only a PEFT model is known to use every trainable weight in each step
            assert ("ddp_find_unused_parameters=" in code) == bool(peft) or "ddp_find_unused_parameters=True" in code
    for stmt, code in top_level(script.text):
        if isinstance(stmt, (cst.FunctionDef, cst.ClassDef)) or code.startswith("if _nbddp.on_rank0():"):
            continue
        if re.search(r"load_dataset\(|\w\.map\(|\w\.filter\(", code) and not TRAINING.search(code):
            assert code.startswith("with _nbddp.main_process_first():"), code


@pytest.mark.parametrize("name", IDS)
def test_every_change_names_a_real_cell_line(converted, name):
    cells = code_cells(CORPUS / f"{name}.ipynb")
    script = converted[name]
    assert script.changes
    for change in script.changes:
        assert change.cell in cells and 1 <= change.line <= len(cells[change.cell].splitlines()), change
    for inst in script.installs:
        assert inst.command in cells[inst.cell].splitlines()[inst.line - 1].replace("\\", "")


@pytest.mark.parametrize("name", make_corpus.RUNNABLE)
def test_plain_pytorch_notebooks_are_distributed(converted, name):
    text = converted[name].text
    assert "_nbddp.ddp(model)" in text and "_nbddp.distributed_sampler(" in text and "_nbddp.set_epoch(" in text
    assert "shuffle=True)," not in text.replace("shuffle=True),", "")  # shuffle moved into the sampler


# --------------------------------------------------------------------------------------- real runs


@pytest.mark.e2e
@pytest.mark.parametrize("name", make_corpus.RUNNABLE)
def test_plain_pytorch_notebook_trains_on_two_ranks(tmp_path, name):
    nb = shutil.copy(CORPUS / f"{name}.ipynb", tmp_path / f"{name}.ipynb")
    chunks = []
    job = run_job(nb, RunOptions(nproc=2, runs_dir=tmp_path / "runs", timeout_s=500), Said(chunks))
    script, result = job.script, job.run
    out = "".join(chunks)
    assert result.ok, (out[-3000:], result.failure)
    assert "2 process(es)" in out
    rank1 = result.rank_log(1).read_text()
    saved = {"pytorch_image_cnn": "final_model.pt", "pytorch_tabular_mlp": "mlp.pt", "pytorch_kfold": "cv.json"}[name]
    assert (tmp_path / saved).exists()
    # rank 0 printed the metrics, rank 1 printed none of them
    marker = {"pytorch_image_cnn": "epoch 0:", "pytorch_tabular_mlp": " 0 train", "pytorch_kfold": "fold 0:"}[name]
    assert marker in out and marker not in rank1


DATA_PER_RANK = [
    "import os\nimport torch\nfrom torch.utils.data import DataLoader, TensorDataset",
    "data = TensorDataset(torch.arange(64).float().unsqueeze(1), torch.arange(64).float().unsqueeze(1) * 3)\n"
    "train_loader = DataLoader(data, batch_size=8, shuffle=True)",
    'device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")\n'
    "model = torch.nn.Linear(1, 1).to(device)\n"
    "optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)",
    "seen = {}\n"
    "for epoch in range(2):\n"
    "    seen[epoch] = []\n"
    "    for x, y in train_loader:\n"
    "        seen[epoch] += x.flatten().int().tolist()\n"
    "        loss = ((model(x.to(device)) - y.to(device)) ** 2).mean()\n"
    "        optimizer.zero_grad()\n"
    "        loss.backward()\n"
    "        optimizer.step()\n"
    "    print(f'epoch {epoch} loss {loss.item():.3f}')\n"
    "    with open(f\"seen-{os.environ['RANK']}.json\", 'w') as fh:\n"
    "        fh.write(__import__('json').dumps(seen))",
    "weights = model.state_dict()\n"
    "print(sorted(weights))\n"
    "\n"
    "raise RuntimeError('stop here')",
]


@pytest.mark.e2e
def test_converted_loop_gives_each_rank_its_own_data_and_maps_errors(tmp_path, notebook):
    """Both ranks train on disjoint shares that change each epoch; an error in the rank-0 tail maps to its cell."""
    nb = notebook(DATA_PER_RANK, markdown_first=True)
    job = run_job(nb, RunOptions(nproc=2, runs_dir=tmp_path / "runs", timeout_s=500), QuietView())
    script, result = job.script, job.run
    seen = [json.loads((tmp_path / f"seen-{r}.json").read_text()) for r in (0, 1)]
    for epoch in ("0", "1"):
        a, b = seen[0][epoch], seen[1][epoch]
        assert len(a) == len(b) == 32 and not set(a) & set(b) and set(a) | set(b) == set(range(64))
    assert seen[0]["0"] != seen[0]["1"]  # set_epoch reshuffled
    # the tail ran on rank 0 only, with the plain model (no "module." prefix), and failed where the notebook says
    assert not result.ok and result.failure.rank == 0
    assert (result.failure.cell, result.failure.line) == (6, 4)
    assert result.failure.source.strip() == "raise RuntimeError('stop here')"
    assert "['bias', 'weight']" in result.rank_log(0).read_text()


TWO_TRAININGS = [
    "import torch\nfrom peft import LoraConfig, get_peft_model\n"
    "from transformers import AutoModelForCausalLM, AutoTokenizer\nfrom trl import SFTConfig, SFTTrainer\n"
    "from nbddp import demo",
    "name = demo.tiny_model()\ntokenizer = AutoTokenizer.from_pretrained(name)\n"
    'model = AutoModelForCausalLM.from_pretrained(name, device_map="auto", dtype=torch.float32)\n'
    'model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))',
    "data = demo.arithmetic_dataset(64)\nsplit = data.train_test_split(test_size=16, seed=0)\n"
    "def args(out):\n"
    "    return SFTConfig(output_dir=out, max_steps=3, per_device_train_batch_size=4, max_length=32,\n"
    '                     save_strategy="no", report_to="none", logging_steps=1, bf16=False)',
    'first = SFTTrainer(model=model, args=args("o1"), train_dataset=split["train"], processing_class=tokenizer)\n'
    "first.train()",
    'print("between the trainings")\nmodel.save_pretrained("stage1")',
    'second = SFTTrainer(model=model, args=args("o2"), train_dataset=split["train"], eval_dataset=split["test"],\n'
    "                    processing_class=tokenizer)\nsecond.train()",
    "metrics = second.evaluate()\nprint('eval loss', round(metrics['eval_loss'], 3))\nmodel.save_pretrained('stage2')",
]


@pytest.mark.e2e
def test_two_trainings_and_an_evaluation_on_two_ranks(tmp_path, notebook):
    """Saving between two trainings and after them happens once; evaluate() runs on both ranks (no hang)."""
    nb = notebook(TWO_TRAININGS)
    job = run_job(nb, RunOptions(nproc=2, runs_dir=tmp_path / "runs", timeout_s=550), QuietView())
    script, result = job.script, job.run
    rank0, rank1 = result.rank_log(0).read_text(), result.rank_log(1).read_text()
    assert result.ok, (rank0[-2000:], result.failure)
    assert "between the trainings" in rank0 and "eval loss" in rank0
    assert "between the trainings" not in rank1 and "eval loss" not in rank1
    assert (tmp_path / "stage1" / "adapter_model.safetensors").exists()
    assert (tmp_path / "stage2" / "adapter_model.safetensors").exists()
    explained = {c.message for c in script.changes}
    assert "stays on every rank: second.evaluate() needs every rank" in explained
