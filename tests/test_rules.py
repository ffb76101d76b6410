"""Each rule as before/after source pairs."""

import textwrap

import libcst as cst
import pytest

from nbddp.convert.rules import apply_rules, gather_facts


def rewrite(*cells):
    modules = [cst.parse_module(textwrap.dedent(c)) for c in cells]
    facts = gather_facts(modules)
    out, changes = [], []
    for pos, mod in enumerate(modules):
        new, ch = apply_rules(mod, facts, pos)
        out.append(new.code)
        changes += ch
    return out, changes


@pytest.mark.parametrize(
    "before, after",
    [
        ('m = AutoModelForCausalLM.from_pretrained("x", device_map="auto")\n',
         'm = AutoModelForCausalLM.from_pretrained("x", device_map=_nbddp.device_map())\n'),
        ('m = AutoModelForCausalLM.from_pretrained("x")\n',
         'm = AutoModelForCausalLM.from_pretrained("x", device_map=_nbddp.device_map())\n'),
        ('m = transformers.LlamaForCausalLM.from_pretrained("x", device_map={"": 0})\n',
         'm = transformers.LlamaForCausalLM.from_pretrained("x", device_map=_nbddp.device_map())\n'),
        ('t = AutoTokenizer.from_pretrained("x")\n', 't = AutoTokenizer.from_pretrained("x")\n'),
        ('p = AutoProcessor.from_pretrained("x")\n', 'p = AutoProcessor.from_pretrained("x")\n'),
        ('c = AutoConfig.from_pretrained("x")\n', 'c = AutoConfig.from_pretrained("x")\n'),
    ],
)
def test_device_map(before, after):
    (code,), _ = rewrite(before)
    assert code == after


def test_device_map_keeps_one_argument_per_line():
    (code,), changes = rewrite(
        """\
        model = AutoModelForCausalLM.from_pretrained(
            name,
            dtype=torch.bfloat16,
        )
        """
    )
    assert code == textwrap.dedent(
        """\
        model = AutoModelForCausalLM.from_pretrained(
            name,
            dtype=torch.bfloat16,
            device_map=_nbddp.device_map(),
        )
        """
    )
    assert changes == [("device_map", 1, "AutoModelForCausalLM.from_pretrained: no device_map → this rank's device")]


def test_trainer_config_gets_ddp_find_unused_parameters_unless_set():
    (a, b), _ = rewrite('args = SFTConfig(output_dir="o")\n', 'args2 = TrainingArguments("o", ddp_find_unused_parameters=True)\n')
    assert a == 'args = SFTConfig(output_dir="o", ddp_find_unused_parameters=False)\n'
    assert b == 'args2 = TrainingArguments("o", ddp_find_unused_parameters=True)\n'


def test_everything_after_the_last_training_call_is_rank_zero_only():
    cells, changes = rewrite(
        "trainer = SFTTrainer(model=m)\n",
        "x = 1\nstats = trainer.train()\nprint(stats)\n",
        "# save it\nmodel.save_pretrained('out')\n",
    )
    assert cells[0] == "trainer = SFTTrainer(model=m)\n"
    assert cells[1] == "x = 1\nstats = trainer.train()\nif _nbddp.is_main_process():\n    print(stats)\n"
    assert cells[2] == "# save it\nif _nbddp.is_main_process():\n    model.save_pretrained('out')\n"
    assert [c for c in changes if c[0] == "rank0_tail"] == [
        ("rank0_tail", 3, "runs on rank 0 only (after training)"),
        ("rank0_tail", 2, "runs on rank 0 only (after training)"),
    ]


def test_model_train_is_not_a_training_call():
    cells, _ = rewrite("model.train()\nprint('mode set')\n")
    assert cells[0] == "model.train()\nprint('mode set')\n"
