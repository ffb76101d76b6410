"""The magics in a real kernel: notebooks executed with nbclient on CPU/gloo, asserted on their saved outputs."""

import base64
import re

import pytest

from conftest import no_rank_processes, write_notebook
from kernel import errors, execute, rendered, stream

pytestmark = pytest.mark.e2e

SETUP = '''%%ddp_setup
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import SFTConfig, SFTTrainer
from nbddp import demo

tokenizer = AutoTokenizer.from_pretrained(demo.tiny_model())
model = AutoModelForCausalLM.from_pretrained(demo.tiny_model(), device_map="auto", dtype=torch.float32)
model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
args = SFTConfig(output_dir="outputs", per_device_train_batch_size=8, max_steps=20, learning_rate=5e-3, logging_steps=2,
                 max_length=32, bf16=False, fp16=False, save_strategy="no", report_to="none", seed=0)
trainer = SFTTrainer(model=model, args=args, train_dataset=demo.arithmetic_dataset(256), processing_class=tokenizer)'''

TRAIN = '''%%ddp_train --nproc 2 --env NBDDP_TEST_GREETING=hello
trainer.train()
model.save_pretrained("outputs/adapter")
print("greeting:", os.environ["NBDDP_TEST_GREETING"])'''

AFTER = '''from peft import PeftConfig
print("kernel has model:", "model" in dir())
print("steps:", _ddp.steps, "losses:", len(_ddp.losses), "runtime:", "train_runtime" in _ddp.metrics)
print("adapter:", PeftConfig.from_pretrained(str(_ddp.adapters[0])).r, _ddp.adapters[0].name)
print("output_dir:", _ddp.output_dir.name, "script:", _ddp.script_path.name, "logs:", _ddp.log_dir.is_dir())'''


def test_a_registered_job_trains_with_a_live_panel_and_leaves_its_result(tmp_path):
    nb, client = execute(tmp_path / "train.ipynb", ["%load_ext nbddp", "import os", SETUP, TRAIN, AFTER],
                         NBDDP_CACHE=str(tmp_path / "cache"))
    setup, train, after = nb.cells[2], nb.cells[3], nb.cells[4]
    assert "registered for the job" in stream(setup, "stdout")
    assert not errors(train), errors(train)

    # the job: the registered cell plus the magic cell, numbered as the kernel numbers them
    out = stream(train, "stdout")
    assert "2 cells from %%ddp_setup cells (registered): In [3], In [4]" in out
    assert "nbddp: 2 process(es), backend gloo" in out and "greeting: hello" in out
    assert re.search(r"finished in [\d.]+ s · 20 steps · [\d.]+ steps/s · [\d.]+ samples/s · loss [\d.]+ → [\d.]+", out)
    assert f"adapter saved in {tmp_path / 'outputs' / 'adapter'}" in out

    # the panel: a status line and a loss curve, both updated in place through their display ids
    displays = [o for o in train.outputs if o.output_type == "display_data"]
    status, plot = displays[0], displays[1]
    assert "done" in status.data["text/plain"] and "step 20/20" in status.data["text/plain"]
    assert base64.b64decode(plot.data["image/png"]).startswith(b"\x89PNG\r\n\x1a\n")
    status_id, plot_id = [d for c, kind, d, _ in client.messages if c == 3 and kind == "display_data"]
    updates = [(d, mimes) for c, kind, d, mimes in client.messages if kind == "update_display_data"]
    assert (plot_id, ("image/png", "text/plain")) in updates
    assert len([u for u in updates if u[0] == status_id]) >= 2

    # the Trainer's bar: redrawn in place in the front end, so no line is left at an intermediate step (a
    # warning printed while the bar stood at 0/20 keeps that line, as it would in a terminal)
    shown = rendered(stream(train, "stderr"))
    assert len(re.findall(r"\b20/20 \[", shown)) == 1
    assert not re.search(r"\b([1-9]|1\d)/20 \[", shown)

    # the next cell sees the result; the registered cell never ran in the kernel
    text = stream(after, "stdout")
    assert "kernel has model: False" in text
    assert "steps: 20 losses: 10 runtime: True" in text  # rank 0's 10 logs: one Trainer in DDP, not two alone
    assert "adapter: 8 adapter" in text
    assert "output_dir: outputs script: script.py logs: True" in text
    assert no_rank_processes(str(tmp_path))


FAIL = '''%%ddp_train --nproc 2
if os.environ["RANK"] == "1":
    raise ValueError("boom on rank 1")
time.sleep(60)'''

