"""Strategies for models bigger than one GPU: the estimate and ``auto``'s choice on stated memory sizes, then
FSDP (the Trainer and a plain loop) on two gloo ranks and split in one process, on the tiny Llama."""

import json
import re
import sys
from pathlib import Path

import pytest

from nbddp import choose_strategy as strategy
from nbddp.cells import cells_from_sources
from nbddp.convert import convert_cells, convert_notebook
from nbddp.errors import NbddpError
from nbddp.launch import launch, new_run_dir, plan
from nbddp.options import RunOptions
from views import Said

JOBS = Path(__file__).resolve().parent / "jobs"
GiB = 2**30

#: Llama 3 8B's shape.
LLAMA_8B = {"architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096,
            "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 8, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}

NOTEBOOK = '''
import torch
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, TrainingArguments
from peft import LoraConfig, get_peft_model
model_id = "llama-8b"
bnb = BitsAndBytesConfig(load_in_4bit={four_bit}, bnb_4bit_compute_dtype=torch.float16)
model = AutoModelForCausalLM.from_pretrained(model_id, quantization_config=bnb, dtype=torch.float16)
model = get_peft_model(model, LoraConfig(r=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
args = TrainingArguments(output_dir="out", per_device_train_batch_size=1, gradient_checkpointing=True)
'''

UNSLOTH = '''
from unsloth import FastLanguageModel
model, tokenizer = FastLanguageModel.from_pretrained(model_name="llama-8b", max_seq_length=2048, load_in_4bit=False)
model = FastLanguageModel.get_peft_model(model, r=16, target_modules=["q_proj", "v_proj"])
'''


@pytest.fixture
def llama_8b(tmp_path):
    (tmp_path / "llama-8b").mkdir()
    (tmp_path / "llama-8b" / "config.json").write_text(json.dumps(LLAMA_8B))
    return tmp_path


def script(source: str) -> str:
    return convert_cells(cells_from_sources([source])).text


def test_the_script_says_what_it_loads_and_how_it_trains():
    shape = strategy.read_shape(script(NOTEBOOK.format(four_bit=True)))
    assert shape.model == "llama-8b" and not shape.unsloth
    assert shape.bits == 4 and shape.dtype == "float16"
    assert shape.lora_r == 16 and shape.lora_targets == ("q_proj", "k_proj", "v_proj", "o_proj")
    assert shape.batch == 1 and shape.checkpointing
    unsloth = strategy.read_shape(script(UNSLOTH))
    assert unsloth.unsloth and unsloth.model == "llama-8b" and unsloth.seq_len == 2048 and unsloth.bits == 16
    assert unsloth.checkpointing  # Unsloth's get_peft_model checkpoints unless told not to
    assert strategy.read_shape("model.gradient_checkpointing_enable()").checkpointing
    assert strategy.read_shape("m = prepare_model_for_kbit_training(m)").checkpointing
    assert not strategy.read_shape("m = prepare_model_for_kbit_training(m, use_gradient_checkpointing=False)").checkpointing


def test_the_estimate_counts_an_8b_model_and_shrinks_with_4_bits(llama_8b):
    config = strategy.read_config("llama-8b", llama_8b)
    sixteen = strategy.estimate(strategy.read_shape(script(NOTEBOOK.format(four_bit=False))), config, world=2)
    four = strategy.estimate(strategy.read_shape(script(NOTEBOOK.format(four_bit=True))), config, world=2)
    assert 7.9e9 < sixteen.params < 8.1e9  # Llama 3 8B: 8.03B
    assert 14.5 * GiB < sixteen.parts["weights"] < 15.5 * GiB
    assert 4.5 * GiB < four.parts["weights"] < 6 * GiB  # 4-bit linears, 16-bit embeddings and head
    assert sixteen.trainable == 32 * 16 * (2 * (4096 + 4096) + 2 * (4096 + 1024))  # q, o: 4096→4096; k, v: →1024
    assert sixteen.ddp - sixteen.fsdp > 0.4 * sixteen.parts["weights"]  # half the weights, less two gathered layers


def test_auto_picks_each_strategy_on_stated_memory_sizes(llama_8b):
    text16, text4 = script(NOTEBOOK.format(four_bit=False)), script(NOTEBOOK.format(four_bit=True))
    t4 = (int(14.6 * GiB),) * 2  # Kaggle's 2×T4
    assert strategy.decide(text4, llama_8b, gpu_free=t4).strategy == "ddp"  # 8B in 4 bits fits one T4
    fsdp = strategy.decide(text16, llama_8b, gpu_free=t4)  # 8B LoRA in 16 bits does not
    assert fsdp.strategy == "fsdp", fsdp.summary()
    assert "does not fit the smallest GPU" in fsdp.summary() and "fsdp over 2" in fsdp.summary()
    split = strategy.decide(text16, llama_8b, gpu_free=(int(6 * GiB),) * 4)  # fsdp needs 2 layers and activations
    assert split.strategy == "split", split.summary()
    assert "slower than one GPU" in split.summary()
    assert strategy.decide(text16, llama_8b, gpu_free=(80 * GiB,) * 2).strategy == "ddp"  # an H100 holds it


def test_unsloth_is_never_sharded_and_an_unknown_model_runs_ddp(llama_8b):
    t4 = (int(14.6 * GiB),) * 2
    unsloth = strategy.decide(script(UNSLOTH), llama_8b, gpu_free=t4)
    assert unsloth.strategy == "split" and "FSDP cannot shard" in unsloth.summary()
    with pytest.raises(NbddpError, match="cannot shard a model Unsloth loads"):
        strategy.decide(script(UNSLOTH), llama_8b, "fsdp")
    unknown = strategy.decide(script(NOTEBOOK.format(four_bit=False)), llama_8b / "elsewhere", gpu_free=t4)
    assert unknown.strategy == "ddp" and "the size of llama-8b is unknown here" in unknown.summary()


def test_the_public_unsloth_kaggle_notebook_runs_ddp_on_two_t4s(llama_8b):
    """Unsloth's Llama 3.1 8B Alpaca notebook (4-bit, max_seq_length 2048, batch 2) trains on one T4: its
    checkpointing keeps each layer's input in host memory and its loss is chunked. Counted as transformers'
    own, it was 19.2 GiB a rank and auto sent it to split (one process, slower than one GPU)."""
    import nbformat

    sys.path.insert(0, str(Path(__file__).parent / "gpu"))
    import prove_unsloth

    nb = prove_unsloth.public_notebook()
    for cell in nb.cells:
        cell.source = cell.source.replace('"unsloth/Llama-3.1-8B"', '"llama-8b"')
    nbformat.write(nb, llama_8b / "nb.ipynb")
    text = convert_notebook(llama_8b / "nb.ipynb").text
    t4s = (int(14.5 * GiB),) * 2
    decision = strategy.decide(text, llama_8b, gpu_free=t4s)
    assert decision.strategy == "ddp", decision.summary()
    assert decision.estimate.parts["activations"] < 3 * GiB
    kept = strategy.decide(text.replace('use_gradient_checkpointing = "unsloth"', "use_gradient_checkpointing = True"),
                           llama_8b, gpu_free=t4s)
    assert kept.estimate.parts["activations"] > decision.estimate.parts["activations"] + 3 * GiB  # inputs stay


def test_deepspeed_is_refused_with_the_reason_when_it_is_not_installed(monkeypatch, llama_8b):
    text = script(NOTEBOOK.format(four_bit=False))
    monkeypatch.setattr(strategy, "_installed", lambda name: False)
    with pytest.raises(NbddpError, match="needs DeepSpeed, which is not installed here: pip install deepspeed"):
        strategy.decide(text, llama_8b, "deepspeed")
    monkeypatch.setattr(strategy, "_installed", lambda name: True)
    assert strategy.decide(text, llama_8b, "deepspeed", gpu_free=(15 * GiB,) * 2).strategy == "deepspeed"
    with pytest.raises(NbddpError, match="--strategy takes one of"):
        strategy.decide(text, llama_8b, "zero")


def test_deepspeed_is_refused_where_there_is_no_gpu(monkeypatch, llama_8b):
    """On the CPU the Trainer leaves DeepSpeed off (its CPU branch comes first): with DeepSpeed installed, a
    2-rank gloo run under ``--strategy deepspeed`` trained plain DDP while the ranks said ZeRO."""
    monkeypatch.setattr(strategy, "_installed", lambda name: True)
    monkeypatch.setattr(strategy, "_gpu_count", lambda: 0)
    with pytest.raises(NbddpError, match="--strategy deepspeed needs GPUs: on the CPU the Trainer turns DeepSpeed"):
        strategy.decide(script(NOTEBOOK.format(four_bit=False)), llama_8b, "deepspeed")


def test_the_ranks_get_a_zero_config_the_trainer_fills_in():
    from nbddp.runtime.apply_strategy import deepspeed_config

    three = deepspeed_config(3)
    assert three["zero_optimization"]["stage"] == 3 and three["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"]
    assert three["train_micro_batch_size_per_gpu"] == "auto" and three["bf16"] == {"enabled": "auto"}
    assert "stage3_gather_16bit_weights_on_model_save" not in deepspeed_config(2)["zero_optimization"]


def test_split_launches_one_process_and_tells_the_ranks(llama_8b):
    from nbddp.job import strategy_launch

    said = []
    converted = convert_cells(cells_from_sources([NOTEBOOK.format(four_bit=False)]))
    nproc, env = strategy_launch(converted, llama_8b, "split", 2, {"A": "1"}, lambda stream, text: said.append(text))
    assert nproc == 1 and env == {"A": "1", "NBDDP_STRATEGY": "split"}
    assert "strategy split" in said[0] and "slower than one GPU" in said[0]


PLAIN_LOOP = """import torch
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for x in torch.randn(8, 4):
    model(x).sum().backward()
    optimizer.step()
"""


def test_fsdp_refuses_a_plain_loop_saving_its_whole_model_before_launch(llama_8b):
    from nbddp.job import strategy_launch

    def launch_with(strategy_name, save):
        converted = convert_cells(cells_from_sources([PLAIN_LOOP, "print('done')\n" + save]))
        return strategy_launch(converted, llama_8b, strategy_name, 2, {}, lambda stream, text: None)

    with pytest.raises(NbddpError, match=r"^cell 2, line 2: torch.save of the whole model cannot work under "
                                         r"--strategy fsdp.*torch.save\(model.state_dict\(\), PATH\)"):
        launch_with("fsdp", "torch.save(model, 'model.pt')")
    assert launch_with("ddp", "torch.save(model, 'model.pt')")[1]["NBDDP_STRATEGY"] == "ddp"  # DDP pickles it whole
    assert launch_with("fsdp", "torch.save(model.state_dict(), 'model.pt')")[1]["NBDDP_STRATEGY"] == "fsdp"


def test_fsdp_refuses_a_whole_model_save_however_the_call_names_its_arguments(llama_8b):
    """The converter's facts see the save in the notebook's call, not in how the script spells it: the saved
    object given as ``obj=`` is the whole model too."""
    from nbddp.job import strategy_launch

    for save in ("torch.save(obj=model, f='model.pt')", "torch.save(f='model.pt', obj=model)"):
        converted = convert_cells(cells_from_sources([PLAIN_LOOP, "print('done')\n" + save]))
        assert converted.whole_model_saves == ((2, 2),)
        with pytest.raises(NbddpError, match=r"^cell 2, line 2: torch.save of the whole model cannot work"):
            strategy_launch(converted, llama_8b, "fsdp", 2, {}, lambda stream, text: None)


def test_fsdp_refuses_a_plain_loop_running_its_model_on_rank_0_alone_before_launch(llama_8b):
    from nbddp.job import strategy_launch

    def launch_with(strategy_name, tail):
        converted = convert_cells(cells_from_sources([PLAIN_LOOP, tail]))
        return strategy_launch(converted, llama_8b, strategy_name, 2, {}, lambda stream, text: None)

    evaluate = "model.eval()\nwith torch.no_grad():\n    print(model(torch.ones(4)))"
    with pytest.raises(NbddpError, match=r"^cell 2, line 3: rank 0 alone runs the model here .* --strategy ddp or"):
        launch_with("fsdp", evaluate)
    assert launch_with("ddp", evaluate)[1]["NBDDP_STRATEGY"] == "ddp"
    reloaded = ("torch.save(model.state_dict(), 'w.pt')\nmodel = torch.nn.Linear(4, 1)\n"
                "model.load_state_dict(torch.load('w.pt'))\nprint(model(torch.ones(4)))")
    assert launch_with("fsdp", reloaded)[1]["NBDDP_STRATEGY"] == "fsdp"  # a plain model, loaded from the weights


def test_a_kaggle_export_under_fsdp_refuses_a_whole_model_save_too(llama_8b):
    import nbformat

    from nbddp.export import export_kaggle

    cells = [PLAIN_LOOP, "torch.save(model, 'model.pt')"]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    nbformat.write(nb, llama_8b / "nb.ipynb")
    with pytest.raises(NbddpError, match=r"^cell 2, line 1: torch.save of the whole model cannot work"):
        export_kaggle(llama_8b / "nb.ipynb", llama_8b / "fsdp", kernel_id="me/plain-loop", strategy="fsdp")
    assert not (llama_8b / "fsdp").exists()
    export_kaggle(llama_8b / "nb.ipynb", llama_8b / "ddp", kernel_id="me/plain-loop", strategy="ddp")


# ---- in the ranks ----------------------------------------------------------------------------------------


def run_job(tmp_path, job: str, nproc: int, **env):
    run_dir = new_run_dir(tmp_path / "runs", job)
    chunks = []
    result = launch(plan(JOBS / job, run_dir, RunOptions(timeout_s=600), nproc=nproc, cwd=tmp_path, env=env),
                    sink=lambda stream, text: chunks.append(text))
    out = "".join(chunks)
    assert result.ok, (result.failure and result.failure.message[-3000:]) or out[-3000:]
    assert "JOB OK" in out
    return result, out


def rank_lines(result, nproc: int, pattern: str) -> list[list[re.Match]]:
    logs = [result.rank_log(rank).read_text() for rank in range(nproc)]
    return [list(re.finditer(pattern, log)) for log in logs]


def losses(out: str) -> list[float]:
    return json.loads(re.search(r"losses (\[.*\])", out).group(1))


def assert_half_the_weights_on_each_rank(result):
    held = rank_lines(result, 2, r"rank (\d) holds (\d+) of (\d+) elements \((\w+)\)")
    for rank, found in enumerate(held):
        (m,) = found
        assert m.group(4).startswith("FSDP"), m.group(0)
        assert 0.45 < int(m.group(2)) / int(m.group(3)) < 0.55, m.group(0)


@pytest.mark.e2e
def test_fsdp_trains_lora_with_the_trainer_and_saves_the_adapter_once(tmp_path):
    result, out = run_job(tmp_path, "fsdp_trainer.py", 2, NBDDP_STRATEGY="fsdp")
    assert "strategy fsdp" in out
    assert_half_the_weights_on_each_rank(result)
    loss = losses(out)
    assert loss[-1] < loss[0] - 0.1, loss
    # rank 0 alone saves, after training, as the converter leaves it: the weights were gathered as train() ended
    saves = [m.group(0) for found in rank_lines(result, 2, r"SAVED by rank \d: .*") for m in found]
    assert saves == ["SAVED by rank 0: adapter/adapter_model.safetensors",
                     "SAVED by rank 0: adapter_direct/adapter_model.safetensors"]
    from safetensors.torch import load_file

    adapter = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    direct = load_file(tmp_path / "adapter_direct" / "adapter_model.safetensors")
    assert len(adapter) == 8 and adapter.keys() == direct.keys()  # lora_A and lora_B of q, v in 2 layers
    assert {tuple(t.shape) for k, t in adapter.items() if "lora_A" in k} == {(4, 64)}  # whole, not a shard
    assert all(adapter[k].equal(direct[k]) and adapter[k].abs().sum() > 0 for k in adapter)


@pytest.mark.e2e
def test_fsdp_shards_a_plain_loop_through_nbddp_ddp(tmp_path):
    result, out = run_job(tmp_path, "fsdp_loop.py", 2, NBDDP_STRATEGY="fsdp")
    assert_half_the_weights_on_each_rank(result)
    loss = losses(out)
    assert sum(loss[-4:]) / 4 < sum(loss[:4]) / 4 - 0.1, loss


@pytest.mark.e2e
def test_split_trains_in_one_process(tmp_path):
    result, out = run_job(tmp_path, "split_trainer.py", 1, NBDDP_STRATEGY="split")
    assert "device_map 'balanced', world size 1" in out
    assert result.rank_log(1) is None  # one process
    assert "process group: False" in out  # not a distributed job to accelerate: a model over several GPUs trains
    loss = losses(out)
    assert loss[-1] < loss[0] - 0.1, loss


def test_the_doctor_shows_the_estimate_for_the_notebook_at_hand(llama_8b, monkeypatch, capsys):
    import nbformat

    from nbddp import cli, doctor

    t4s = [{"name": "Tesla T4", "local_rank": i, "capability": "7.5", "total_bytes": 15 * GiB,
            "free_bytes": int(14.6 * GiB), "bf16": False} for i in range(2)]
    check = doctor.memory_check(script(NOTEBOOK.format(four_bit=False)), llama_8b, t4s)
    assert check.name == "memory" and check.status == "info"
    assert check.detail.startswith("strategy fsdp (auto chose it)") and "ddp 19.2 GiB" in check.detail
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(NOTEBOOK.format(four_bit=True))])
    nbformat.write(nb, llama_8b / "nb.ipynb")
    probe = doctor.Probe(t4s, doctor.Check("all-reduce", "ok", "fine"))
    monkeypatch.setattr(doctor, "all_reduce_probe", lambda **kwargs: probe)
    assert cli.main(["doctor", str(llama_8b / "nb.ipynb")]) == 0
    out = capsys.readouterr().out
    assert "memory" in out and "strategy ddp (auto chose it): a whole replica" in out


