"""Each rule as before/after source pairs, with the rules' checks on (the fast path) and off."""

import textwrap

import pytest

from nbddp.convert.code import CellCode
from nbddp.convert.engine.plan import plan_cell
from nbddp.convert.engine.rewrite import rewrite as rewrite_cell
from nbddp.convert.facts import gather_facts
from nbddp.convert.rules import RULES

PRECHECK = {"on": True}


@pytest.fixture(autouse=True, params=["checks", "every statement"])
def precheck(request):
    """Every rule test runs twice: libcst only where the checks say, and libcst over every statement."""
    PRECHECK["on"] = request.param == "checks"
    yield
    PRECHECK["on"] = True


def rewrite(*cells):
    """Cells (dedented) through the rules; the new sources and the ``(rule, line, message)`` changes."""
    codes = [CellCode.read(textwrap.dedent(c), position=i) for i, c in enumerate(cells)]
    facts = gather_facts(codes)
    out, changes = [], []
    for code in codes:
        plan = plan_cell(code, facts, RULES, every_statement=not PRECHECK["on"])
        new, ch = rewrite_cell(code, plan, facts) if plan is not None else (code.code, [])
        out.append(new)
        changes += ch
    return out, changes


def dedent(text):
    return textwrap.dedent(text)


def test_every_rule_says_what_and_why():
    for rule in RULES:
        doc = rule.__doc__ or ""
        assert len(doc.split()) > 25, rule.__name__


def test_every_rule_has_a_name_of_its_own_and_the_statement_rules_come_first():
    assert len({rule.name for rule in RULES}) == len(RULES)
    kinds = [rule.on_statements for rule in RULES]
    assert kinds == sorted(kinds, reverse=True) and any(kinds) and not all(kinds)


def test_every_module_of_the_rules_package_holds_a_rule_of_the_list():
    import pkgutil

    import nbddp.convert.rules as package

    modules = {module.name for module in pkgutil.iter_modules(package.__path__)}
    assert modules == {rule.__module__.rpartition(".")[2] for rule in RULES}


# ------------------------------------------------------------------------------------------- device_map

DM = "device_map=_nbddp.device_map()"


@pytest.mark.parametrize(
    "spelling",
    ["", ', device_map=None', ', device_map="auto"', ', device_map="balanced"', ', device_map="sequential"',
     ', device_map="cuda:0"', ', device_map={"": 0}', ", device_map={'': torch.cuda.current_device()}"],
)
@pytest.mark.parametrize(
    "loader",
    ["AutoModelForCausalLM", "AutoModel", "AutoModelForSequenceClassification", "LlamaForCausalLM",
     "transformers.Qwen2ForCausalLM", "AutoPeftModelForCausalLM", "FastLanguageModel", "FastModel",
     "FastVisionModel", "unsloth.FastLanguageModel"],
)
def test_device_map_every_spelling_every_loader(loader, spelling):
    (code,), changes = rewrite(f'm = {loader}.from_pretrained("x"{spelling})\n')
    assert code == f'm = {loader}.from_pretrained("x", {DM})\n'
    assert [c[:2] for c in changes] == [("device_map", 1)]


@pytest.mark.parametrize("spelling", ["", ', device_map="auto"', ', device_map={"": 0}'])
def test_device_map_on_peft_model_loading_an_adapter(spelling):
    (code,), _ = rewrite(f'model = PeftModel.from_pretrained(base, "adapter", is_trainable=True{spelling})\n')
    assert code == f'model = PeftModel.from_pretrained(base, "adapter", is_trainable=True, {DM})\n'


@pytest.mark.parametrize(
    "src",
    ['t = AutoTokenizer.from_pretrained("x", device_map="auto")\n', 'p = AutoProcessor.from_pretrained("x")\n',
     'c = AutoConfig.from_pretrained("x")\n', 'i = AutoImageProcessor.from_pretrained("x")\n',
     'f = AutoFeatureExtractor.from_pretrained("x")\n', 't = LlamaTokenizerFast.from_pretrained("x")\n'],
)
def test_tokenizers_processors_and_configs_are_untouched(src):
    (code,), changes = rewrite(src)
    assert code == src and changes == []


def test_unsloth_loader_keeps_its_arguments_and_tuple_result():
    before = dedent(
        """\
        model, tokenizer = FastLanguageModel.from_pretrained(
            model_name = "unsloth/Llama-3.2-1B-Instruct",
            max_seq_length = max_seq_length,
            load_in_4bit = True,
        )
        """
    )
    (code,), _ = rewrite(before)
    assert code == before.replace("    load_in_4bit = True,\n", f"    load_in_4bit = True,\n    {DM},\n")


def test_device_map_keeps_one_argument_per_line():
    (code,), changes = rewrite(
        """\
        model = AutoModelForCausalLM.from_pretrained(
            name,
            dtype=torch.bfloat16,
        )
        """
    )
    assert code == dedent(
        f"""\
        model = AutoModelForCausalLM.from_pretrained(
            name,
            dtype=torch.bfloat16,
            {DM},
        )
        """
    )
    assert changes == [("device_map", 1, "AutoModelForCausalLM.from_pretrained: no device_map → this rank's device")]


