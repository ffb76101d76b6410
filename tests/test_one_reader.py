"""The converter is the one reader of notebook code: what the launcher needs (the model's shape, the output
folders) comes with the ``Script``, and one predicate says what loads a model."""

from nbddp import choose_strategy as strategy
from nbddp.cells import cells_from_sources
from nbddp.convert import convert_cells
from nbddp.convert.facts.shape import ShapeUnread, is_model_loader_owner


def test_a_base_model_class_and_a_peft_model_load_a_model_for_the_shape_and_the_device_map_alike():
    for owner in ("MistralModel", "PeftModel", "AutoPeftModelForCausalLM", "FastLanguageModel", "AutoModel"):
        assert is_model_loader_owner(owner), owner
    for owner in ("AutoTokenizer", "AutoConfig", "AutoImageProcessor", "", None):
        assert not is_model_loader_owner(owner), owner
    script = convert_cells(cells_from_sources(['m = MistralModel.from_pretrained("mistralai/Mistral-7B-v0.1")']))
    assert script.shape.model == "mistralai/Mistral-7B-v0.1"
    assert "device_map=_nbddp.device_map()" in script.text


def test_the_script_carries_its_shape_and_output_targets_at_the_notebooks_cells():
    script = convert_cells(cells_from_sources([
        'OUT = "runs/a"',
        'model = AutoModelForCausalLM.from_pretrained("x", load_in_4bit=True)\nargs = TrainingArguments(output_dir=OUT)',
        'trainer.train()\ntorch.save(model.state_dict(), "weights/m.pt")',
    ]))
    assert script.shape == strategy.read_shape(script.text) and script.shape.bits == 4
    assert [(t.folder, t.cell, t.line, t.what) for t in script.output_targets] == [
        ("runs/a", 2, 2, "TrainingArguments(output_dir=…)"), ("weights", 3, 2, "torch.save(…)")]


def test_a_slip_reading_the_shape_is_carried_to_the_strategy_which_falls_back_saying_it():
    script = convert_cells(cells_from_sources(['config = LoraConfig(r="eight")', "trainer.train()"]))
    assert isinstance(script.shape, ShapeUnread) and script.shape.why.startswith("ValueError: ")
    decision = strategy.decide(script.shape, gpu_free=())
    assert decision.strategy == "ddp" and decision.fallback == script.shape.why