def test_a_memory_cap_makes_auto_choose_as_on_a_smaller_gpu(monkeypatch):
    monkeypatch.setattr(strategy, "_ask_gpus", lambda timeout_s: (140 * GiB, 140 * GiB))
    assert strategy.gpu_free_bytes() == (140 * GiB, 140 * GiB)
    monkeypatch.setenv("NBDDP_GPU_MEMORY_GIB", "15")
    assert strategy.gpu_free_bytes() == (15 * GiB, 15 * GiB)


@pytest.mark.parametrize("name, expected", [("ddp", {"": "cpu"}), ("split", "balanced"), ("fsdp", None)])
def test_the_device_map_a_loader_gets_under_each_strategy(monkeypatch, name, expected):
    from nbddp.runtime import dist, rank

    monkeypatch.setenv("NBDDP_STRATEGY", name)
    monkeypatch.setattr(rank, "_info", None)
    assert dist.device_map() == expected


@pytest.mark.parametrize("name", ["sft_lora", "qlora_4bit", "torch_classifier"])
def test_a_templates_strategy_parameter_reaches_the_job(name, monkeypatch):
    import nbformat

    import nbddp.display
    import nbddp.template

    nb = nbformat.read(Path(__file__).resolve().parents[1] / "templates" / f"{name}.ipynb", as_version=4)
    (parameters,) = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert 'strategy: str = "auto"' in parameters.source
    asked = {}

    class Done:
        ok = True

    monkeypatch.setattr(nbddp.template, "run_template", lambda path, ns, **kwargs: (asked.update(kwargs), Done()))
    monkeypatch.setattr(nbddp.display, "summary", lambda result: "")
    exec(nb.cells[-1].source, {"nproc": 0, "strategy": "split"})
    assert asked == {"nproc": None, "strategy": "split"}