@pytest.mark.parametrize("factory", ["pipeline", "transformers.pipeline"])
@pytest.mark.parametrize("spelling", ['device_map="auto"', 'device_map="balanced"', 'device_map={"": 0}'])
def test_a_pipeline_loading_its_model_with_a_device_map_loads_it_on_this_ranks_device(factory, spelling):
    """The model cards' form: ``pipeline("text-generation", model=model_id, device_map="auto")`` spread each rank's
    copy over every GPU."""
    (code,), changes = rewrite(f'pipe = {factory}("text-generation", model=model_id, {spelling}, dtype=torch.bfloat16)\n')
    assert code == f'pipe = {factory}("text-generation", model=model_id, {DM}, dtype=torch.bfloat16)\n'
    assert changes == [("device_map", 1, f"pipeline: {spelling} → this rank's device")]


@pytest.mark.parametrize("src", ['pipe = pipeline("text-classification", model=model_id)\n',
                                 'pipe = pipeline("text-classification", model=model, device=0)\n'])
def test_a_pipeline_without_a_device_map_is_left_to_its_device(src):
    (code,), changes = rewrite(src)
    assert code == src and changes == []


def test_device_map_with_star_kwargs_is_left_alone_and_said():
    (code,), changes = rewrite("m = AutoModelForCausalLM.from_pretrained(name, **load_kwargs)\n")
    assert code == "m = AutoModelForCausalLM.from_pretrained(name, **load_kwargs)\n"
    assert "left alone" in changes[0][2]


# ------------------------------------------------------------------------------------------- device


@pytest.mark.parametrize(
    "before, after",
    [
        ('device = torch.device("cuda:0")\n', "device = torch.device(_nbddp.device())\n"),
        ('x = x.to("cuda:0")\n', "x = x.to(_nbddp.device())\n"),
        ("t = torch.zeros(3, device='cuda:0')\n", "t = torch.zeros(3, device=_nbddp.device())\n"),
        ('d = "cuda:0" if torch.cuda.is_available() else "cpu"\n',
         'd = _nbddp.device() if torch.cuda.is_available() else "cpu"\n'),
        ("model.cuda(0)\n", "model.cuda(_nbddp.device())\n"),
        ("torch.cuda.set_device(0)\n", "torch.cuda.set_device(_nbddp.device())\n"),
        ('os.environ["CUDA_VISIBLE_DEVICES"] = "0"\n', "pass  # nbddp: CUDA_VISIBLE_DEVICES left to torchrun\n"),
        # a bare "cuda" and .cuda() already mean this rank's device once setup() ran
        ('device = torch.device("cuda")\n', 'device = torch.device("cuda")\n'),
        ("model = model.cuda()\n", "model = model.cuda()\n"),
        ('print("cuda:0 is busy")\n', 'print("cuda:0 is busy")\n'),
    ],
)
def test_explicit_first_gpu_becomes_this_ranks_device(before, after):
    (code,), _ = rewrite(before)
    assert code == after


@pytest.mark.parametrize(
    "before, after",
    [
        ('device = torch.device(f"cuda:{gpu}")\n', "device = torch.device(_nbddp.device())\n"),
        ("device = torch.device(f'cuda:0')\n", "device = torch.device(_nbddp.device())\n"),  # aicloud's notebook
        ("x = x.to(f'cuda:{args.gpu_id}')\n", "x = x.to(_nbddp.device())\n"),
        ('device = "cuda:%d" % i\n', "device = _nbddp.device()\n"),
        ('device = "cuda:{}".format(cfg.gpu)\n', "device = _nbddp.device()\n"),
        ('device = "cuda:" + str(rank)\n', "device = _nbddp.device()\n"),
        ('device = torch.device("cuda", local_rank)\n', "device = _nbddp.device()\n"),
        ('device = torch.device("cuda:1")\n', "device = torch.device(_nbddp.device())\n"),
        ("model.cuda(args.gpu)\n", "model.cuda(_nbddp.device())\n"),
        ("torch.cuda.set_device(local_rank)\n", "torch.cuda.set_device(_nbddp.device())\n"),
        # text that only mentions a GPU stays
        ('print(f"cuda:{gpu} is busy")\n', 'print(f"cuda:{gpu} is busy")\n'),
        ("model.cuda(non_blocking=True)\n", "model.cuda(non_blocking=True)\n"),
    ],
)
def test_a_computed_gpu_index_becomes_this_ranks_device(before, after):
    (code,), changes = rewrite(before)
    assert code == after
    if before != after:
        assert [(rule, line) for rule, line, _ in changes] == [("device", 1)]
        assert "this rank's device" in changes[0][2]


# ------------------------------------------------------------------------------------------- DataParallel

DP_LOOP = "opt = SGD(model.parameters())\nfor x, y in loader:\n    crit(model(x), y).backward()\n    opt.step()\n"


