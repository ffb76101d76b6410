"""What the converter writes for the notebooks of "train correctly or refuse loudly", cell by cell (no ranks)."""

import textwrap

import pytest



# ------------------------------------------------------------------ inserted keywords keep the comments


def test_a_comment_after_the_last_argument_stays_on_its_line(rewrite):
    (code,), _ = rewrite(
        """\
        args = TrainingArguments(
            output_dir="out",
            push_to_hub=True  # Automatically push the trained model
        )
        """
    )
    assert code == textwrap.dedent(
        """\
        args = TrainingArguments(
            output_dir="out",
            push_to_hub=True,  # Automatically push the trained model
            log_on_each_node=False
        )
        """
    )


def test_comments_of_arguments_and_below_them_stay_where_they_were(rewrite):
    (code,), _ = rewrite(
        """\
        args = TrainingArguments(
            output_dir="out",  # where
            push_to_hub=True,  # Automatically push the trained model

            # report_to="wandb",
        )
        """
    )
    assert code == textwrap.dedent(
        """\
        args = TrainingArguments(
            output_dir="out",  # where
            push_to_hub=True,  # Automatically push the trained model

            # report_to="wandb",
            log_on_each_node=False,
        )
        """
    )


def test_a_single_argument_call_on_its_own_lines(rewrite):
    (code,), _ = rewrite('args = TrainingArguments(\n    "out"  # the folder\n)\n')
    assert code == 'args = TrainingArguments(\n    "out",  # the folder\n    log_on_each_node=False\n)\n'


# ------------------------------------------------------------------ ddp_find_unused_parameters


def test_a_full_fine_tune_keeps_the_trainers_own_choice_of_unused_parameters(rewrite):
    (_, code), changes = rewrite(
        "model = AutoModelForAudioClassification.from_pretrained('facebook/wav2vec2-base')\n",
        "args = TrainingArguments('out', learning_rate=3e-5)\n",
    )
    assert "ddp_find_unused_parameters" not in code and "log_on_each_node=False" in code
    assert not any("LoRA" in message or "PEFT" in message for _, _, message in changes)


@pytest.mark.parametrize("peft", [
    "model = get_peft_model(model, LoraConfig(r=8))\n",
    "model = FastLanguageModel.get_peft_model(model, r=16)\n",
    "model = PeftModel.from_pretrained(base, 'adapter')\n",
    "trainer = SFTTrainer(model=model, args=args, peft_config=LoraConfig(r=8))\n",
])
def test_a_peft_model_gets_find_unused_parameters_off(rewrite, peft):
    (code, _), changes = rewrite("args = SFTConfig('out')\n", peft)
    assert "ddp_find_unused_parameters=False" in code
    assert ("trainer_config", 1, "SFTConfig: ddp_find_unused_parameters=False (a PEFT model: every LoRA weight "
            "trains each step)") in changes


# ------------------------------------------------------------------ which loaders are training loaders

LOOP = """\
for epoch in range(3):
    for xb, yb in {loader}:
        loss = model(xb).sum()
        loss.backward()
        optimizer.step()
"""


def test_a_loader_a_training_loop_iterates_is_sharded_whatever_its_name(rewrite):
    (code, _, loop), _ = rewrite(
        "dl = DataLoader(ds, batch_size=8)\nval = DataLoader(vs, batch_size=8)\n",
        "optimizer = SGD(model.parameters())\n",
        LOOP.format(loader="dl"),
    )
    assert "dl = DataLoader(ds, batch_size=8, sampler=_nbddp.distributed_sampler(ds, shuffle=False))" in code
    assert "val = DataLoader(vs, batch_size=8)\n" in code
    assert "_nbddp.set_epoch(dl, epoch)" in loop


def test_a_loader_factory_shards_when_asked_to_shuffle(rewrite):
    (code, _, loop), changes = rewrite(
        "def make(ds, shuffle):\n    return DataLoader(ds, batch_size=8, shuffle=shuffle)\n"
        "train_dl = make(a, shuffle=True)\neval_dl = make(b, shuffle=False)\n",
        "optimizer = SGD(model.parameters())\n",
        LOOP.format(loader="train_dl"),
    )
    assert "sampler=_nbddp.distributed_sampler(ds, shuffle=shuffle) if shuffle else None)" in code
    assert "_nbddp.set_epoch(train_dl, epoch)" in loop and "eval_dl" not in loop
    assert any("whole data set otherwise" in m for _, _, m in changes)