def test_the_kaggle_export_decides_for_kaggles_gpus_and_tells_the_launcher(llama_8b):
    import nbformat

    from nbddp.export import export_kaggle

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(NOTEBOOK.format(four_bit=False))])
    nbformat.write(nb, llama_8b / "big.ipynb")
    # the notebook has no train(): exported only as asked, as nbddp run runs it
    auto = export_kaggle(llama_8b / "big.ipynb", llama_8b / "auto", kernel_id="me/big-model", every_rank=True)
    text = next((llama_8b / "auto").glob("*.py")).read_text()
    assert 'os.environ.setdefault("NBDDP_STRATEGY", "fsdp")' in text  # 8B LoRA in 16 bits on 2×T4
    assert any(w.startswith("strategy fsdp (auto chose it)") for w in auto.warnings)
    export_kaggle(llama_8b / "big.ipynb", llama_8b / "split", kernel_id="me/big-model", strategy="split",
                  every_rank=True)
    text = next((llama_8b / "split").glob("*.py")).read_text()
    assert 'NBDDP_STRATEGY", "split")' in text and 'os.environ.setdefault("NBDDP_NPROC", "1")' in text
    cpu = export_kaggle(llama_8b / "big.ipynb", llama_8b / "cpu", kernel_id="me/big-model", accelerator="none",
                       every_rank=True)
    assert 'NBDDP_STRATEGY", "ddp")' in next((llama_8b / "cpu").glob("*.py")).read_text()
    assert not [w for w in cpu.warnings if w.startswith("strategy")]  # plain DDP, chosen: nothing to say