@pytest.mark.parametrize("call, kept", [
    ("nn.DataParallel(model, device_ids=list(range(n_gpus)))", "model, device_ids=list(range(n_gpus))"),
    ("torch.nn.DataParallel(model)", "model"),
    ("DataParallel(model, device_ids=[0, 1], output_device=0)", "model, device_ids=[0, 1], output_device=0"),
    ("torch.nn.parallel.DataParallel(module=model)", "module=model"),
])
def test_data_parallel_becomes_ddp_over_the_ranks(call, kept):
    cells, changes = rewrite(
        "loader = DataLoader(ds, batch_size=8, shuffle=True)\n",
        f"model = Net().to(device)\nif torch.cuda.device_count() > 1:\n    model = {call}\n" + DP_LOOP,
    )
    assert f"    model = _nbddp.data_parallel({kept})\n" in cells[1]
    assert "DataParallel(" not in cells[1]
    said = [(line, message) for rule, line, message in changes if rule == "data_parallel"]
    assert len(said) == 1 and said[0][0] == 3 and "DistributedDataParallel" in said[0][1]


@pytest.mark.parametrize("count", ["torch.cuda.device_count()", "cuda.device_count()"])
def test_the_notebooks_device_count_is_the_gpus_this_rank_uses(count):
    # the kernel's 32 * 2 GPUs was one step of 64 split by DataParallel; each rank counting 2 took 64 (step 128)
    cells, changes = rewrite(f"bs = 32 * {count}\nloader = DataLoader(ds, batch_size=bs, shuffle=True)\n",
                             "model = Net().to(device)\n" + DP_LOOP)
    assert cells[0].startswith("bs = 32 * _nbddp.device_count()\n")
    said = [(line, message) for rule, line, message in changes if rule == "device_count"]
    assert len(said) == 1 and said[0][0] == 1 and "the GPUs this rank uses" in said[0][1]


def test_device_count_imported_from_torch_cuda_is_rebound_to_the_ranks_count():
    cells, changes = rewrite("from torch.cuda import device_count as n_gpu, is_available\nbs = 32 * n_gpu()\n"
                             "loader = DataLoader(ds, batch_size=bs, shuffle=True)\n", "model = Net()\n" + DP_LOOP)
    assert cells[0].startswith("from torch.cuda import device_count as n_gpu, is_available; "
                               "n_gpu = _nbddp.device_count\n")
    assert [line for rule, line, _ in changes if rule == "device_count"] == [1]


def test_a_trainers_device_count_stays_torchs():
    # per_device_train_batch_size is per GPU in the kernel's DataParallel Trainer as in a rank
    src = "args = TrainingArguments(per_device_train_batch_size=64 // torch.cuda.device_count())\n"
    cells, changes = rewrite(src, "trainer = Trainer(model=m, args=args)\ntrainer.train()\n")
    assert "64 // torch.cuda.device_count()" in cells[0] and not [c for c in changes if c[0] == "device_count"]


def test_distributed_data_parallel_and_isinstance_checks_stay():
    src = ("model = DistributedDataParallel(model, device_ids=[rank])\n"
           "inner = model.module if isinstance(model, nn.DataParallel) else model\n")
    (code,), changes = rewrite(src)
    assert code == src and not [c for c in changes if c[0] == "data_parallel"]


# ------------------------------------------------------------------------------------------- autocast


@pytest.mark.parametrize(
    "before, after",
    [
        ("with torch.cuda.amp.autocast():\n    y = f(x)\n", 'with torch.amp.autocast("cuda"):\n    y = f(x)\n'),
        ("with torch.cuda.amp.autocast(dtype=torch.float16):\n    pass\n",
         'with torch.amp.autocast("cuda", dtype=torch.float16):\n    pass\n'),
        ("with torch.cuda.amp.autocast(True, torch.bfloat16):\n    pass\n",
         'with torch.amp.autocast("cuda", enabled=True, dtype=torch.bfloat16):\n    pass\n'),
        ("scaler = torch.cuda.amp.GradScaler()\n", 'scaler = torch.amp.GradScaler("cuda")\n'),
        ("scaler = torch.cuda.amp.GradScaler(enabled=use_amp)\n", 'scaler = torch.amp.GradScaler("cuda", enabled=use_amp)\n'),
        ("with torch.amp.autocast('cuda'):\n    pass\n", "with torch.amp.autocast('cuda'):\n    pass\n"),
    ],
)
def test_cuda_amp_becomes_torch_amp(before, after):
    (code,), _ = rewrite(before)
    assert code == after


def test_names_imported_from_torch_cuda_amp_in_another_cell():
    (imp, use), _ = rewrite("from torch.cuda.amp import autocast\n", "with autocast(dtype=torch.float16):\n    pass\n")
    assert imp == "from torch.amp import autocast\n"
    assert use == 'with autocast("cuda", dtype=torch.float16):\n    pass\n'


def test_names_imported_from_torch_cuda_amp():
    (code,), _ = rewrite("from torch.cuda.amp import autocast, GradScaler\nscaler = GradScaler()\nwith autocast():\n    pass\n")
    assert code == 'from torch.amp import autocast, GradScaler\nscaler = GradScaler("cuda")\nwith autocast("cuda"):\n    pass\n'


# ------------------------------------------------------------------------------------------- trainer config


#: A cell that makes the notebook a PEFT one: ``ddp_find_unused_parameters=False`` is safe there.
PEFT = "model = get_peft_model(model, LoraConfig(r=8))\n"