EVAL_IN_EPOCH = """\
for epoch in range(3):
    for batch in tqdm({train}):
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
    for batch in tqdm({evaluation}):
        model(**batch)
"""


@pytest.mark.parametrize("build", [
    "eval_dataloader = DataLoader(eval_ds, batch_size=8)\n",
    "def make(ds, shuffle):\n    return DataLoader(ds, batch_size=8, shuffle=shuffle)\n"
    "eval_dataloader = make(eval_ds, shuffle=False)\n",
])
def test_an_evaluation_loader_in_the_epoch_loop_gets_no_set_epoch_nor_a_claim_of_one(rewrite, build):
    """An evaluation loader keeps its whole data set (no DistributedSampler): set_epoch would reshuffle
    nothing, and --explain must not say it does."""
    (_, _, loop), changes = rewrite(
        "train_dataloader = DataLoader(train_ds, shuffle=True, batch_size=8)\n" + build,
        "optimizer = SGD(model.parameters())\n",
        EVAL_IN_EPOCH.format(train="train_dataloader", evaluation="eval_dataloader"),
    )
    assert "_nbddp.set_epoch(train_dataloader, epoch)" in loop
    assert "set_epoch(eval_dataloader" not in loop
    assert not [m for _, _, m in changes if "eval_dataloader" in m and "DistributedSampler" in m]


# ------------------------------------------------------------------ trainers built by a helper


@pytest.mark.parametrize("build", [
    "def create_trainer(m):\n    return SFTTrainer(model=m, args=args)\n",
    "from helpers import create_trainer\n",
])
def test_a_trainer_built_by_a_helper_trains(rewrite, build):
    (_, _, tail), changes = rewrite(build, "trainer_x = create_trainer(model)\ntrainer_x.train()\n",
                                    "trainer_x.save_model('final')\n")
    assert tail.startswith("if _nbddp.on_rank0():\n    trainer_x.save_model('final')")


# ------------------------------------------------------------------ saves read back before training


def test_a_save_read_back_before_training_runs_on_rank_0_and_every_rank_waits(rewrite):
    (save, load, _, _), changes = rewrite(
        "model.save_pretrained('base')\ntorch.save(head, 'head.pt')\n",
        "model = AutoModel.from_pretrained('base')\nhead = torch.load('head.pt')\n",
        "trainer = Trainer(model=model)\ntrainer.train()\n",
        "model.save_pretrained('final')\n",
    )
    assert save == ("if _nbddp.on_rank0():\n    model.save_pretrained('base')\n    torch.save(head, 'head.pt')\n"
                    "_nbddp.barrier()  # the other ranks read what rank 0 wrote\n")
    assert any(c[:2] == ("rank0", 1) and "runs on rank 0 only, once as in the kernel, and every rank waits" in c[2]
               for c in changes)


ONCE = "if _nbddp.on_rank0():\n    {}\n_nbddp.barrier()  # the other ranks read what rank 0 wrote\n"


@pytest.mark.parametrize("effect", [
    "model.save_pretrained('base')",
    "plt.savefig('data.png')",
    "os.system('pip install -q timm==0.9.2')",
    "subprocess.run(['pip', 'install', 'timm'], check=True)",
    "urllib.request.urlretrieve('https://example.com/data.csv', 'data.csv')",
])
def test_a_side_effect_before_training_happens_once_and_every_rank_waits_for_it(rewrite, effect):
    (code, _), changes = rewrite(effect + "\n", "trainer = Trainer(model=model)\ntrainer.train()\n")
    assert code == ONCE.format(effect)


def test_loaders_and_other_commands_before_training_stay_on_every_rank(rewrite):
    cells = ("os.system('nvidia-smi')\ntokenizer = AutoTokenizer.from_pretrained('m')\nprint('ready')\n",
             "trainer = Trainer(model=model)\ntrainer.train()\n")
    (code, _), _ = rewrite(*cells)
    assert code == cells[0]


