"""The pipeline_device shim: under a process group, transformers drops a pipeline's ``device`` for its model's;
the shim makes it choose as one process would, with "the GPU" read as this rank's.

On two H200s both ranks' ``pipeline(…, device=0)`` ran on the CPU without it (``tests/gpu/prove_pipeline_dataset.py``).
Here, without GPUs, ``"meta"`` stands for the device the notebook names: a real process group of one (gloo, a file
store) is enough for transformers to drop it.
"""

import pytest
import torch
import torch.distributed as dist

from nbddp.runtime import rank, shims
from nbddp.runtime.shims import pipeline_device
from nbddp.runtime.shims.pipeline_device import rank_device

transformers = pytest.importorskip("transformers")
from transformers.pipelines import base  # noqa: E402


class Spread:
    hf_device_map = {"encoder": 0, "head": 1}


@pytest.mark.parametrize(("device", "model", "wanted"), [
    (None, None, 1),  # one process's pipeline takes GPU 0 where it is given no device
    (0, None, 1),
    (1, None, 1),
    ("cuda", None, "cuda:1"),
    ("cuda:0", None, "cuda:1"),
    (torch.device("cuda", 0), None, "cuda:1"),
    (-1, None, -1),
    ("cpu", None, "cpu"),
    (None, Spread(), None),  # accelerate's map decides; the pipeline never moves that model
])
def test_a_gpu_the_notebook_names_or_implies_becomes_this_ranks(device, model, wanted):
    assert rank_device(device, model, local_rank=1, cuda=True) == wanted


@pytest.mark.parametrize("device", [None, 0, "cuda", "cpu", -1])
def test_without_cuda_the_device_is_left_to_transformers(device):
    assert rank_device(device, None, local_rank=1, cuda=False) == device


def tiny_classifier():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import BertConfig, BertForSequenceClassification, PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "good", "bad", "movie"])}
    wordlevel = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    wordlevel.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=wordlevel, unk_token="[UNK]", pad_token="[PAD]",
                                        cls_token="[CLS]", sep_token="[SEP]")
    model = BertForSequenceClassification(BertConfig(vocab_size=len(vocab), hidden_size=8, num_hidden_layers=1,
                                                     num_attention_heads=2, intermediate_size=16)).eval()
    return model, tokenizer


@pytest.fixture
def process_group(tmp_path, monkeypatch):
    monkeypatch.setattr(base.Pipeline, "__init__", base.Pipeline.__init__)  # the shim's patch stays in this test
    monkeypatch.setattr(rank, "_said", set())
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def make_pipeline(device):
    from transformers import pipeline

    model, tokenizer = tiny_classifier()
    return pipeline("text-classification", model=model, tokenizer=tokenizer, device=device)


def test_transformers_drops_the_named_device_under_a_process_group_without_the_shim(process_group):
    assert str(make_pipeline("meta").device) == "cpu"  # the model's device, not the one named


def test_the_shim_keeps_the_named_device_and_says_so_once(process_group, capsys):
    (report,) = shims.apply_all(log=print, names=("pipeline_device",))
    assert report.applied and report.message is None  # nothing said for a job that makes no pipeline
    first, second = make_pipeline("meta"), make_pipeline("meta")
    assert str(first.device) == str(second.device) == "meta"
    assert first.model.device.type == "meta"  # moved there, as one process's pipeline moves its model
    said = capsys.readouterr().out
    assert said.count("runs on this rank's own device") == 1, said


def test_the_shim_leaves_a_pipeline_whose_device_is_already_its_models_unsaid(process_group, capsys):
    pipeline_device.patch(base)
    assert str(make_pipeline("cpu").device) == "cpu"
    assert capsys.readouterr().out == ""


def test_without_a_process_group_the_patched_pipeline_is_transformers_own(monkeypatch):
    monkeypatch.setattr(base.Pipeline, "__init__", base.Pipeline.__init__)
    pipeline_device.patch(base)
    assert str(make_pipeline("meta").device) == "meta"
    assert base._is_torch_distributed_initialized is not None and not dist.is_initialized()