def test_trainer_config_gets_ddp_safe_settings_unless_set():
    (_, a, b), changes = rewrite(PEFT, 'args = SFTConfig(output_dir="o")\n', 'args2 = TrainingArguments("o", ddp_find_unused_parameters=True)\n')
    assert a == 'args = SFTConfig(output_dir="o", ddp_find_unused_parameters=False, log_on_each_node=False)\n'
    assert b == 'args2 = TrainingArguments("o", ddp_find_unused_parameters=True, log_on_each_node=False)\n'
    # the user's value is kept, and the change list says so
    assert ("trainer_config", 1, "TrainingArguments: kept ddp_find_unused_parameters=True as written (DDP-safe: False)") in changes


@pytest.mark.parametrize("config", ["TrainingArguments", "Seq2SeqTrainingArguments", "SFTConfig", "DPOConfig",
                                    "GRPOConfig", "ORPOConfig", "KTOConfig", "RewardConfig", "trl.SFTConfig",
                                    "UnslothTrainingArguments"])
def test_every_trainer_config_is_recognised(config):
    (_, code), _ = rewrite(PEFT, f"a = {config}(output_dir='o')\n")
    assert "ddp_find_unused_parameters=False" in code


def test_gradient_checkpointing_gets_non_reentrant_kwargs():
    (code,), _ = rewrite("a = TrainingArguments('o', gradient_checkpointing=True)\n")
    assert 'gradient_checkpointing_kwargs={"use_reentrant": False}' in code
    (code,), _ = rewrite("a = TrainingArguments('o', gradient_checkpointing=True, gradient_checkpointing_kwargs={'use_reentrant': True})\n")
    assert code.count("gradient_checkpointing_kwargs") == 1 and "'use_reentrant': True" in code


def test_trainer_config_one_argument_per_line():
    (_, code), _ = rewrite(
        PEFT,
        """\
        args = SFTConfig(
            output_dir = "outputs",
            max_steps = 60,
        )
        """
    )
    assert code == dedent(
        """\
        args = SFTConfig(
            output_dir = "outputs",
            max_steps = 60,
            ddp_find_unused_parameters=False,
            log_on_each_node=False,
        )
        """
    )


def test_trainer_config_with_star_kwargs_is_left_alone():
    (code,), changes = rewrite("args = TrainingArguments(**cfg)\n")
    assert code == "args = TrainingArguments(**cfg)\n" and "left alone" in changes[0][2]


# ------------------------------------------------------------------------------------------- rank 0


def test_everything_after_the_last_training_call_is_rank_zero_only():
    cells, changes = rewrite(
        "trainer = SFTTrainer(model=m)\n",
        "x = 1\nstats = trainer.train()\nprint(stats)\n",
        "# save it\nmodel.save_pretrained('out')\n",
    )
    assert cells[0] == "trainer = SFTTrainer(model=m)\n"
    assert cells[1] == "x = 1\nstats = trainer.train()\nif _nbddp.on_rank0():\n    print(stats)\n"
    assert cells[2] == "# save it\nif _nbddp.on_rank0():\n    model.save_pretrained('out')\n"
    assert [c for c in changes if c[0] == "rank0"] == [
        ("rank0", 3, "runs on rank 0 only (after training)"),
        ("rank0", 2, "runs on rank 0 only (after training)"),
    ]


@pytest.mark.parametrize(
    "tail",
    ["model.push_to_hub('me/m')", "model.push_to_hub_merged('me/m', tokenizer)", "model.save_pretrained_merged('o', tok)",
     "model.save_pretrained_gguf('o', tok, quantization_method='q4_k_m')", "out = model.generate(**inputs)",
     "plt.plot(losses)", "trainer.save_model('o')", "FastLanguageModel.for_inference(model)"],
)
def test_tail_actions_run_on_rank_zero(tail):
    (_, code), _ = rewrite("trainer = Trainer(model=m)\n", f"trainer.train()\n{tail}\n")
    assert code == f"trainer.train()\nif _nbddp.on_rank0():\n    {tail}\n"


def test_unsloth_train_is_a_training_call():
    (code,), _ = rewrite("stats = unsloth_train(trainer)\nmodel.save_pretrained('o')\n")
    assert code == "stats = unsloth_train(trainer)\nif _nbddp.on_rank0():\n    model.save_pretrained('o')\n"


def test_evaluate_after_training_stays_on_every_rank_with_what_it_needs():
    cells, changes = rewrite(
        "trainer = Trainer(model=m, args=a)\ntrainer.train()\n",
        "small = ds['test'].select(range(10))\nmetrics = trainer.evaluate(small)\nprint(metrics)\ntrainer.save_model('o')\n",
    )
    assert cells[1] == (
        "small = ds['test'].select(range(10))\nmetrics = trainer.evaluate(small)\n"
        "if _nbddp.on_rank0():\n    print(metrics)\n    trainer.save_model('o')\n"
    )
    said = [c[1:] for c in changes if c[0] == "rank0"]
    assert (1, "stays on every rank: binds small, which code on every rank uses") in said
    assert (2, "stays on every rank: trainer.evaluate() needs every rank") in said