# ------------------------------------------------------------------ loaders with a sampler of their own


def test_a_random_sampler_becomes_the_distributed_one_and_a_sequential_test_loader_stays_whole(rewrite):
    (code, _, _), changes = rewrite(
        "train_loader = DataLoader(ds, batch_size=8, sampler=RandomSampler(ds))\n"
        "test_loader = DataLoader(ts, batch_size=8, sampler=SequentialSampler(ts))\n"
        "dl = DataLoader(ds, sampler=SequentialSampler(ds))\n",
        "optimizer = SGD(model.parameters())\n",
        LOOP.format(loader="dl"),
    )
    assert "train_loader = DataLoader(ds, batch_size=8, sampler=_nbddp.distributed_sampler(ds, shuffle=True))" in code
    assert "test_loader = DataLoader(ts, batch_size=8, sampler=SequentialSampler(ts))" in code
    assert "dl = DataLoader(ds, sampler=_nbddp.distributed_sampler(ds, shuffle=False))" in code
    assert ("sampler", 1, "DataLoader: RandomSampler → DistributedSampler(shuffle=True), each rank reads its own "
            "share") in changes


def test_a_training_loader_with_another_sampler_is_said_to_be_left_alone(rewrite):
    (code, _, _), changes = rewrite(
        "train_loader = DataLoader(ds, sampler=WeightedRandomSampler(w, 64))\n",
        "optimizer = SGD(model.parameters())\n",
        LOOP.format(loader="train_loader"),
    )
    assert code == "train_loader = DataLoader(ds, sampler=WeightedRandomSampler(w, 64))\n"
    assert any("has a sampler of its own, left alone" in m for _, _, m in changes)
    assert not any("DistributedSampler(" in m for _, _, m in changes)  # --explain claims no sampler


# ------------------------------------------------------------------ Accelerate beside plain loops


def test_an_accelerator_leaves_other_plain_loops_to_nbddp(rewrite):
    (plain, accel), _ = rewrite(
        "train_loader = DataLoader(ds, shuffle=True)\nnet = Net()\nopt = SGD(net.parameters())\n"
        + LOOP.format(loader="train_loader").replace("model", "net").replace("optimizer", "opt"),
        "accelerator = Accelerator()\nmodel = Net()\noptimizer = SGD(model.parameters())\n"
        "dl = DataLoader(ds, shuffle=True)\nmodel, optimizer, dl = accelerator.prepare(model, optimizer, dl)\n"
        "for epoch in range(2):\n    for xb in dl:\n        accelerator.backward(model(xb).sum())\n",
    )
    assert "net = _nbddp.ddp(net)" in plain and "distributed_sampler(ds, shuffle=True)" in plain
    assert "_nbddp" not in accel


def test_plain_loops_over_what_a_later_cell_hands_to_accelerate_are_distributed_and_it_gets_them_whole(rewrite):
    """Course ch3 §4: plain loops train ``model`` over ``train_dataloader``, then a later cell hands that loader
    to ``accelerator.prepare``. The plain loops are nbddp's (sampler, DDP); Accelerate gets the loader as the
    notebook made it (it shards it itself: nbddp's sampler under it would shard twice)."""
    (loader, plain, accel), changes = rewrite(
        "train_dataloader = DataLoader(ds, shuffle=True, batch_size=8)\n",
        "model = Net()\noptimizer = SGD(model.parameters())\n" + LOOP.format(loader="train_dataloader"),
        "accelerator = Accelerator()\nmodel = Net()\noptimizer = SGD(model.parameters())\n"
        "train_dl, model, optimizer = accelerator.prepare(train_dataloader, model, optimizer)\n"
        "for epoch in range(2):\n    for xb in train_dl:\n        accelerator.backward(model(xb).sum())\n",
    )
    assert "sampler=_nbddp.distributed_sampler(ds, shuffle=True)" in loader
    assert "model = _nbddp.ddp(model)" in plain and "_nbddp.set_epoch(train_dataloader, epoch)" in plain
    assert "accelerator.prepare(_nbddp.for_accelerate(train_dataloader), model, optimizer)" in accel
    assert "_nbddp.ddp" not in accel and "set_epoch" not in accel
    assert any("train_dataloader goes to Accelerate as the notebook made it" in m for _, _, m in changes)