def test_strategy_reaches_the_job_from_the_cli_and_the_magic(monkeypatch, tmp_path):
    import nbddp.job
    from nbddp import cli
    from nbddp.magics import NbddpMagics
    asked = {}

    def run_job(source, options, *views, **kwargs):
        asked.update(vars(options))
        raise NbddpError("stop here")

    monkeypatch.setattr(nbddp.job, "run_job", run_job)
    from conftest import write_notebook

    write_notebook(tmp_path / "nb.ipynb", [PLAIN_LOOP])
    assert cli.main(["run", str(tmp_path / "nb.ipynb"), "--strategy", "fsdp"]) == 2
    assert asked["strategy"] == "fsdp"
    assert cli._parser().parse_args(["run", "nb.ipynb"]).strategy == "auto"
    magic = NbddpMagics.ddp_train.parser.parse_args(["--strategy", "split"])
    assert RunOptions.parse(magic).strategy == "split"
    assert "--strategy" in NbddpMagics.ddp_train.__doc__


TINY_NOTEBOOK = [
    """import torch
from nbddp import demo
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorForLanguageModeling, Trainer, TrainingArguments
path = demo.tiny_model()
tokenizer = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))""",
    """data = demo.arithmetic_dataset(64).map(
    lambda row: tokenizer(row["text"], padding="max_length", max_length=16, truncation=True), remove_columns=["text"])
args = TrainingArguments(output_dir="out", max_steps=8, per_device_train_batch_size=4, learning_rate=3e-3,
                         logging_steps=2, save_strategy="no", report_to="none")
trainer = Trainer(model=model, args=args, train_dataset=data,
                  data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False))
trainer.train()""",
    """trainer.save_model("adapter")
print("adapter saved", type(trainer.model_wrapped).__name__)""",
]