def test_several_training_calls():
    cells, changes = rewrite(
        "sft = SFTTrainer(model=model, args=a)\nsft.train()\n",
        "model.save_pretrained('stage1')\nprint('stage 1 done')\nsample = model.generate(**inputs)\n",
        "pairs = ds.map(to_pairs)\ndpo = DPOTrainer(model=model, args=b, train_dataset=pairs)\n",
        "dpo.train()\n",
        "model.save_pretrained('stage2')\n",
    )
    # between the trainings: saving, printing and generating on rank 0; preparing the next one on every rank
    assert cells[1] == (
        "if _nbddp.on_rank0():\n    model.save_pretrained('stage1')\n    print('stage 1 done')\n"
        "    sample = model.generate(**inputs)\n"
    )
    assert cells[2] == (
        "with _nbddp.main_process_first():\n    pairs = ds.map(to_pairs)\n"
        "dpo = DPOTrainer(model=model, args=b, train_dataset=pairs)\n"
    )
    assert cells[3] == "dpo.train()\n"
    assert cells[4] == "if _nbddp.on_rank0():\n    model.save_pretrained('stage2')\n"
    assert ("rank0", 1, "runs on rank 0 only (between training runs)") in changes


def test_between_trainings_a_name_the_next_training_reads_stays_on_every_rank():
    cells, _ = rewrite(
        "t1 = Trainer(model=m)\nt1.train()\n",
        "merged = model.merge_and_unload()\nmerged.save_pretrained('o')\n",
        "t2 = Trainer(model=merged)\nt2.train()\n",
    )
    assert cells[1] == "merged = model.merge_and_unload()\nif _nbddp.on_rank0():\n    merged.save_pretrained('o')\n"


def test_a_function_that_evaluates_is_called_on_every_rank():
    cells, _ = rewrite(
        "def report():\n    print(trainer.evaluate())\n",
        "trainer = Trainer(model=m)\ntrainer.train()\nreport()\nmodel.save_pretrained('o')\n",
    )
    assert cells[1].endswith("trainer.train()\nreport()\nif _nbddp.on_rank0():\n    model.save_pretrained('o')\n")


def test_model_train_is_not_a_training_call():
    cells, _ = rewrite("model.train()\nprint('mode set')\n")
    assert cells[0] == "model.train()\nprint('mode set')\n"


def test_shell_commands_after_training_stay_on_every_rank():
    # _nbddp.shell waits at a barrier: run by rank 0 alone it would wait for ever
    (code,), _ = rewrite("trainer = Trainer()\ntrainer.train()\n_nbddp.shell('ls outputs')\nprint(1)\n")
    assert code == "trainer = Trainer()\ntrainer.train()\n_nbddp.shell('ls outputs')\nif _nbddp.on_rank0():\n    print(1)\n"


def test_in_a_function_that_trains_saves_after_training_run_on_rank_zero_and_evaluate_on_every_rank():
    # run_sft.py's train_function: the Trainer saves on rank 0 itself, the tokenizer's save ran on every rank
    src = dedent(
        """\
        def train_function(args):
            trainer = SFTTrainer(model=m, args=args)
            print('starting')
            trainer.train()
            trainer.save_model(args.output_dir)
            tokenizer.save_pretrained(args.output_dir)
            metrics = trainer.evaluate()
            print(metrics)
            print(trainer.evaluate(small))
            return metrics

        train_function(a)
        """
    )
    (code,), changes = rewrite(src)
    assert code == dedent(
        """\
        def train_function(args):
            trainer = SFTTrainer(model=m, args=args)
            print('starting')
            trainer.train()
            if _nbddp.on_rank0():
                trainer.save_model(args.output_dir)
                tokenizer.save_pretrained(args.output_dir)
            metrics = trainer.evaluate()
            if _nbddp.on_rank0():
                print(metrics)
            print(trainer.evaluate(small))
            return metrics

        train_function(a)
        """
    )
    said = [c for c in changes if c[0] == "rank0_functions"]
    assert said == [
        ("rank0_functions", 5, "runs on rank 0 only (after training, in train_function)"),
        ("rank0_functions", 8, "runs on rank 0 only (after training, in train_function)"),
        ("rank0_functions", 9, "stays on every rank: trainer.evaluate() needs every rank"),
    ]


def test_in_a_function_what_every_rank_reads_after_or_waits_for_stays_on_every_rank():
    src = dedent(
        """\
        class Runner:
            def run(self, args):
                trainer = Trainer(model=self.model, args=args)
                trainer.train()
                sample = self.model.generate(**inputs)
                if args.save:
                    trainer.save_model('o')
                    PartialState().wait_for_everyone()
                print(sample)
                return sample

        trainer = Trainer(model=m)
        trainer.train()
        """
    )
    (code,), changes = rewrite(src)
    # sample is returned on every rank; a barrier rank 0 would wait at alone; print alone goes to rank 0
    assert code.startswith(src.split("        print(sample)")[0])
    assert "        if _nbddp.on_rank0():\n            print(sample)\n        return sample\n" in code
    said = [c[1:] for c in changes if c[0] == "rank0_functions"]
    assert (5, "stays on every rank: binds sample, which code on every rank uses") in said
    assert (6, "stays on every rank: PartialState().wait_for_everyone() needs every rank") in said