def test_a_model_trained_plainly_then_prepared_goes_to_accelerate_unwrapped(rewrite):
    (plain, accel), _ = rewrite(
        "model = Net()\noptimizer = SGD(model.parameters())\n" + LOOP.format(loader="train_loader"),
        "accelerator = Accelerator()\nmodel, optimizer = accelerator.prepare(model, optimizer)\n"
        "for xb in dl:\n    accelerator.backward(model(xb).sum())\n",
    )
    assert "model = _nbddp.ddp(model)" in plain
    assert "accelerator.prepare(_nbddp.for_accelerate(model), optimizer)" in accel
    assert "_nbddp.ddp" not in accel


HELPER_TRAINING = (
    "from going_modular import data_setup, engine\n"
    "train_dataloader, test_dataloader, class_names = data_setup.create_dataloaders(train_dir, test_dir, 32)\n",
    "model = torchvision.models.efficientnet_b0(weights=weights).to(device)\n"
    "for param in model.features.parameters():\n    param.requires_grad = False\n"
    "model.classifier = torch.nn.Sequential(torch.nn.Dropout(p=0.2), torch.nn.Linear(1280, 3)).to(device)\n"
    "summary(model)\n",
    "optimizer = torch.optim.Adam(model.parameters(), lr=0.001)\n",
    "results = engine.train(model=model, train_dataloader=train_dataloader, test_dataloader=test_dataloader,\n"
    "                       optimizer=optimizer, loss_fn=loss_fn, epochs=5, device=device)\n",
    "plot_loss_curves(results)\nprint(len(train_dataloader))\ntorch.save(model.state_dict(), 'model.pth')\n",
)


def test_training_through_an_imported_helper_is_recognised_and_distributed(rewrite):
    """pytorch_dl 06–09: ``engine.train(model=…, optimizer=…)`` from an imported module trains: the model is
    wrapped after its last change (head replaced, features frozen: DDP must see which weights train), the
    training loader it gets is sharded when the call runs, and what follows runs on rank 0."""
    (loaders, build, _, train, tail), changes = rewrite(*HELPER_TRAINING)
    assert build.endswith("model = _nbddp.ddp(model)\nsummary(model)\n"), build
    assert "train_dataloader=_nbddp.shard_loader(train_dataloader, name='train_dataloader')" in train
    assert "test_dataloader=test_dataloader" in train
    assert tail.startswith("if _nbddp.on_rank0():") and "print(len(train_dataloader))" in tail
    assert not any("no training call found" in m for _, _, m in changes)


def test_an_imported_helper_training_a_model_its_loop_builds_gets_its_loader_sharded(rewrite):
    """The facts record each call to a training helper by its place (line, column in characters: a name with
    ``é`` before it); the DDP wrap put into the loop before the call rebuilds the loop, and the sampler rule
    still finds the call the facts chose."""
    loop = ("for fold in range(2):\n"
            "    model = Net().to(device)\n"
            "    optimizer = torch.optim.Adam(model.parameters(), lr=0.001)\n"
            "    résultats = engine.train(model=model, train_dataloader=train_dataloader,\n"
            "                             test_dataloader=test_dataloader, optimizer=optimizer, epochs=1)\n"
            "    print(engine.train)\n")
    (_, new), changes = rewrite(HELPER_TRAINING[0], loop)
    assert "    model = _nbddp.ddp(model)\n    optimizer = " in new, new
    assert "engine.train(model=model, train_dataloader=_nbddp.shard_loader(train_dataloader, name='train_dataloader')," in new
    assert "test_dataloader=test_dataloader, optimizer" in new
    assert sum("handed to an imported training helper" in m for _, _, m in changes) == 1


def test_a_training_loader_an_imported_helper_returns_is_sharded_when_it_runs(rewrite):
    (code, _, _), changes = rewrite(
        "from helpers import create_dataloader\ntrain_loader = create_dataloader(ds, batch_size=8)\n"
        "test_loader = create_dataloader(ts, batch_size=8)\n",
        "optimizer = SGD(model.parameters())\n",
        LOOP.format(loader="train_loader"),
    )
    assert "train_loader = _nbddp.shard_loader(create_dataloader(ds, batch_size=8), name='train_loader')" in code
    assert "test_loader = create_dataloader(ts, batch_size=8)\n" in code
    assert any("a helper's loader, sharded when it runs" in m for _, _, m in changes)