@pytest.mark.e2e
def test_a_notebook_trains_under_fsdp_through_run_job(tmp_path):
    import nbformat

    from nbddp.job import run_job

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in TINY_NOTEBOOK])
    nbformat.write(nb, tmp_path / "tiny.ipynb")
    chunks = []
    job = run_job(tmp_path / "tiny.ipynb", RunOptions(strategy="fsdp", runs_dir=tmp_path / "runs", timeout_s=600),
                  Said(chunks))
    out = "".join(chunks)
    assert job.ok, (job.failure and job.failure.message[-3000:]) or out[-3000:]
    assert "nbddp: strategy fsdp: asked for with --strategy" in out
    assert "adapter saved FSDPPeftModelForCausalLM" in out  # saved by rank 0 alone, as converted
    assert (tmp_path / "adapter" / "adapter_model.safetensors").exists()


@pytest.mark.parametrize("peaks_file, shapes, low, high", [
    ("memory_estimate_peaks.jsonl", "SHAPES", 0.95, 1.2),
    # Unsloth's loss chunks take what the GPU leaves (more on an H100 than on a T4): kept on the safe side
    ("memory_estimate_unsloth_peaks.jsonl", "UNSLOTH_SHAPES", 1.0, 1.4),
])
def test_the_estimate_stays_near_the_peaks_a_gpu_measured(peaks_file, shapes, low, high):
    """The estimate against the committed peaks of ``benchmarks/memory_estimate.py`` (one H100; six Trainer +
    PEFT shapes, three of Unsloth's): never far below a peak (auto would send a job that does not fit to DDP),
    never far above (it would send one that fits to a slower strategy)."""
    root = Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(root / "benchmarks"))
    try:
        import memory_estimate
    finally:
        sys.path.remove(str(root / "benchmarks"))
    peaks = [json.loads(line) for line in (root / "benchmarks/results" / peaks_file).read_text().splitlines()]
    assert len(peaks) == len(getattr(memory_estimate, shapes))
    for peak in peaks:
        ratio = memory_estimate.estimate_for(peak["shape"]).ddp / peak["peak"]
        assert low <= ratio <= high, (peak["shape"], ratio)


