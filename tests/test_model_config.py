"""The memory estimate reads a model's shape as transformers does: through its config class and
``attribute_map`` (DistilBERT's ``dim``, GPT-2's ``n_embd``, T5's and BART's ``d_model``), for every config
class transformers ships; what it cannot read is "size unknown", and any slip in the strategy's decision
falls back to DDP (or refuses the strategy asked for) with one line saying why."""

import json
import logging
import warnings

import pytest

from nbddp import choose_strategy as strategy
from nbddp import model_config
from nbddp.errors import NbddpError
from nbddp.model_config import Dims, SizeUnknown

transformers = pytest.importorskip("transformers")
GiB = 2**30
TWO_H100 = (80 * GiB,) * 2
LOADS_M = 'from transformers import AutoModel\nmodel = AutoModel.from_pretrained("m")\n'

#: Config classes of this transformers that cannot be built with their defaults alone (their own validation
#: refuses them); every other entry of CONFIG_MAPPING is held to "an estimate or size unknown".
CANNOT_BUILD_WITH_DEFAULTS = {
    "gemma4_assistant": "validate_architecture wants hidden_size_per_layer_input set",
    "nougat": "its vision sub-config's model_type (donut_swin) is not a CONFIG_MAPPING key",
}


def write_config(folder, config) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(config if isinstance(config, str) else config.to_json_string())


@pytest.mark.parametrize("model_type, millions", [
    ("distilbert", 66.4), ("gpt2", 124.4), ("t5", 60.5), ("bart", 406.3), ("llama", 6738), ("bert", 109.5),
])
def test_each_architecture_is_read_by_its_own_names(tmp_path, model_type, millions):
    """Defaults of each class are its reference checkpoint (distilbert-base, gpt2, t5-small, bart-large,
    Llama 2 7B, bert-base): the estimate counts their published sizes within 10%."""
    write_config(tmp_path / "m", transformers.CONFIG_MAPPING[model_type]())
    decision = strategy.decide(LOADS_M, tmp_path, gpu_free=TWO_H100)
    assert decision.estimate, decision.reason
    assert 0.9 < decision.estimate.params / (millions * 1e6) < 1.1, decision.estimate.params


def test_an_encoder_decoder_counts_its_encoder_and_its_decoder():
    t5 = Dims.of(transformers.T5Config(num_layers=6, num_decoder_layers=2).to_dict())
    assert (t5.layers, t5.cross_layers) == (8, 2)
    bart = Dims.of(transformers.BartConfig(encoder_layers=3, decoder_layers=5).to_dict())
    assert (bart.layers, bart.cross_layers) == (8, 5)
    assert not bart.gated and Dims.of(transformers.LlamaConfig().to_dict()).gated


def test_every_config_class_transformers_ships_gives_an_estimate_or_size_unknown(tmp_path):
    """Each entry of CONFIG_MAPPING, built with its defaults and written as config.json, through the whole
    decision: a Decision, never an exception."""
    logging.getLogger("transformers").setLevel(logging.ERROR)
    results, cannot_build = {}, set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for model_type in sorted(transformers.CONFIG_MAPPING.keys()):
            try:
                config = transformers.CONFIG_MAPPING[model_type]()
            except Exception:
                cannot_build.add(model_type)
                continue
            write_config(tmp_path / "m", config)
            results[model_type] = strategy.decide(LOADS_M, tmp_path, gpu_free=TWO_H100)
    assert cannot_build == set(CANNOT_BUILD_WITH_DEFAULTS)
    unknown = {t: d.reason for t, d in results.items() if d.estimate is None}
    assert all(d.strategy == "ddp" and "size of m is unknown" in d.reason and "\n" not in d.reason
               for d in (results[t] for t in unknown)), unknown
    assert not unknown.keys() & {"llama", "mistral", "qwen2", "gemma", "gpt2", "bert", "distilbert", "t5", "bart",
                                 "whisper", "llava", "mixtral", "roberta", "vit"}
    assert len(results) - len(unknown) > 0.8 * len(results), unknown