def test_notebook_launcher_becomes_a_call_of_its_function_in_every_rank(rewrite):
    (a, b, c, d), changes = rewrite(
        "args = ('fp16', 42, 64)\nnotebook_launcher(training_loop, args, num_processes=2)\n",
        "notebook_launcher(training_function, (model,), num_processes=2)\n",
        "notebook_launcher(training_function)\n",
        "notebook_launcher(training_function, args, mixed_precision='fp16')\n",
    )
    assert a.endswith("\ntraining_loop(*args)\n") and b == "training_function(model)\n" and c == "training_function()\n"
    assert d == "notebook_launcher(training_function, args, mixed_precision='fp16')\n"  # the runtime's, with its precision
    assert sum("every rank of the job is already one of its processes" in m for _, _, m in changes) == 3


# ------------------------------------------------------------------ loops without a DataLoader


INDEX_SLICE = """\
for epoch in range(3):
    perm = torch.randperm(len(X))
    for i in range(0, len(X), bs):
        idx = perm[i:i + bs]
        loss = ((model(X[idx]) - y[idx]) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    print(epoch, loss.item())
"""


def test_a_loop_slicing_tensors_by_index_takes_its_ranks_positions(rewrite):
    (_, code), changes = rewrite(
        "model = Net()\noptimizer = torch.optim.SGD(model.parameters(), lr=0.1)", INDEX_SLICE)
    assert "    for i in _nbddp.shard_range(range(0, len(X), bs)):\n" in code
    assert "for epoch in range(3):" in code  # the epoch loop is not the data's
    said = [m for rule, line, m in changes if rule == "shard_loop"]
    assert len(said) == 1 and "each rank takes its own batch positions" in said[0]
    assert "as many steps" in said[0]


def test_a_loop_over_batch_numbers_and_a_loop_over_samples_are_sharded_too(rewrite):
    (_, code), _ = rewrite(
        "model = Net()\noptimizer = torch.optim.SGD(model.parameters(), lr=0.1)",
        """\
        def train(model, X, y, samples):
            for epoch in range(2):
                for b in tqdm(range(len(X) // 8), desc="batches"):
                    out = model(X[b * 8:(b + 1) * 8])
                    loss = out.sum()
                    loss.backward()
                    optimizer.step()
            for k, (xs, ys) in enumerate(samples):
                model(xs).sum().backward()
                optimizer.step()
            for xs, ys in zip(X_list, y_list):
                model(xs).sum().backward()

        train(model, X, y, samples)
        """)
    assert 'for b in tqdm(_nbddp.shard_range(range(len(X) // 8)), desc="batches"):' in code
    assert "for k, (xs, ys) in enumerate(_nbddp.shard_items(samples)):" in code
    assert "for xs, ys in zip(_nbddp.shard_items(X_list), _nbddp.shard_items(y_list)):" in code


def test_full_batch_descent_and_a_dataloader_loop_are_left_to_the_other_rules(rewrite):
    (_, code), changes = rewrite(
        "model = Net()\noptimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "train_loader = DataLoader(ds, batch_size=8, shuffle=True)",
        """\
        history = {}
        for epoch in range(100):
            loss = ((model(X) - y) ** 2).mean()
            loss.backward()
            optimizer.step()
            history[epoch] = loss.item()
            print(losses[epoch:])
        for xb, yb in train_loader:
            model(xb).sum().backward()
        """)
    assert "shard_range" not in code and "shard_items" not in code
    assert not [c for c in changes if c[0] == "shard_loop"]