def test_in_a_function_a_statement_that_returns_stays_on_every_rank():
    # guarded, rank 0 would return while rank 1 went on to trainer.evaluate() alone and waited there for good
    src = dedent(
        """\
        def train(push):
            trainer = Trainer(model=m)
            trainer.train()
            if push:
                trainer.push_to_hub()
                return trainer
            print("done")
            metrics = trainer.evaluate()
            return metrics

        train(False)
        """
    )
    (code,), changes = rewrite(src)
    assert "    if push:\n        trainer.push_to_hub()\n        return trainer\n" in code
    assert "    if _nbddp.on_rank0():\n        print(\"done\")\n    metrics = trainer.evaluate()\n" in code
    said = [c[1:] for c in changes if c[0] == "rank0_functions"]
    assert (4, "stays on every rank: it returns from train, which every rank must do alike") in said


def test_in_a_function_a_guarded_statement_is_said_at_its_own_line_when_an_earlier_one_reads_the_same():
    (code,), changes = rewrite(
        "def go():\n    print('x')\n    trainer = Trainer(model=m)\n    trainer.train()\n    print('x')\n\ngo()\n"
    )
    assert code.endswith("    trainer.train()\n    if _nbddp.on_rank0():\n        print('x')\n\ngo()\n")
    assert [c for c in changes if c[0] == "rank0_functions"] == [
        ("rank0_functions", 5, "runs on rank 0 only (after training, in go)")]


def test_a_function_guarded_whole_after_training_is_not_guarded_again_inside():
    # nested rank-0 guards: under FSDP the guard is where every rank gathers, so rank 0 alone must never reach one
    (_, code), changes = rewrite(
        "trainer = Trainer(model=m)\n",
        "trainer.train()\ndef later():\n    trainer.train()\n    model.save_pretrained('o')\n",
    )
    assert code == "trainer.train()\nif _nbddp.on_rank0():\n    def later():\n        trainer.train()\n        model.save_pretrained('o')\n"
    assert not [c for c in changes if c[0] == "rank0_functions"]


def test_plain_loop_functions_are_left_to_the_loop_output_rule():
    (code,), changes = rewrite(
        "def fit():\n    for x, y in train_loader:\n        loss_fn(model(x), y).backward()\n"
        "    model.save_pretrained('o')\n\nfit()\n"
    )
    assert "    model.save_pretrained('o')\n" in code and "on_rank0" not in code
    assert not [c for c in changes if c[0] == "rank0_functions"]


# ------------------------------------------------------------------------------------------- if False


def test_if_false_blocks_stay_as_they_are():
    src = dedent(
        """\
        trainer = SFTTrainer(model=m)
        if False:
            m = AutoModelForCausalLM.from_pretrained("x", device_map="auto")
            trainer.train()
            args = SFTConfig(output_dir="o")
        x = torch.device("cuda:0")
        """
    )
    (code,), _ = rewrite(src)
    # nothing inside changed, and the training call in it does not count
    assert code == src.replace('torch.device("cuda:0")', "torch.device(_nbddp.device())")


def test_if_false_in_the_tail_is_guarded_as_a_whole_but_unchanged():
    (code,), _ = rewrite("trainer = SFTTrainer()\ntrainer.train()\nif False:\n    model.save_pretrained_gguf('m', tok)\n")
    assert code.endswith("if _nbddp.on_rank0():\n    if False:\n        model.save_pretrained_gguf('m', tok)\n")


# ------------------------------------------------------------------------------------------- main process first


def test_dataset_preparation_runs_on_the_first_process_first():
    cells, changes = rewrite(
        "ds = load_dataset('imdb', split='train')\nds = ds.map(tokenize, batched=True)\nn = len(ds)\n",
        "def tokenize(b):\n    return tok(b['text'])\n",
        "squares = list(map(f, xs))\n",
        "trainer = Trainer(train_dataset=ds)\ntrainer.train()\n",
    )
    assert cells[0] == (
        "with _nbddp.main_process_first():\n    ds = load_dataset('imdb', split='train')\n"
        "    ds = ds.map(tokenize, batched=True)\nn = len(ds)\n"
    )
    assert cells[1] == "def tokenize(b):\n    return tok(b['text'])\n"
    assert cells[2] == "squares = list(map(f, xs))\n"  # the builtin map is not dataset preparation
    assert ("main_process_first", 1, "dataset preparation: the first process of each machine runs it first, "
            "the others read its cache") in changes


# ------------------------------------------------------------------------------------------- plain PyTorch

PLAIN = [
    "train_loader = DataLoader(train_ds, batch_size=32, shuffle=True, num_workers=2)\n"
    "valid_loader = DataLoader(valid_ds, batch_size=64)\n",
    "model = Net().to(device)\noptimizer = torch.optim.Adam(model.parameters(), lr=1e-3)\n",
    dedent(
        """\
        for epoch in range(EPOCHS):
            model.train()
            for xb, yb in train_loader:
                loss = loss_fn(model(xb), yb)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            print(f"epoch {epoch}: {loss.item():.4f}")
            torch.save(model.state_dict(), "last.pt")
        """
    ),
    "torch.save(model.state_dict(), 'model.pt')\nprint('saved')\n",
]