@pytest.mark.parametrize("config, reason", [
    ("{not json", "its config.json cannot be read (JSONDecodeError"),
    ("[1, 2]", "its config.json holds a list, not an object"),
    (json.dumps({"model_type": "no-such-model", "hidden_size": 8}), "its model_type 'no-such-model' is not one"),
    (json.dumps({"model_type": "resnet"}), "its ResNetConfig gives no hidden size"),
    (json.dumps({"model_type": "llama", "hidden_size": "wide"}), "transformers cannot build its LlamaConfig"),
])
def test_a_config_it_cannot_read_is_size_unknown_and_said(tmp_path, config, reason):
    write_config(tmp_path / "m", config)
    decision = strategy.decide(LOADS_M, tmp_path, gpu_free=TWO_H100)
    assert decision.strategy == "ddp" and decision.estimate is None
    assert f"the size of m is unknown: {reason}" in decision.reason
    asked = strategy.decide(LOADS_M, tmp_path, "fsdp", gpu_free=TWO_H100)  # said as a note under a chosen strategy
    assert asked.strategy == "fsdp" and any(reason in n for n in asked.notes)


def test_without_transformers_the_size_is_unknown(tmp_path, monkeypatch):
    write_config(tmp_path / "m", transformers.DistilBertConfig())
    monkeypatch.setitem(__import__("sys").modules, "transformers", None)
    decision = strategy.decide(LOADS_M, tmp_path, gpu_free=TWO_H100)
    assert "transformers is not installed here" in decision.reason and decision.strategy == "ddp"


def test_any_failure_in_the_decision_falls_back_to_ddp_or_refuses_naming_it(tmp_path, monkeypatch):
    def broken(text):
        raise RuntimeError("the facts could not be read")

    monkeypatch.setattr(strategy, "read_shape", broken)
    for asked in ("auto", "ddp"):
        decision = strategy.decide(LOADS_M, tmp_path, asked, gpu_free=TWO_H100)
        assert decision.strategy == "ddp" and decision.fallback
        assert decision.summary().splitlines()[0].startswith("nbddp: strategy ddp")
        said = "could not decide the strategy (RuntimeError: the facts could not be read); DDP assumed"
        assert said in decision.summary()
    for asked in ("fsdp", "split", "deepspeed"):
        with pytest.raises(NbddpError, match=f"--strategy {asked} could not be prepared.*RuntimeError: the facts"):
            strategy.decide(LOADS_M, tmp_path, asked, gpu_free=TWO_H100)


def test_size_unknown_is_an_exception_of_its_own():
    with pytest.raises(SizeUnknown, match="gives no hidden size"):
        Dims.of({"model_type": "resnet"})


@pytest.mark.parametrize("model_type", sorted(model_config.PLAIN_FAMILIES))
def test_a_llama_like_config_is_read_from_its_json_with_the_sizes_its_class_gives(model_type, monkeypatch):
    # no transformers (and so no torch) in the launcher for the common families, the same sizes as their class
    config = transformers.CONFIG_MAPPING[model_type](hidden_size=512, intermediate_size=1376, num_hidden_layers=3,
                                                     num_attention_heads=8, num_key_value_heads=2, vocab_size=999)
    raw = json.loads(config.to_json_string(use_diff=False))
    assert model_config.plain_config(raw) is not None
    from_json = Dims.of(raw)
    monkeypatch.setattr(model_config, "plain_config", lambda raw: None)
    assert from_json == Dims.of(raw)  # through the config class
    monkeypatch.undo()
    for key in model_config.PLAIN_FAMILIES[model_type]:  # a key the JSON leaves out is the class's to fill in
        assert model_config.plain_config({k: v for k, v in raw.items() if k != key}) is None