PREDICTS = '''
import torch, pandas as pd
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained("llama-8b", torch_dtype=torch.float16)
tok = AutoTokenizer.from_pretrained("llama-8b")
answers = []
for prompt in ["a", "b", "c"]:
    ids = tok(prompt, return_tensors="pt").input_ids
    answers.append(tok.decode(model.generate(ids, max_new_tokens=8)[0]))
pd.DataFrame({"answer": answers}).to_csv("submission.csv")
'''


def _settle(source: str, folder, gpus, requested="auto"):
    converted = convert_cells(cells_from_sources([source]))
    assert converted.predicts and not converted.trains
    return strategy.settle(converted, folder, requested, gpu_free=gpus, gpu_count=len(gpus))


def test_a_notebook_that_only_predicts_is_sized_for_inference(llama_8b):
    """An 8B model in 16 bits that only generates needs its weights and a cache, not gradients and AdamW's states:
    on two 40 GB GPUs each rank holds a replica and predicts its half (it was sized as a full fine-tune, 126 GiB,
    and sent to split: one process, no faster, told to turn on gradient checkpointing)."""
    a100 = (int(39 * GiB),) * 2
    decision = _settle(PREDICTS, llama_8b, a100)
    assert decision.strategy == "ddp", decision.summary()
    said = decision.summary()
    assert "inference" in said and "gradients" not in said and "optimizer" not in said and "fine-tune" not in said
    assert 15 * GiB < decision.estimate.ddp < 24 * GiB  # the weights are 15 GiB