TQDM = '''import time
from tqdm import tqdm
for _ in tqdm(range(200), mininterval=0, file=sys.stderr):
    time.sleep(0.005)
print("loop done")'''


def test_notebook_cells_a_failing_rank_and_a_whole_notebook_file(tmp_path):
    other = write_notebook(tmp_path / "other.ipynb", ["import sys", TQDM])
    sources = [
        "%load_ext nbddp",
        "import os\nimport time",
        "%%ddp_train --dry-run --save saved.py\nprint('dry')",
        FAIL,
        f"%ddp_train {other.name} --nproc 2 --out other_result",
        "print('other ok:', other_result.ok)",
    ]
    # Jupyter's server tells the kernel its notebook through JPY_SESSION_NAME (ipykernel sets __session__)
    nb, _ = execute(tmp_path / "nb.ipynb", sources, JPY_SESSION_NAME="nb.ipynb")
    dry, fail, whole, after = nb.cells[2], nb.cells[3], nb.cells[4], nb.cells[5]

    # --dry-run: the cells taken from the saved notebook above the magic, and the script; nothing launched
    text = stream(dry, "stdout")
    assert "2 cells from nb.ipynb (notebook): cell 2, cell 3" in text
    assert "# [cell 2]" in text and "_nbddp.setup()" in text and "print('dry')" in text
    assert (tmp_path / "saved.py").exists() and (tmp_path / "saved.py.map.json").exists()

    # the failing rank's traceback, at the notebook's cell and line, as the cell's error; earlier
    # %%ddp_train cells are other jobs and are not part of this one
    assert "2 cells from nb.ipynb (notebook): cell 2, cell 4" in stream(fail, "stdout")
    (error,) = errors(fail)
    assert error.ename == "JobFailed"
    assert error.evalue.startswith("rank 1 failed in cell 4, line 3: ValueError: boom on rank 1")
    assert any('File "nb.ipynb", cell 4, line 3, in <module>' in line for line in error.traceback)
    assert "failed in" in stream(fail, "stdout")

    # %ddp_train NOTEBOOK: the whole file; tqdm's redraws reach the notebook collapsed, one bar in the end
    assert not errors(whole)
    assert "loop done" in stream(whole, "stdout") and "other ok: True" in stream(after, "stdout")
    saved = stream(whole, "stderr")
    log = next((tmp_path / "nbddp_runs").glob("*-other/logs/*/attempt_0/0/stderr.log")).read_bytes()
    assert log.count(b"\r") >= 200 and saved.count("\r") < 40
    bars = [ln for ln in rendered(saved).splitlines() if "/200 [" in ln]
    assert len(bars) == 1 and "200/200" in bars[0]
    assert no_rank_processes(str(tmp_path))


def test_history_source_doctor_and_usage_errors(tmp_path):
    sources = [
        "%load_ext nbddp",
        "x = 1",
        "x = 1",
        "%ddp_doctor --timeout 120",
        "%%ddp_train --dry-run\nprint(x)",
        "%%ddp_train --dry-run --source notebook\nprint(x)",
        "%%ddp_train --nproc two\nprint(x)",
        "print(get_ipython().find_cell_magic('ddp_train').__doc__)",  # what %ddp_train? shows
    ]
    nb, _ = execute(tmp_path / "hist.ipynb", sources)
    doctor, dry, forced, bad, help_ = nb.cells[3], nb.cells[4], nb.cells[5], nb.cells[6], nb.cells[7]

    report = stream(doctor, "stdout")
    assert re.search(r"ok\s+all-reduce\s+2 processes over gloo: correct", report)
    assert re.search(r"ok\s+kernel memory", report) and "/dev/shm" in report

    # no notebook file known: the kernel's history, a cell run twice taken once
    text = stream(dry, "stdout")
    assert "2 cells from the kernel's history (history): In [2], In [5]" in text
    assert "the kernel does not say which notebook file it runs" in text
    assert "taken once" in text

    (error,) = errors(forced)
    assert "cannot take the cells from the notebook file" in error.evalue and len(error.traceback) == 1
    assert "UsageError" in stream(bad, "stderr") and "--nproc" in stream(bad, "stderr")

    shown = stream(help_, "stdout")
    for option in ("--nproc", "--dry-run", "--show-script", "--diff", "--timeout", "--no-shim", "--env", "--save",
                   "--out", "--source", "torchrun"):
        assert option in shown, option