def test_plain_pytorch_loop():
    cells, changes = rewrite(*PLAIN)
    assert cells[0] == (
        "train_loader = DataLoader(train_ds, batch_size=32, sampler=_nbddp.distributed_sampler(train_ds, shuffle=True), num_workers=2)\n"
        "valid_loader = DataLoader(valid_ds, batch_size=64)\n"
    )
    assert cells[1] == "model = Net().to(device)\nmodel = _nbddp.ddp(model)\noptimizer = torch.optim.Adam(model.parameters(), lr=1e-3)\n"
    assert cells[2] == dedent(
        """\
        for epoch in range(EPOCHS):
            _nbddp.set_epoch(train_loader, epoch)
            model.train()
            for xb, yb in train_loader:
                loss = loss_fn(model(xb), yb)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            _nbddp.print0(f"epoch {epoch}: {loss.item():.4f}")
            if _nbddp.on_rank0(): torch.save(_nbddp.unwrap(model).state_dict(), "last.pt")
        """
    )
    assert cells[3] == (
        "if _nbddp.on_rank0():\n    model = _nbddp.unwrap(model)\n"
        "    torch.save(_nbddp.unwrap(model).state_dict(), 'model.pt')\n    print('saved')\n"
    )
    rules = {c[0] for c in changes}
    assert {"sampler", "ddp_wrap", "set_epoch", "loop_output", "unwrap", "rank0"} <= rules


@pytest.mark.parametrize("save, saved", [
    ("torch.save(model, 'm.pt')", "torch.save(_nbddp.unwrap(model), 'm.pt')"),
    ("torch.save(obj=model, f='m.pt')", "torch.save(obj=_nbddp.unwrap(model), f='m.pt')"),
    ("torch.save(f='m.pt', obj=model)", "torch.save(f='m.pt', obj=_nbddp.unwrap(model))"),
    ("torch.save(history, f='m.pt')", "torch.save(history, f='m.pt')"),
])
def test_a_whole_model_save_pickles_the_module_inside_ddp_however_its_arguments_are_named(save, saved):
    cells, _ = rewrite(*PLAIN[:3], save + "\n")
    assert saved in cells[3]


def test_training_function_called_from_an_epoch_loop():
    cells, _ = rewrite(
        "loader = DataLoader(ds, batch_size=8, shuffle=True)\nmodel = MLP()\nmodel.to(device)\nopt = AdamW(model.parameters())\n",
        dedent(
            """\
            def train_one_epoch(model, loader):
                for x, y in loader:
                    loss = crit(model(x), y)
                    loss.backward()
                    opt.step()
                print("loss", loss.item())
            """
        ),
        "for epoch in range(3): train_one_epoch(model, loader)\n",
    )
    assert cells[0].splitlines()[2:4] == ["model.to(device)", "model = _nbddp.ddp(model)"]
    assert 'print("loss"' not in cells[1] and '_nbddp.print0("loss", loss.item())' in cells[1]
    assert cells[2] == "for epoch in range(3): _nbddp.set_epoch(loader, epoch); train_one_epoch(model, loader)\n"


def test_model_built_inside_a_fold_loop_is_wrapped_there():
    (code,), _ = rewrite(
        dedent(
            """\
            for fold in range(5):
                train_dl = DataLoader(folds[fold], batch_size=16)
                model = Net().to(device)
                opt = SGD(model.parameters(), lr=0.1)
                for epoch in range(2):
                    for x, y in train_dl:
                        crit(model(x), y).backward()
                        opt.step()
            """
        )
    )
    lines = code.splitlines()
    assert lines[2:4] == ["    model = Net().to(device)", "    model = _nbddp.ddp(model)"]
    assert "sampler=_nbddp.distributed_sampler(folds[fold], shuffle=False)" in lines[1]  # a training loader by name
    # set_epoch on the epoch loop, not the fold loop
    assert lines[6] == "        _nbddp.set_epoch(train_dl, epoch)"
    assert code.count("set_epoch") == 1


def test_the_tail_unwraps_a_model_bound_in_a_loop_but_not_one_local_to_a_function():
    cells, _ = rewrite(
        "def fit(loader):\n    net = Net()\n    o = SGD(net.parameters())\n    for x in loader:\n        net(x).sum().backward()\n",
        "for fold in range(2):\n    model = Net().to(device)\n    opt = SGD(model.parameters())\n"
        "    for x in train_dl:\n        model(x).sum().backward()\n",
        "preds = model(test_x)\n",
    )
    assert cells[2] == "if _nbddp.on_rank0():\n    model = _nbddp.unwrap(model)\n    preds = model(test_x)\n"


def test_the_tail_unwraps_once_in_its_first_rank0_block():
    cells, _ = rewrite(*PLAIN, "preds = model(test_x)\n", "x = 1\n", "print(model(test_x).argmax())\nplt.plot(preds)\n")
    assert "".join(cells).count("_nbddp.unwrap(model)\n") == 1
    assert cells[3].startswith("if _nbddp.on_rank0():\n    model = _nbddp.unwrap(model)\n")
    assert cells[4] == "if _nbddp.on_rank0():\n    preds = model(test_x)\n"
    assert cells[6] == "if _nbddp.on_rank0():\n    print(model(test_x).argmax())\n    plt.plot(preds)\n"