def test_metrics_on_the_training_loader_after_training_count_its_whole_data_set(rewrite):
    (_, _, code), changes = rewrite(
        "train_loader = DataLoader(train_ds, batch_size=8, shuffle=True)\n"
        "test_loader = DataLoader(test_ds, batch_size=8)\n"
        "model = Net()\noptimizer = torch.optim.SGD(model.parameters(), lr=0.1)",
        """\
        for epoch in range(2):
            for xb, yb in train_loader:
                model(xb).sum().backward()
                optimizer.step()
        """,
        """\
        print("train accuracy", compute_accuracy(model, train_loader))
        print("test accuracy", compute_accuracy(model, test_loader))
        """)
    assert code.startswith("if _nbddp.on_rank0():\n    model = _nbddp.unwrap(model)\n"
                           "    train_loader = _nbddp.whole_loader(train_loader)\n    print(")
    assert "whole_loader(test_loader)" not in code
    assert any("train_loader: its whole data set again" in m for rule, line, m in changes if rule == "rank0")


# ------------------------------------------------------------------ trackers: one run, on rank 0


def test_a_summary_writer_and_mlflow_runs_are_made_on_rank_0_and_wandb_elsewhere_is_disabled(rewrite):
    (code, _), changes = rewrite(
        """\
        writer = SummaryWriter(log_dir="runs/exp")
        wandb.init(project="p", mode="offline")
        run = wandb.init(project="p")
        with mlflow.start_run():
            mlflow.log_param("lr", 0.1)
        """,
        "trainer = Trainer(model=model)\ntrainer.train()\n")
    assert code == textwrap.dedent(
        """\
        writer = _nbddp.rank0_only(SummaryWriter)(log_dir="runs/exp")
        wandb.init(project="p", mode=_nbddp.rank0_mode("offline"))
        run = wandb.init(project="p", mode=_nbddp.rank0_mode())
        with _nbddp.rank0_only(mlflow.start_run)():
            _nbddp.rank0_only(mlflow.log_param)("lr", 0.1)
        """)
    assert sum(rule == "trackers" for rule, _, _ in changes) == 5


def test_off_rank_0_a_tracker_is_a_stand_in_that_takes_any_call(monkeypatch):
    from nbddp.runtime import rank0_mode, rank0_only

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    writer = rank0_only(dict)(log_dir="x")
    writer.add_scalar("loss", 0.5, 1)
    with rank0_only(dict)() as run:
        run.info.run_id
    assert rank0_mode("online") == "disabled"
    monkeypatch.setenv("RANK", "0")
    assert rank0_only(dict)(a=1) == {"a": 1} and rank0_mode("online") == "online"


def test_a_figure_or_table_saved_in_the_training_loop_is_saved_by_rank_0(rewrite):
    (_, code), changes = rewrite(
        "model = Net()\noptimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "train_loader = DataLoader(ds, batch_size=8, shuffle=True)",
        """\
        for epoch in range(2):
            for xb, yb in train_loader:
                model(xb).sum().backward()
            plt.savefig(f"loss-{epoch}.png")
            history.to_csv(f"history-{epoch}.csv")
        """)
    assert "    if _nbddp.on_rank0(): plt.savefig(f\"loss-{epoch}.png\")\n" in code
    assert "    if _nbddp.on_rank0(): history.to_csv(f\"history-{epoch}.csv\")\n" in code
    assert any(m == "plt.savefig in the training loop: rank 0 saves" for _, _, m in changes)


def test_off_rank_0_a_summary_writer_leaves_its_folder_as_the_kernels_did(monkeypatch, tmp_path):
    """A later cell may look in the writer's folder (``os.walk(log_dir)`` for checkpoints): on rank 1 it must be
    there as in the kernel, not only once rank 0 has made it (rank 1 met a NameError when it looked first)."""
    from nbddp.runtime import rank0_only

    class SummaryWriter:  # the real one is not needed: the stand-in is chosen by the callee's name
        def __init__(self, log_dir=None):
            raise AssertionError("made off rank 0")

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    writer = rank0_only(SummaryWriter)(log_dir=tmp_path / "logs" / "log_run")
    writer.add_scalar("loss", 0.5, 1)
    assert (tmp_path / "logs" / "log_run").is_dir() and not any((tmp_path / "logs" / "log_run").iterdir())
    rank0_only(SummaryWriter)(logdir=str(tmp_path / "tbx"))  # tensorboardX's keyword
    assert (tmp_path / "tbx").is_dir()
