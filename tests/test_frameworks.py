"""Training nbddp does not distribute is refused at conversion, before any process starts, naming the cell, the
line and what to do instead (TensorFlow/Keras, JAX, PyTorch Lightning, Opacus without its DPDDP); Opacus with
its own DPDDP runs as written, its loader left to Opacus. Public notebooks of each pattern are refused, or
converted, the same way (no process is started here)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from nbddp import job
from nbddp.cells import Cell
from nbddp.convert import convert_notebook
from nbddp.convert.script import convert_cells
from nbddp.errors import CellError
from nbddp.options import RunOptions

PUBLIC = Path(__file__).resolve().parent / "corpus" / "public"


def convert(*sources):
    return convert_cells([Cell(i, textwrap.dedent(s)) for i, s in enumerate(sources, start=1)])


def refusal(*sources) -> CellError:
    with pytest.raises(CellError) as info:
        convert(*sources)
    return info.value


KERAS = (
    """\
    import tensorflow as tf
    from sklearn.preprocessing import StandardScaler
    x = StandardScaler().fit(data)
    model = tf.keras.Sequential([tf.keras.layers.Dense(1)])
    model.compile(optimizer="adam", loss="mse")
    """,
    "model.fit(x, y, epochs=3)\n",
)


def test_keras_fit_is_refused_at_its_line_with_mirrored_strategy():
    error = refusal(*KERAS)
    assert (error.cell, error.line) == (2, 1)
    assert "tf.distribute.MirroredStrategy()" in str(error) and "model.fit(x, y, epochs=3)" in str(error)


def test_hugging_face_tftrainer_is_refused():
    error = refusal(
        "from transformers import TFTrainer, TFTrainingArguments\n",
        "args = TFTrainingArguments(output_dir='out')\ntrainer = TFTrainer(model=model, args=args)\ntrainer.train()\n",
    )
    assert (error.cell, error.line) == (2, 2) and "TensorFlow/Keras" in str(error)


def test_a_gradient_tape_loop_is_refused_at_its_optimizer_step():
    error = refusal("""\
        import tensorflow as tf
        for x, y in ds:
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
        """)
    assert (error.cell, error.line) == (1, 6)


@pytest.mark.parametrize("imports, call", [
    ("import jax", "jax.value_and_grad(loss_fn)"),
    ("from jax import grad", "grad(loss_fn)"),
    ("import optax\nfrom flax.training import train_state", "state.apply_gradients(grads=grads)"),
])
def test_jax_training_is_refused(imports, call):
    error = refusal(imports + "\n", f"step = {call}\n")
    assert (error.cell, error.line) == (2, 1) and "jax.pmap" in str(error)


@pytest.mark.parametrize("imports, call", [
    ("import pytorch_lightning as pl", "pl.Trainer(gpus=1, max_epochs=3)"),
    ("from pytorch_lightning import Trainer", "Trainer(gpus=1)"),
    ("import lightning as L", "L.Trainer(accelerator='gpu', devices=1)"),
    ("from lightning.pytorch import Trainer", "Trainer(devices=2)"),
])
def test_lightning_is_refused_with_its_own_notebook_recipe(imports, call):
    error = refusal(imports + "\n", f"model = Lit()\ntrainer = {call}\ntrainer.fit(model, loader)\n")
    assert (error.cell, error.line) == (2, 2)
    assert 'strategy="ddp_notebook"' in str(error) and "WORLD_SIZE" in str(error)


OPACUS = """\
    from opacus import PrivacyEngine
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    train_loader = DataLoader(ds, batch_size=64, shuffle=True)
    model, optimizer, train_loader = PrivacyEngine().make_private(
        module=model, optimizer=optimizer, data_loader=train_loader, noise_multiplier=1.0, max_grad_norm=1.0)
    for x, y in train_loader:
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        optimizer.step()
    """


def test_opacus_without_its_dpddp_is_refused_with_the_dpddp_fix():
    error = refusal(OPACUS)
    assert (error.cell, error.line) == (1, 5) and "model = DPDDP(model)" in str(error)


def test_opacus_with_its_dpddp_is_left_to_opacus():
    script = convert(OPACUS.replace(
        "    model = Net()\n",
        "    from opacus.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP\n"
        "    model = DPDDP(Net())\n"))
    # make_private swaps in its own distributed sampler on the whole data set's loader: nbddp adds none, nor a wrap
    assert "distributed_sampler" not in script.text and "_nbddp.ddp(" not in script.text
    assert not [c for c in script.changes if c.rule in ("sampler", "ddp_wrap", "set_epoch")]


def test_a_pytorch_notebook_naming_the_frameworks_elsewhere_is_not_refused():
    script = convert(
        "import tensorflow as tf\nimport lightning\nfrom sklearn.linear_model import LogisticRegression\n",
        "clf = LogisticRegression().fit(X, y)\nmodel = torch.compile(model)\n",
        "optimizer = torch.optim.AdamW(model.parameters())\nfor b in train_loader:\n    model(b).backward()\n",
    )
    assert "_nbddp.ddp(model)" in script.text


def test_a_refusal_comes_before_any_run_directory_or_process(tmp_path, notebook):
    path = notebook([textwrap.dedent(c) for c in KERAS])
    with pytest.raises(CellError, match="cell 2, line 1"):
        job.run_job(path, RunOptions(runs_dir=tmp_path / "runs", nproc=1))
    assert not (tmp_path / "runs").exists()


# ------------------------------------------------------------------------ public notebooks of each pattern

REFUSED = {
    "hf_notebooks/text_classification-tf.ipynb": ("cell 60, line 17", "MirroredStrategy"),
    "hf_notebooks/text_classification_flax.ipynb": ("cell 55, line 10", "jax.pmap"),
    "transformers_tutorials/Fine_tune_CANINE_on_IMDb_(movie_review_binary_classification).ipynb":
        ("cell 21, line 8", "ddp_notebook"),
    "opacus/building_image_classifier.ipynb": ("cell 28, line 5", "DPDDP(model)"),
}


@pytest.mark.parametrize("key", sorted(REFUSED))
def test_public_notebook_of_a_framework_nbddp_does_not_distribute_is_refused(key):
    where, fix = REFUSED[key]
    with pytest.raises(CellError) as info:
        convert_notebook(PUBLIC / key)
    assert str(info.value).startswith(f"{where}: ") and fix in str(info.value), info.value


def test_public_sam_fine_tuning_wraps_the_model_whose_mask_decoder_trains():
    sam = "Fine_tune_SAM_(segment_anything)_on_a_custom_dataset.ipynb"
    script = convert_notebook(PUBLIC / "transformers_tutorials" / sam)
    wraps = [c for c in script.changes if c.rule == "ddp_wrap"]
    assert [(c.cell, c.line) for c in wraps] == [(27, 9)] and "model.mask_decoder" in wraps[0].message
    assert "model = _nbddp.ddp(model)" in script.text


def test_public_kaggle_notebook_with_a_bare_pip_install_converts():
    script = convert_notebook(PUBLIC / "generative_ai" / "about_the_optimization_loop.ipynb")
    assert [(i.cell, i.line) for i in script.installs] == [(2, 1)]
    assert script.installs[0].command.startswith("pip install torch torchvision torchaudio --index-url")


# ------------------------------------------------------------------------ TPU, fastai, RapidFire, axolotl


def test_a_tpu_notebook_is_refused_before_anything_runs():
    error = refusal(
        "import torch\nimport torch_xla.core.xla_model as xm\nimport torch_xla.distributed.xla_multiprocessing as xmp\n",
        "def _mp_fn(index):\n    device = xm.xla_device()\n    train(device)\n",
        "xmp.spawn(_mp_fn, nprocs=8, start_method='fork')\n",
    )
    assert (error.cell, error.line) == (2, 2)
    assert "TPU notebooks are out of scope" in str(error) and "GPU T4×2" in str(error)


def test_an_optional_torch_xla_import_alone_is_no_refusal():
    convert("try:\n    import torch_xla\nexcept ImportError:\n    torch_xla = None\n",
            "model = Net()\nopt = SGD(model.parameters())\nfor x in loader:\n    model(x).sum().backward()\n    opt.step()\n")


def test_torch_xla_calls_in_branches_the_device_setting_chooses_are_no_refusal():
    # a public Kaggle notebook (kozodoi's leaf-disease pipeline) set to CFG['device'] = 'GPU', with its TPU
    # branches beside: refused as a TPU notebook before
    loop = "model = Net()\nopt = SGD(model.parameters())\nfor x in loader:\n    model(x).sum().backward()\n    opt.step()\n"
    convert("CFG = {'device': 'GPU'}\nif CFG['device'] == 'TPU':\n    import torch_xla.core.xla_model as xm\n",
            "device = torch.device('cuda') if CFG['device'] != 'TPU' else xm.xla_device()\n",
            "if CFG['device'] == 'TPU':\n    xm.optimizer_step(opt, barrier=True)\nelse:\n    pass\n", loop)
    error = refusal("import torch_xla.core.xla_model as xm\n", "device = xm.xla_device()\n", loop)
    assert "TPU notebooks are out of scope" in str(error)  # the same call, chosen by nothing: refused


@pytest.mark.parametrize("fit", ["learn.fine_tune(3)", "learn.fit_one_cycle(5, 1e-3)", "learn.fit(2)"])
def test_fastai_is_refused_naming_fastai_and_its_recipe(fit):
    error = refusal("from fastai.vision.all import *\n",
                    "dls = ImageDataLoaders.from_folder(path)\nlearn = vision_learner(dls, resnet34, metrics=error_rate)\n",
                    fit + "\n")
    assert (error.cell, error.line) == (3, 1)
    assert "fastai" in str(error) and "distrib_ctx" in str(error) and "--every-rank" not in str(error)


def test_rapidfire_is_refused_naming_it():
    error = refusal("from rapidfireai import Experiment\n",
                    "experiment = Experiment(experiment_name='sft')\nexperiment.run_fit(config_group, create_model, train_ds, eval_ds, num_chunks=4)\n")
    assert (error.cell, error.line) == (2, 2) and "RapidFire" in str(error)


def test_axolotl_in_process_is_refused_with_its_launch_line():
    error = refusal("from axolotl.cli.train import do_cli\n", "do_cli(config='cfg.yml')\n")
    assert (error.cell, error.line) == (2, 1)
    assert "axolotl" in str(error) and "accelerate launch -m axolotl.cli.train" in str(error)


# ------------------------------------------------------------------------ vLLM

VLLM_SETUP = "from vllm import LLM, SamplingParams\nimport pandas as pd\nprompts = [f'Question {i}' for i in range(100)]\n"


@pytest.mark.parametrize("generation", [
    # one call over every prompt: today refused only as "no training call found", offering --every-rank
    "outputs = llm.generate(prompts, params)\nanswers = [o.outputs[0].text for o in outputs]\n",
    # a loop over the prompts: today split over the ranks as a prediction loop, each rank its own engine
    "answers = []\nfor p in prompts:\n    answers.append(llm.generate([p], params)[0].outputs[0].text)\n",
])
def test_vllm_is_refused_at_its_llm_call_with_its_own_tensor_parallelism(generation):
    error = refusal(VLLM_SETUP,
                    "params = SamplingParams(temperature=0, max_tokens=64)\n"
                    "llm = LLM(model='/kaggle/input/qwen', tensor_parallel_size=2)\n",
                    generation + "pd.DataFrame({'answer': answers}).to_csv('submission.csv', index=False)\n")
    assert (error.cell, error.line) == (2, 2) and "llm = LLM(model=" in str(error)
    assert "vLLM" in str(error) and "tensor_parallel_size=2" in str(error) and "not under nbddp" in str(error)


@pytest.mark.parametrize("imports, call", [
    ("import vllm", "vllm.LLM(model=path)"),
    ("from vllm import LLM as Engine", "Engine(model=path, tensor_parallel_size=2)"),
])
def test_vllm_is_refused_however_its_llm_is_named(imports, call):
    error = refusal(imports + "\n", f"path = '/kaggle/input/m'\nllm = {call}\n")
    assert (error.cell, error.line) == (2, 2) and "vLLM" in str(error)


def test_a_notebook_naming_vllm_without_starting_its_engine_is_not_refused():
    # TRL's GRPO starts vLLM itself on rank 0 (use_vllm=True); a notebook's own LLM class of another library is no engine
    script = convert("from vllm import SamplingParams\nfrom mylib import LLM\n",
                     "net = LLM()\nparams = SamplingParams(temperature=0)\n"
                     "optimizer = torch.optim.AdamW(net.parameters())\nfor b in loader:\n    net(b).backward()\n")
    assert "_nbddp.ddp(net)" in script.text


def test_vllm_is_refused_before_any_process_even_on_every_rank(tmp_path, notebook):
    path = notebook([VLLM_SETUP, "llm = LLM(model='m', tensor_parallel_size=2)\n",
                     "outputs = llm.generate(prompts)\n"])
    with pytest.raises(CellError, match="cell 2, line 1"):
        job.run_job(path, RunOptions(runs_dir=tmp_path / "runs", nproc=2, every_rank=True))
    assert not (tmp_path / "runs").exists()


TRL_TRAINING = ("from trl import SFTTrainer, SFTConfig\n",
                "trainer = SFTTrainer(model=model, args=SFTConfig(output_dir='out'), train_dataset=ds)\n"
                "model.train()\ntrainer.train()\n")


def test_vllm_after_the_last_training_runs_on_rank_0_alone():
    # TRL's notebooks try the merged model with vLLM once trained: that code is rank 0's, one engine
    script = convert(*TRL_TRAINING, "from vllm import LLM, SamplingParams\n"
                     "llm = LLM(model='out-merged')\nprint(llm.generate(['Hi'], SamplingParams(max_tokens=8)))\n")
    assert "if _nbddp.on_rank0():\n    from vllm import LLM, SamplingParams\n    llm = LLM(model='out-merged')" in script.text


def test_vllm_before_the_training_is_refused():
    # synthetic data generated with vLLM, then trained on: the engine would start on every rank
    error = refusal("from vllm import LLM\nllm = LLM(model='teacher')\nds = make(llm.generate(prompts))\n", *TRL_TRAINING)
    assert (error.cell, error.line) == (1, 2) and "vLLM" in str(error)


PLAIN_TRAINING_FUNCTION = ("import torch\n",
                           "def train_epoch(model, loader):\n    for x, y in loader:\n"
                           "        loss_fn(model(x), y).backward()\n        optimizer.step()\n")


@pytest.mark.parametrize("defined", [
    PLAIN_TRAINING_FUNCTION[1],
    "def train_model():\n    trainer = SFTTrainer(model=model, train_dataset=ds)\n    trainer.train()\n",
])
def test_vllm_before_a_training_function_is_called_is_refused(defined):
    # the function that trains is defined above the engine but called below it: the engine starts on every rank
    error = refusal("from vllm import LLM\nfrom trl import SFTTrainer\n", defined,
                    "llm = LLM(model='teacher')\nds = make(llm.generate(prompts))\n",
                    "train_epoch(model, loader)\n" if "train_epoch" in defined else "train_model()\n")
    assert (error.cell, error.line) == (3, 1) and "vLLM" in str(error)


def test_vllm_in_a_function_called_after_the_last_training_runs_on_rank_0_alone():
    # an evaluation helper defined up front, called once the model is trained: its engine is rank 0's
    script = convert("from vllm import LLM\n", "def evaluate(path):\n    llm = LLM(model=path)\n"
                     "    return llm.generate(['Hi'])\n", *TRL_TRAINING, "print(evaluate('out'))\n")
    assert "if _nbddp.on_rank0():\n    print(evaluate('out'))" in script.text


def test_vllm_in_a_function_called_before_the_training_is_refused():
    error = refusal("from vllm import LLM\n", "def generate(path):\n    llm = LLM(model=path)\n"
                    "    return llm.generate(['Hi'])\n", "ds = generate('teacher')\n", *TRL_TRAINING)
    assert (error.cell, error.line) == (2, 2) and "vLLM" in str(error)


def test_vllm_after_a_trainer_trained_where_it_is_made_runs_on_rank_0_alone():
    script = convert("from transformers import Trainer\n",
                     "Trainer(model=model, args=args, train_dataset=ds).train()\n",
                     "from vllm import LLM\nllm = LLM(model='out')\n")
    assert "if _nbddp.on_rank0():\n    from vllm import LLM\n    llm = LLM(model='out')" in script.text


@pytest.mark.parametrize("kept", ["kept_tail", "kept_cell"])
def test_vllm_after_training_in_a_kept_job_is_refused(kept):
    # a kept job runs the code after its training on every rank (a later cell may use every rank): the engine
    # would start on each, so the after-training pass of a job's script does not hold there
    cells = [Cell(i, textwrap.dedent(s)) for i, s in enumerate(
        [*TRL_TRAINING, "from vllm import LLM\nllm = LLM(model='out-merged')\n"], start=1)]
    with pytest.raises(CellError) as info:
        convert_cells(cells, launcher_facts=False, **{kept: True})
    assert (info.value.cell, info.value.line) == (3, 2) and "vLLM" in str(info.value)