def test_the_tail_unwraps_again_after_every_rank_rebinds_the_model():
    # the fold models stay wrapped on every rank; ``model = models[0]`` runs on every rank (a collective
    # reads it), so rank 0's ``model`` is a DDP wrapper again and the next rank-0 block unwraps it again
    cells, _ = rewrite(
        "models = []\nfor fold in range(2):\n    model = Net().to(device)\n    opt = SGD(model.parameters())\n"
        "    for x in train_dl:\n        model(x).sum().backward()\n    models.append(model)\n",
        "print('trained')\n",
        "model = models[0]\ndist.all_reduce(model(test_x))\n",
        "preds = model(test_x)\n",
        "print(preds)\n",
    )
    assert cells[1] == "if _nbddp.on_rank0():\n    model = _nbddp.unwrap(model)\n    print('trained')\n"
    assert cells[2] == "model = models[0]\ndist.all_reduce(model(test_x))\n"
    assert cells[3] == "if _nbddp.on_rank0():\n    model = _nbddp.unwrap(model)\n    preds = model(test_x)\n"
    assert cells[4] == "if _nbddp.on_rank0():\n    print(preds)\n"


def test_dataset_expression_is_evaluated_once():
    (code, _), _ = rewrite(
        "train_loader = DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True)\n",
        "for x, y in train_loader:\n    loss(x, y).backward()\n",
    )
    assert code == (
        "train_loader = DataLoader((_nbddp_dataset := TensorDataset(x, y)), batch_size=4, "
        "sampler=_nbddp.distributed_sampler(_nbddp_dataset, shuffle=True))\n"
    )
    compile(code, "x", "exec")


def test_loader_with_its_own_sampler_is_left_alone():
    src = "train_loader = DataLoader(ds, batch_size=4, sampler=WeightedRandomSampler(w, 10))\n"
    (code, _), _ = rewrite(src, "for x in train_loader:\n    loss(x).backward()\n")
    assert code == src


def test_plain_rules_stay_out_of_trainer_notebooks():
    src = "dl = DataLoader(ds, shuffle=True)\nmodel = M()\nopt = AdamW(model.parameters())\ntrainer = Trainer(model=model, optimizers=(opt, None))\n"
    (code,), _ = rewrite(src + "trainer.train()\n")
    assert code == src + "trainer.train()\n"


def test_notebooks_that_distribute_themselves_are_left_to_it():
    src = "accelerator = Accelerator()\nmodel, opt, dl = accelerator.prepare(model, AdamW(model.parameters()), DataLoader(ds, shuffle=True))\n"
    (code,), _ = rewrite(src + "for x in dl:\n    accelerator.backward(loss(x))\n")
    assert code.startswith(src)


# ------------------------------------------------------------------------------------------- accelerate

ACCELERATE_IN_A_LAUNCHER = (
    "from accelerate import Accelerator, notebook_launcher\n",
    "def make_loader(df, bs, shuffle):\n    ds = MyDS(df)\n    return DataLoader(ds, batch_size=bs, shuffle=shuffle)\n",
    dedent(
        """\
        def train_fn(cfg):
            accelerator = Accelerator(mixed_precision="fp16")
            train_loader = make_loader(train_df, 8, True)
            valid_loader = make_loader(valid_df, 8, False)
            model = Net()
            optimizer = AdamW(model.parameters())
            model, optimizer, train_loader, valid_loader = accelerator.prepare(model, optimizer, train_loader, valid_loader)
            for epoch in range(2):
                for batch in train_loader:
                    loss = crit(model(batch["x"]), batch["y"])
                    accelerator.backward(loss)
                    optimizer.step()
        """
    ),
    "notebook_launcher(train_fn, (cfg,), num_processes=2)\n",
)


def test_a_helpers_loader_reaches_accelerate_without_nbddps_sampler():
    # the LMSYS kernel's shape: loaders made by a helper, prepared inside the notebook_launcher function;
    # with nbddp's sampler under Accelerate's own sharding each rank read a quarter of the rows
    cells, changes = rewrite(*ACCELERATE_IN_A_LAUNCHER)
    assert ("accelerator.prepare(model, optimizer, _nbddp.for_accelerate(train_loader), "
            "_nbddp.for_accelerate(valid_loader))") in cells[2]
    said = [(line, m) for rule, line, m in changes if rule == "accelerate"]
    assert [line for line, _ in said] == [7, 7] and "train_loader" in said[0][1]


def test_a_helpers_loader_prepared_at_the_top_level_reaches_accelerate_without_nbddps_sampler():
    cells, changes = rewrite(
        ACCELERATE_IN_A_LAUNCHER[0], ACCELERATE_IN_A_LAUNCHER[1],
        "accelerator = Accelerator()\ntrain_loader = make_loader(train_df, 8, True)\nmodel = Net()\n"
        "optimizer = AdamW(model.parameters())\n",
        "model, optimizer, train_loader = accelerator.prepare(model, optimizer, train_loader)\n",
        "for batch in train_loader:\n    loss = crit(model(batch['x']), batch['y'])\n    accelerator.backward(loss)\n"
        "    optimizer.step()\n",
    )
    assert "_nbddp.for_accelerate(train_loader)" in cells[3] and "_nbddp.for_accelerate(optimizer)" not in cells[3]
    assert any(rule == "accelerate" and "train_loader" in m for rule, _, m in changes)
