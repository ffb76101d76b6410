"""The compatibility shims inside real ranks: torchrun, two gloo processes, TRL's defaults.

Here the failure without the precision shim; the same GPU-isms repaired by every shim, each announced once, and
trained on two CPU ranks: tests/test_no_checkpointing.py's run without the flag, whose notebook has them too."""

import pytest

from nbddp.job import run_job
from nbddp.options import RunOptions
from views import Said

pytestmark = pytest.mark.e2e

#: A notebook as written for a GPU runtime: TRL's default precision (bf16), a LoraConfig keyword from
#: another PEFT release, the old torch.cuda.amp spelling.
CELLS = [
    "import warnings\nimport torch\n"
    "from peft import LoraConfig, get_peft_model\n"
    "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
    "from trl import SFTConfig, SFTTrainer\n"
    "from nbddp import demo",
    "path = demo.tiny_model()\n"
    "tokenizer = AutoTokenizer.from_pretrained(path)\n"
    "model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)\n"
    "with warnings.catch_warnings(record=True) as caught:\n"
    "    warnings.simplefilter('always')\n"
    "    lora = LoraConfig(r=4, target_modules=['q_proj', 'v_proj'], task_type='CAUSAL_LM', merge_weights=False)\n"
    "    with torch.cuda.amp.autocast(enabled=False):\n"
    "        pass\n"
    "print('warned:', sorted({type(w.message).__name__ for w in caught}), flush=True)\n"
    "model = get_peft_model(model, lora)",
    "args = SFTConfig(output_dir='out', max_steps=3, per_device_train_batch_size=4, max_length=32,\n"
    "                 logging_steps=1, save_strategy='no', report_to='none')\n"
    "print('precision: bf16', args.bf16, 'fp16', args.fp16, flush=True)\n"
    "print('world size', args.world_size, flush=True)\n"
    "trainer = SFTTrainer(model=model, args=args, train_dataset=demo.arithmetic_dataset(64), processing_class=tokenizer)\n"
    "trainer.train()\n"
    "print('trained', trainer.state.global_step, 'steps', flush=True)",
]


def run(notebook, tmp_path, env=None):
    chunks = []
    result = run_job(notebook(CELLS), RunOptions(nproc=2, runs_dir=tmp_path / "runs", env=env, timeout_s=500),
                     Said(chunks)).run
    return result, "".join(chunks)


def test_trl_default_bf16_fails_on_cpu_ranks_without_the_precision_shim(tmp_path, notebook):
    result, _ = run(notebook, tmp_path, env={"NBDDP_SHIM_PRECISION": "0"})
    assert not result.ok
    assert "Your setup doesn't support bf16/gpu" in result.failure.message
    assert result.failure.cell == 3  # the SFTConfig cell: PEFT's and torch's parts before it ran