def test_a_prediction_too_big_for_one_gpu_is_split_never_sharded(llama_8b):
    """On two T4s the 8B model's 15 GiB of weights fit neither: split over both in one process, never FSDP (each
    rank predicts its own rows, and a sharded model's every forward needs every rank), even where FSDP would fit."""
    t4 = (int(14.6 * GiB),) * 2
    decision = _settle(PREDICTS, llama_8b, t4)
    assert decision.strategy == "split", decision.summary()
    assert "gradient checkpointing" not in decision.summary()
    many = _settle(PREDICTS, llama_8b, (int(10 * GiB),) * 8)  # FSDP over 8 would hold 2 GiB of weights a rank
    assert many.strategy == "split", many.summary()
    with pytest.raises(NbddpError, match="only predicts.*--strategy split"):
        _settle(PREDICTS, llama_8b, t4, requested="fsdp")


def test_a_predictions_activations_are_counted_in_the_models_width():
    config = {**LLAMA_8B, "model_type": "llama"}
    half = strategy.estimate(strategy.JobShape(model="m", dtype="float16"), config, world=2, predicting=True)
    full = strategy.estimate(strategy.JobShape(model="m", dtype="float32"), config, world=2, predicting=True)
    assert full.parts["activations"] == 2 * half.parts["activations"]
    assert full.parts["attention cache"] == 2 * half.parts["attention cache"]
